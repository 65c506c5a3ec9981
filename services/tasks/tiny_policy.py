"""A tokenizer and a randomly initialised Qwen2-architecture policy, built here (docs/architecture.md).

Nothing can be downloaded, so the demo and the tests make their own policy. It is saved with
`save_pretrained` in the same directory layout as a real checkpoint (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json), so every
consumer loads it through `AutoTokenizer` / `AutoModelForCausalLM` exactly as it would load
Qwen2.5-0.5B and nothing downstream knows the difference.

Why the tokenizer forces whole words: a from-scratch model copies a one-token name into a query
or an answer far faster than it learns to spell one (measured, issue 5), so the synthetic
world's names and answers come from a closed vocabulary that the tokenizer keeps as single
tokens, both with and without the leading space byte-level BPE attaches.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Qwen2.5's special tokens (ChatML); `<|endoftext|>` pads, `<|im_end|>` ends a turn.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)

# Agent-loop tags: added as single tokens but NOT special, so `decode(skip_special_tokens=True)`
# keeps them (Search-R1 decodes with skip_special_tokens and then parses the tags).
TAG_TOKENS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<search>",
    "</search>",
    "<answer>",
    "</answer>",
    "<information>",
    "</information>",
)

# Qwen2.5's ChatML layout without the default system prompt (it would cost a tiny model ~20
# tokens per example and teach nothing). A system message, when given, is rendered the same way.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Model sizes. tiny: ~2M parameters with a 2k vocabulary, the size measured to learn the demo
# world on a 2-core CPU (issue 5). small: ~30M, for a GPU or a patient CPU.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 192,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
    },
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
    },
}

# Qwen2's pre-tokenizer split (transformers' tokenization_qwen2.PRETOKENIZE_REGEX): words keep
# one leading non-letter (space, quote, bracket), digits split one by one.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Characters that the split regex glues in front of a word; a whole word is made one token
# after each of them too (" Name", "\"Name" in a passage title, "(Name").
WORD_PREFIXES: tuple[str, ...] = ("", " ", '"', "(")

# Written last into a built directory; its presence marks the directory complete.
MARKER_FILE = "forage_policy.json"


def build_tokenizer(
    texts: Iterable[str],
    out_dir: str | os.PathLike[str],
    vocab_size: int = 2048,
    whole_words: Iterable[str] = (),
) -> Path:
    """Train a byte-level BPE tokenizer on `texts` and save it as a fast HF tokenizer.

    Every word in `whole_words` encodes as one token, alone or after a space, quote or
    bracket (the characters the split regex attaches to a word). The BPE is trained
    first; merges that glue each word's remaining pieces are then appended at the lowest
    priority, so they change nothing else the trainer learned.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Qwen2's pipeline exactly (NFC, its split regex, byte level), because transformers rebuilds
    # a Qwen2Tokenizer from vocab + merges with that pipeline when it loads a qwen2 checkpoint.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_strip_tags(texts), trainer=trainer)
    words = sorted({w.strip() for w in whole_words if w.strip()})
    if words:
        tokenizer = _force_whole_words(tokenizer, words)
    tokenizer.add_special_tokens(
        [AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS]
    )
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAG_TOKENS])
    _save_hf_tokenizer(tokenizer, out)
    return out


def _strip_tags(texts: Iterable[str]) -> Iterable[str]:
    """Training text without the tags: they become added tokens, so BPE need not learn them."""
    for text in texts:
        for tag in TAG_TOKENS:
            text = text.replace(tag, " ")
        for tok in SPECIAL_TOKENS:
            text = text.replace(tok, " ")
        yield text


def _force_whole_words(tokenizer: Any, words: list[str]) -> Any:
    """Append BPE merges until each word (and ' ' + word) is one token.

    A word's pieces under the trained merges can no longer merge with each other, so merges
    appended after all trained ones fire only where we put them. A later word's new merges can
    in principle pre-empt an earlier word's chain, hence the loop until a fixed point.
    """
    from tokenizers import Tokenizer

    state = json.loads(tokenizer.to_str())
    model = state["model"]
    vocab: dict[str, int] = model["vocab"]
    merges: list[Any] = model["merges"]
    merge_set = {tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges}
    variants = [prefix + w for w in words for prefix in WORD_PREFIXES]
    for _ in range(10):
        current = Tokenizer.from_str(json.dumps(state))
        broken = False
        for variant in variants:
            pieces = current.encode(variant).tokens
            if len(pieces) == 1:
                continue
            broken = True
            merged = pieces[0]
            for piece in pieces[1:]:
                pair = (merged, piece)
                if pair not in merge_set:
                    merge_set.add(pair)
                    merges.append(list(pair))
                merged = merged + piece
                if merged not in vocab:
                    vocab[merged] = len(vocab)
        if not broken:
            return current
    raise RuntimeError("could not make every whole word a single token")


def _save_hf_tokenizer(tokenizer: Any, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out))
    # Name the class a Qwen2.5 checkpoint names, so the tokenizer directory alone and the model
    # directory (config.json says qwen2) load the same class with the same pipeline.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config.setdefault("chat_template", CHAT_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def build_tiny_policy(
    out_dir: str | os.PathLike[str],
    tokenizer_dir: str | os.PathLike[str],
    preset: str = "tiny",
    seed: int = 0,
) -> Path:
    """Create a randomly initialised Qwen2 causal LM for the tokenizer and save it (safetensors).

    The tokenizer files are copied next to the weights, so `out_dir` is a complete checkpoint.
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_act="silu",
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **PRESETS[preset],
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config = GenerationConfig(
        eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, bos_token_id=pad_id
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    _copy_tokenizer_files(Path(tokenizer_dir), out)
    n_params = sum(p.numel() for p in model.parameters())
    (out / MARKER_FILE).write_text(
        json.dumps({"preset": preset, "seed": seed, "parameters": n_params}, indent=2) + "\n"
    )
    return out


_MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", MARKER_FILE}


def _copy_tokenizer_files(src: Path, dst: Path) -> None:
    """The builder's tokenizer files byte for byte (class name, chat template, vocab)."""
    if src.resolve() == dst.resolve():
        return
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in _MODEL_FILES:
            shutil.copyfile(path, dst / path.name)


# The built-in sample's closed vocabulary; every one is a single token in the test policy.
SAMPLE_NAMES = ["Brixol", "Tamra", "Velden", "Osric", "Quill", "Marrow", "Zephyr", "Lunet"]
SAMPLE_CITIES = ["Corvale", "Dunmore", "Ashby", "Pellam"]


def sample_texts() -> list[str]:
    """A small built-in sample of task texts (Search-R1 prompts, trajectories, countdown, math).

    Enough for a tokenizer that covers the formats other services' tests exercise.
    """
    from services.common.formats import (
        CORRECTIVE_MESSAGE,
        PROBE_SUFFIX_BOXED,
        PROBE_SUFFIX_THINK,
        corpus_contents,
        information_block,
        search_r1_prompt,
    )

    names, cities = SAMPLE_NAMES, SAMPLE_CITIES
    # The probes' forcing texts; countdown's without its trailing space (the byte-identical text
    # the search probe used before 2026-11-24, so tokenizers built before and after match).
    texts: list[str] = [CORRECTIVE_MESSAGE, PROBE_SUFFIX_THINK.rstrip(" "), PROBE_SUFFIX_BOXED]
    for i, name in enumerate(names):
        city = cities[i % len(cities)]
        year = 1900 + 7 * i
        doc = {
            "id": str(i),
            "contents": corpus_contents(
                name, f"{name} was born in {city}. {name} founded a company in {year}."
            ),
        }
        texts.append(search_r1_prompt(f"Where was {name} born"))
        texts.append(
            f"<think> I need to find where {name} was born. </think>\n"
            f"<search> {name} </search>"
            + information_block([{"document": doc, "score": 0.9}])
            + f"<think> {name} was born in {city}. </think>\n<answer> {city} </answer>"
        )
        a, b, c = 3 + i, 11 + 2 * i, 40 + i
        texts.append(
            "A conversation between User and Assistant. The user asks a question, and the "
            f"Assistant solves it.\nUser: Using the numbers [{a}, {b}, {c}], create an equation "
            f"that equals {a + b + c}. Assistant: Let me solve this step by step.\n<think> "
            f"{a} + {b} = {a + b}, {a + b} + {c} = {a + b + c} </think>\n"
            f"<answer> ({a} + {b}) + {c} </answer>"
        )
        texts.append(
            f"Tom has {a} apples and buys {b} more. How many apples does he have? "
            f"He has {a} + {b} = {a + b} apples. The answer is \\boxed{{{a + b}}}."
        )
    texts.append("0 1 2 3 4 5 6 7 8 9 + - * / = ( ) ? . , : ; ! \" ' \\boxed{ } #### ")
    return texts


def make_test_policy(out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Tokenizer + tiny model from the built-in sample, for other services' tests.

    Reuses `out_dir` when it already holds a complete build (the marker file is written last),
    so a session-scoped fixture or a cache directory pays for it once. The build goes to a
    temporary sibling and is renamed into place, so concurrent callers never see half a model.
    """
    out = Path(out_dir)
    if _is_complete(out, seed):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        texts = sample_texts()
        tokenizer_dir = build_tokenizer(
            texts,
            staging / "tokenizer",
            vocab_size=512,
            whole_words=SAMPLE_NAMES + SAMPLE_CITIES,
        )
        build_tiny_policy(staging / "model", tokenizer_dir, preset="tiny", seed=seed)
        if _is_complete(out, seed):  # another process finished first
            return out
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging / "model", out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _is_complete(path: Path, seed: int) -> bool:
    marker = path / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("seed") == seed and all(
        (path / name).is_file()
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    )


def count_parameters(model_dir: str | os.PathLike[str]) -> int:
    """Parameter count recorded at build time (cheap: no model load)."""
    return int(json.loads((Path(model_dir) / MARKER_FILE).read_text())["parameters"])
