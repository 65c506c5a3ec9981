"""Where does a demo policy go wrong on the held-out questions? (a diagnosis)

    .venv/bin/python bench/demo_errors.py RUN [--policy DIR ...] [--split test] [--limit N]

RUN is a `forage demo --out` directory (its world/ holds test.parquet, world.json and the
index). Each policy (default: RUN/sft/policy, the warm start, and the newest RL checkpoint's
policy) plays every question greedily with the in-process retriever, top-1, as the learner's
held-out evaluation does (same prompt encoding, same observation blocks, max_turns 4), and
every question is put in the first bucket that explains it:

- correct: the final answer matches the gold answer (the scorer's normalisation);
- no search: it answered (or stopped) without searching;
- hop-1 query wrong: the first query is not the question's entity name (a copying error);
- stopped after hop 1: a two-hop question answered after one search;
- bridge query wrong: the second query is not the bridge entity the first passage named;
- answer misread: the right passage(s) were retrieved and the answer is still wrong.

Then, for single-hop questions whose query was right, the answer accuracy per relation
(born_in, occupation, ...): which facts the policy can read from a passage.

Why it exists: held-out EM alone does not say whether RL is short of a strategy (searching,
the second hop) or of a skill (copying a name, reading a value). A benchmark helper, not a
test; about 10-30 s per policy on 2 cores for the demo's 145 questions.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BUCKETS = ("correct", "no search", "hop-1 query wrong", "stopped after hop 1",
           "bridge query wrong", "answer misread")
MAX_TURNS = 4
MAX_TOKENS_PER_TURN = 32


@dataclass(frozen=True)
class Played:
    """One question as the policy played it."""
    queries: tuple[str, ...]
    answer: str | None  # None: no answer (invalid turn or out of turns)


def bucket(played: Played, subject: str, bridge: str, hops: int, gold: str) -> str:
    """The first bucket of BUCKETS that explains this outcome (pure; see the module doc)."""
    from services.common.formats import normalize_answer

    if played.answer is not None and normalize_answer(played.answer) == normalize_answer(gold):
        return "correct"
    if not played.queries:
        return "no search"
    if played.queries[0] != subject:
        return "hop-1 query wrong"
    if hops == 2 and len(played.queries) < 2:
        return "stopped after hop 1"
    if hops == 2 and played.queries[1] != bridge:
        return "bridge query wrong"
    return "answer misread"


def play(policy_dir: Path, rows: Sequence[dict[str, Any]], searcher: Any) -> list[Played]:
    """Greedy multi-turn play of every row, batched turn by turn."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.common.formats import cut_at_first_stop, information_block, parse_action
    from services.learner.sft import encode_prompt
    from services.learner.sft_skills import generate_greedy, stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(str(policy_dir))
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir)).eval()
    stops = stop_token_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def ids(text: str) -> list[int]:
        return [int(x) for x in tokenizer(text, add_special_tokens=False)["input_ids"]]

    contexts = [encode_prompt(tokenizer, row["prompt"]) for row in rows]
    queries: list[list[str]] = [[] for _ in rows]
    answers: list[str | None] = [None] * len(rows)
    finished = [False] * len(rows)
    with torch.no_grad():
        for _ in range(MAX_TURNS):
            live = [i for i, done in enumerate(finished) if not done]
            if not live:
                break
            outputs = generate_greedy(model, [contexts[i] for i in live], MAX_TOKENS_PER_TURN,
                                      stops, pad)
            searching: dict[int, str] = {}
            for i, generated in zip(live, outputs, strict=True):
                contexts[i] = contexts[i] + generated
                action = parse_action(cut_at_first_stop(tokenizer.decode(generated)))
                if action is None or action[0] == "answer":
                    finished[i] = True
                    answers[i] = action[1] if action is not None else None
                    continue
                queries[i].append(action[1])
                searching[i] = action[1]
            if searching:
                results = searcher.search(list(searching.values()), 1)
                for i, found in zip(searching, results, strict=True):
                    block = information_block([{"document": d, "score": s} for d, s in found])
                    contexts[i] = contexts[i] + ids(block)
    return [Played(tuple(q), a) for q, a in zip(queries, answers, strict=True)]


def summarise(rows: Sequence[dict[str, Any]], played: Sequence[Played]) -> dict[str, Any]:
    """Bucket counts per hop count, and per-relation answer accuracy where hop 1 was right."""
    buckets: dict[int, Counter[str]] = defaultdict(Counter)
    reading: dict[str, Counter[bool]] = defaultdict(Counter)
    for row, outcome in zip(rows, played, strict=True):
        extra = row["extra_info"]
        gold = str(row["reward_model"]["ground_truth"]["target"][0])
        hops = int(extra["hops"])
        name = bucket(outcome, str(extra["subject"]), str(extra.get("bridge") or ""), hops, gold)
        buckets[hops][name] += 1
        if hops == 1 and outcome.queries and outcome.queries[0] == extra["subject"]:
            reading[str(extra["relation"])][name == "correct"] += 1
    total = sum(sum(c.values()) for c in buckets.values())
    correct = sum(c["correct"] for c in buckets.values())
    return {
        "questions": total,
        "em": correct / total if total else 0.0,
        "buckets": {hops: {b: buckets[hops][b] for b in BUCKETS} for hops in sorted(buckets)},
        "reading": {rel: (c[True], c[True] + c[False]) for rel, c in sorted(reading.items())},
    }


def render(label: str, summary: dict[str, Any]) -> str:
    lines = [f"## {label}: EM {100 * summary['em']:.1f}% over {summary['questions']} questions",
             "", "| hops | " + " | ".join(BUCKETS) + " |",
             "|---|" + "---|" * len(BUCKETS)]
    for hops, counts in summary["buckets"].items():
        n = sum(counts.values())
        cells = [f"{counts[b]} ({100 * counts[b] / n:.0f}%)" for b in BUCKETS]
        lines.append(f"| {hops} (n={n}) | " + " | ".join(cells) + " |")
    lines += ["", "single-hop, right query, answer read right per relation: " + ", ".join(
        f"{rel} {ok}/{n}" for rel, (ok, n) in summary["reading"].items())]
    return "\n".join(lines)


def default_policies(run: Path) -> list[Path]:
    from services.learner.checkpoint import latest_checkpoint

    found = [run / "sft" / "policy"]
    latest = latest_checkpoint(run / "checkpoints")
    if latest is not None:
        found.append(latest / "policy")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="a `forage demo --out` directory")
    parser.add_argument("--policy", type=Path, action="append", default=None,
                        help="policy directories (default: the warm start and the newest "
                             "RL checkpoint)")
    parser.add_argument("--split", default="test", choices=["test", "train"])
    parser.add_argument("--limit", type=int, default=None, help="first N questions only")
    parser.add_argument("--json", type=Path, default=None, help="also write the summaries")
    args = parser.parse_args(argv)

    import torch

    from services.retriever.searcher import Searcher
    from services.tasks.datasets import load_rows

    world = args.run / "world"
    questions = world / f"{args.split}.parquet"
    if not questions.exists() or not (world / "index").exists():
        print(f"demo_errors: {args.run} is not a demo run directory (no {questions} or "
              f"{world / 'index'})", file=sys.stderr)
        return 2
    policies = args.policy or default_policies(args.run)
    missing = [p for p in policies if not (p / "config.json").exists()]
    if missing:
        print(f"demo_errors: no policy (config.json) in {', '.join(map(str, missing))}",
              file=sys.stderr)
        return 2
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = load_rows(questions)[: args.limit]
    searcher = Searcher.load(world / "index")
    report: dict[str, Any] = {}
    for policy in policies:
        summary = summarise(rows, play(policy, rows, searcher))
        report[str(policy)] = summary
        print(render(str(policy), summary), "\n", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
