"""`forage data synth`: write a synthetic world to disk (corpus, questions, index, SFT set).

Output directory:
  corpus.jsonl    Search-R1 corpus rows {"id", "contents"}
  train.parquet   Search-R1 rows (train split)       test.parquet   (test split)
  world.json      entities, their facts and passages, closed vocabularies, `whole_words` for
                  the tokenizer, `recommended_topk`
  index/          the retriever's index of corpus.jsonl (reused by `forage retriever serve`)
  sft.parquet     demonstrations (see services/tasks/sft.py for the row format)
  sft_heldout.parquet  good-strategy demonstrations of a fixed slice of train questions kept out
                  of sft.parquet (they stay in train.parquet for RL): the SFT loop measures the
                  policy's skills on them (services/learner/sft_skills.py)

`protocol="tool_calls"` (`rollout.protocol: tool_calls`; `forage data synth` takes the run
config's): the questions' prompts ask for Hermes tool calls (services/tasks/sft.py,
`tool_search_prompt`) and the demonstrations are written in that protocol, rendered with the
chat template of `template` (a model or tokenizer directory; default: the tiny policy's, which
`forage model init` builds next).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

from services.tasks.datasets import write_rows
from services.tasks.world import build_world, split_rows

log = logging.getLogger("forage.tasks.synth")

INDEX_DIR = "index"
HELDOUT_FILE = "sft_heldout.parquet"
DEFAULT_HELDOUT = 64  # held-out questions, or 10% of the train questions when that is fewer


def heldout_indices(n_questions: int, seed: int, count: int | None = None) -> list[int]:
    """Which train questions are held out of sft.parquet: `count` (default 64, at most 10% of
    the questions, at least 1; 0: none) drawn with a seed-derived RNG, sorted."""
    import random

    if count is None:
        count = max(1, min(DEFAULT_HELDOUT, n_questions // 10))
    count = max(0, min(count, n_questions - 1))
    return sorted(random.Random(f"sft-heldout-{seed}").sample(range(n_questions), count))


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def synthesize(
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    size: str = "small",
    hard: bool = False,
    sft: bool = True,
    sft_mix: str | dict[str, float] = "good=0.4,guess=0.3,sloppy=0.3",
    sft_topk: int | None = None,
    index_type: str = "flat",
    encoder: str | None = None,
    show_progress: bool = True,
    sft_heldout: int | None = None,
    protocol: str = "tags",
    tools: tuple[str, ...] = ("search",),
    template: str | None = None,
) -> dict[str, Any]:
    """Write the world; returns a summary (counts, SFT strategy mix and accuracy)."""
    from services.tasks.sft import PROTOCOLS, protocol_prompt

    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; known: {list(PROTOCOLS)}")
    turns = None
    if protocol == "tool_calls" and sft:  # the template first: a bad one fails before any work
        from services.tasks.sft import ToolTurns, template_tokenizer

        turns = ToolTurns(template_tokenizer(template), tools)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    world = build_world(seed, size, hard)
    meta = world.metadata()
    write_jsonl(out / "corpus.jsonl", world.corpus)
    train, test = split_rows(world, "train"), split_rows(world, "test")
    if protocol != "tags":
        for row in (*train, *test):
            row["prompt"] = protocol_prompt(row["extra_info"]["question"], protocol)
    write_rows(out / "train.parquet", train)
    write_rows(out / "test.parquet", test)
    summary: dict[str, Any] = {"out": str(out), **meta["counts"], "seed": seed, "size": size,
                               "hard": hard, "recommended_topk": world.recommended_topk}
    if protocol != "tags":
        summary["protocol"] = protocol
    if sft:
        topk = sft_topk or world.recommended_topk
        summary["sft"] = build_sft(out, meta, topk, sft_mix, seed, index_type, encoder,
                                   show_progress, sft_heldout, turns)
    meta["summary"] = summary
    tmp = out / "world.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, out / "world.json")
    return summary


def build_sft(out: Path, meta: dict[str, Any], topk: int, mix: str | dict[str, float],
              seed: int, index_type: str = "flat", encoder: str | None = None,
              show_progress: bool = True, heldout: int | None = None,
              turns: Any = None) -> dict[str, Any]:
    """Index the corpus with the real retriever (in-process) and write sft.parquet and
    sft_heldout.parquet (good demonstrations of the held-out questions)."""
    from services.retriever.build import build_index
    from services.retriever.searcher import Searcher
    from services.tasks.datasets import load_rows
    from services.tasks.sft import build_sft_rows, prefetch

    index_dir = build_index(out / "corpus.jsonl", out / INDEX_DIR, index_type=index_type,
                            encoder=encoder, show_progress=show_progress)
    searcher = Searcher.load(index_dir)
    search = prefetch(searcher, meta, topk)
    # Demonstrations on train questions only; rebuild question dicts from the written rows so
    # the SFT set follows train.parquet's order.
    questions = []
    for row in load_rows(out / "train.parquet"):
        extra = row["extra_info"]
        questions.append({
            "question": extra["question"],
            "answer": row["reward_model"]["ground_truth"]["target"][0],
            "answer_type": extra["answer_type"],
            "subject": extra["subject"],
            "relation": extra["relation"],
            "hops": extra["hops"],
        })
    held = set(heldout_indices(len(questions), seed, heldout))
    rows = build_sft_rows([q for i, q in enumerate(questions) if i not in held], search, meta,
                          topk, mix, seed, show_progress, turns)
    write_rows(out / "sft.parquet", rows)
    held_rows = build_sft_rows([questions[i] for i in sorted(held)], search, meta, topk,
                               {"good": 1.0}, seed, turns=turns)
    for row, index in zip(held_rows, sorted(held), strict=True):
        row["extra_info"]["index"] = index  # the question's row in train.parquet
        row["extra_info"]["split"] = "heldout"
    (out / HELDOUT_FILE).unlink(missing_ok=True)
    if held_rows:
        write_rows(out / HELDOUT_FILE, held_rows)
    strategies = Counter(r["extra_info"]["strategy"] for r in rows)
    correct = Counter(r["extra_info"]["strategy"] for r in rows if r["extra_info"]["correct"])
    return {
        "rows": len(rows),
        "heldout": len(held_rows),
        "topk": topk,
        "strategies": dict(strategies),
        "accuracy": {s: round(correct[s] / n, 3) for s, n in strategies.items()},
    }
