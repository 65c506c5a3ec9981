"""The tiny policy: a real tokenizer + Qwen2 checkpoint that loads like Qwen2.5 would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from services.common.formats import information_block, search_r1_prompt
from services.tasks.tiny_policy import (
    MARKER_FILE,
    SAMPLE_CITIES,
    SAMPLE_NAMES,
    TAG_TOKENS,
    build_tiny_policy,
    build_tokenizer,
    make_test_policy,
    sample_texts,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_policy(tmp_path_factory.mktemp("policy") / "tiny", seed=0)


def test_tags_are_single_non_special_tokens_that_decode_keeps(policy_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(policy_dir)
    for tag in TAG_TOKENS:
        ids = tok.encode(tag, add_special_tokens=False)
        assert len(ids) == 1, tag
        assert tok.decode(ids, skip_special_tokens=True) == tag
    doc = {"id": "0", "contents": '"Brixol"\nBrixol was born in Corvale.'}
    text = (
        "<think> I need Brixol. </think>\n<search> Brixol </search>"
        + information_block([{"document": doc, "score": 0.5}])
        + "<answer> Corvale </answer>"
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == text
    tokens = tok.convert_ids_to_tokens(ids)
    assert "<information>" in tokens and "</information>" in tokens


def test_special_tokens_and_eos(policy_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(policy_dir)
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        ids = tok.encode(special, add_special_tokens=False)
        assert len(ids) == 1
        assert tok.decode(ids, skip_special_tokens=True) == ""
    # encode adds nothing on its own (Qwen2.5 adds no BOS)
    assert tok.encode("hello", add_special_tokens=True) == tok.encode(
        "hello", add_special_tokens=False
    )


def test_whole_words_are_single_tokens(policy_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(policy_dir)
    for word in SAMPLE_NAMES + SAMPLE_CITIES:
        for variant in (word, " " + word, '"' + word):
            assert len(tok.encode(variant, add_special_tokens=False)) == 1, variant
    # inside real text too: the title line quotes the name, the answer tag pads it with spaces
    text = 'Doc 1(Title: "Tamra") Tamra <answer> Ashby </answer>'
    ids = tok.encode(text, add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    # ': "Tamra' splits as ' "' + 'Tamra' under Qwen2's regex
    assert "Tamra" in pieces and "ĠTamra" in pieces and "ĠAshby" in pieces


def test_force_whole_words_on_unseen_words(tmp_path: Path) -> None:
    """Words the BPE never saw (or saw rarely) still come out whole."""
    words = ["Qorvath", "Zindle", "Umbrisk", "Xylo"]
    out = build_tokenizer(sample_texts(), tmp_path / "tok", vocab_size=300, whole_words=words)
    tok = AutoTokenizer.from_pretrained(out)
    for word in words:
        for variant in (word, " " + word, '"' + word, "(" + word):
            assert len(tok.encode(variant, add_special_tokens=False)) == 1, variant
    # other text still round-trips byte for byte (byte-level BPE has no unknowns)
    text = "Ünïcode ✓ and 12345 Qorvathian\n\nZindle's"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chat_template_is_chatml(policy_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(policy_dir)
    messages = [{"role": "user", "content": search_r1_prompt("Where was Brixol born")}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\n" + search_r1_prompt("Where was Brixol born") + "<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_auto_tokenizer_matches_tokenizer_json(policy_dir: Path) -> None:
    """transformers rebuilds a Qwen2Tokenizer from vocab + merges; it must equal our pipeline."""
    raw = Tokenizer.from_file(str(policy_dir / "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(policy_dir)
    for text in sample_texts() + ["Using the numbers [12, 345, 6789]  x\n\n y's"]:
        assert tok.encode(text, add_special_tokens=False) == raw.encode(text).ids


def test_checkpoint_files_and_size(policy_dir: Path) -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        MARKER_FILE,
    ):
        assert (policy_dir / name).is_file(), name
    config = json.loads((policy_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["num_hidden_layers"] == 4 and config["hidden_size"] == 192
    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    n_params = sum(p.numel() for p in model.parameters())
    assert 500_000 < n_params < 5_000_000
    tok = AutoTokenizer.from_pretrained(policy_dir)
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id


def test_save_reload_identical_logits(policy_dir: Path, tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    ids = torch.tensor([tok.encode("<search> Brixol </search> Corvale", add_special_tokens=False)])
    with torch.no_grad():
        before = model(ids).logits
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        after = again(ids).logits
    assert torch.equal(before, after)
    assert before.shape == (1, ids.shape[1], len(tok))


def test_make_test_policy_is_deterministic_and_cached(policy_dir: Path, tmp_path: Path) -> None:
    stamp = (policy_dir / "model.safetensors").stat().st_mtime_ns
    assert make_test_policy(policy_dir, seed=0) == policy_dir
    assert (policy_dir / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    other = make_test_policy(tmp_path / "second", seed=0)
    assert (other / "model.safetensors").read_bytes() == (
        policy_dir / "model.safetensors"
    ).read_bytes()
    assert (other / "tokenizer.json").read_text() == (policy_dir / "tokenizer.json").read_text()


def test_different_seed_different_weights(policy_dir: Path, tmp_path: Path) -> None:
    out = build_tiny_policy(tmp_path / "seed1", policy_dir, preset="tiny", seed=1)
    a = AutoModelForCausalLM.from_pretrained(policy_dir)
    b = AutoModelForCausalLM.from_pretrained(out)
    assert not torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="unknown preset"):
        build_tiny_policy(tmp_path / "bad", policy_dir, preset="huge")


def test_real_format_checkpoint_loads(policy_dir: Path, tmp_path: Path) -> None:
    """A directory laid out like a Hugging Face Qwen2.5 download (vocab.json + merges.txt +
    tokenizer_config.json, config.json, model.safetensors written with safetensors directly, no
    tokenizer.json, no marker) loads through AutoTokenizer / AutoModelForCausalLM and behaves
    like the original."""
    from safetensors.torch import save_file

    real = tmp_path / "qwen-like"
    real.mkdir()
    state = json.loads((policy_dir / "tokenizer.json").read_text())
    (real / "vocab.json").write_text(json.dumps(state["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    (real / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    added = {
        str(t["id"]): {
            "content": t["content"],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t["special"],
        }
        for t in state["added_tokens"]
    }
    source_config = json.loads((policy_dir / "tokenizer_config.json").read_text())
    (real / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "added_tokens_decoder": added,
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                "bos_token": None,
                "chat_template": source_config["chat_template"],
                "clean_up_tokenization_spaces": False,
                "eos_token": "<|im_end|>",
                "errors": "replace",
                "model_max_length": 32768,
                "pad_token": "<|endoftext|>",
                "split_special_tokens": False,
                "tokenizer_class": "Qwen2Tokenizer",
                "unk_token": None,
            }
        )
    )
    original = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    config = Qwen2Config.from_pretrained(policy_dir)
    config.save_pretrained(real)
    tensors = {k: v.contiguous().clone() for k, v in original.state_dict().items()}
    tensors.pop("lm_head.weight", None)  # tied, as in Qwen2.5-0.5B's checkpoint
    save_file(tensors, str(real / "model.safetensors"), metadata={"format": "pt"})

    tok_a = AutoTokenizer.from_pretrained(policy_dir)
    tok_b = AutoTokenizer.from_pretrained(real)
    messages = [{"role": "user", "content": search_r1_prompt("Where was Velden born")}]
    ids_a = tok_a.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids_b = tok_b.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids_a == ids_b
    for text in sample_texts():
        assert tok_a.encode(text, add_special_tokens=False) == tok_b.encode(
            text, add_special_tokens=False
        )
    loaded = AutoModelForCausalLM.from_pretrained(real).eval()
    ids = torch.tensor([tok_b.encode(ids_b, add_special_tokens=False)])
    with torch.no_grad():
        assert torch.equal(original(ids).logits, loaded(ids).logits)
