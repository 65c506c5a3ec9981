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

Every wrong answer is also given `forage eval`'s error class (services/eval/errors.py:
never_searched, first_hop_missed, bridge_missed, evidence_misread, other), from the passages
the policy retrieved and the row's hops, by the same function `forage eval` uses, so the two
tools agree on the same trajectories. The buckets above ask what only the synthetic world can
answer (was the query the question's entity name, the bridge); the classes ask what any dataset
with gold answers can.

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
    # the passages its searches retrieved, as the policy saw them (split as forage eval does)
    passages: tuple[str, ...] = ()


def golds_of(row: dict[str, Any]) -> list[str]:
    from services.scorer.rewards.text import gold_answers

    return list(gold_answers(row["reward_model"]["ground_truth"]))


def is_correct(played: Played, golds: Sequence[str]) -> bool:
    """Exact match after the scorer's normalisation, against any gold answer."""
    from services.common.formats import normalize_answer

    return played.answer is not None and any(
        normalize_answer(played.answer) == normalize_answer(g) for g in golds)


def error_class(played: Played, row: dict[str, Any]) -> str | None:
    """`forage eval`'s class of a wrong answer (services/eval/errors.attribute_error with the
    row's hops from errors.support_of), None for a right one."""
    from services.eval.errors import attribute_error, support_of

    golds = golds_of(row)
    if is_correct(played, golds):
        return None
    question = str(row.get("question") or (row.get("extra_info") or {}).get("question") or "")
    return attribute_error(bool(played.queries), played.passages, golds,
                           support_of(row, question, golds))


def bucket(played: Played, subject: str, bridge: str, hops: int, gold: str) -> str:
    """The first bucket of BUCKETS that explains this outcome (pure; see the module doc)."""
    if is_correct(played, [gold]):
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
    from services.eval.errors import split_passages
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
    passages: list[list[str]] = [[] for _ in rows]
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
                    passages[i].extend(split_passages(block))
    return [Played(tuple(q), a, tuple(p))
            for q, a, p in zip(queries, answers, passages, strict=True)]


def summarise(rows: Sequence[dict[str, Any]], played: Sequence[Played]) -> dict[str, Any]:
    """Bucket counts per hop count, per-relation answer accuracy where hop 1 was right, and
    `forage eval`'s error classes of the wrong answers (`errors`, as eval.json's)."""
    from services.eval.errors import ERROR_CLASSES

    buckets: dict[int, Counter[str]] = defaultdict(Counter)
    reading: dict[str, Counter[bool]] = defaultdict(Counter)
    classes: Counter[str] = Counter()
    for row, outcome in zip(rows, played, strict=True):
        found = error_class(outcome, row)
        if found is not None:
            classes[found] += 1
        extra = row["extra_info"]
        gold = str(row["reward_model"]["ground_truth"]["target"][0])
        hops = int(extra["hops"])
        # right or wrong as forage eval scores it (any gold answer); then the query buckets
        name = "correct" if found is None else bucket(
            outcome, str(extra["subject"]), str(extra.get("bridge") or ""), hops, gold)
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
        "errors": {"wrong": sum(classes.values()),
                   "counts": {name: classes[name] for name in ERROR_CLASSES}},
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
    errors = summary["errors"]
    lines += ["", f"forage eval's error classes of the {errors['wrong']} wrong answers: " + ", ".join(
        f"{name} {count}" for name, count in errors["counts"].items())]
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
