"""`forage inspect RUN_DIR [--step N] [--wrong] [--kind train|eval] [--limit K]`.

Prints the trajectories the learner logged to RUN_DIR/samples.jsonl (learner.log_samples_every,
and every evaluation) the way a researcher reads a generation: the question and ground truth,
each turn's text with its search query and the documents it retrieved, the answer, the reward
and its components, and the probe's scores. Without --step it shows the newest step logged.
A half-written or garbled line (the learner may be writing) is skipped and counted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SAMPLES_FILE = "samples.jsonl"


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory holding samples.jsonl")
    parser.add_argument("--step", type=int, default=None,
                        help="only samples logged at this RL step (default: the newest step)")
    parser.add_argument("--wrong", action="store_true",
                        help="only samples whose reward is below 1 (not exact-match correct)")
    parser.add_argument("--kind", choices=("train", "eval"), default=None,
                        help="only training or only evaluation samples")
    parser.add_argument("--limit", type=int, default=None, help="show at most this many")
    parser.add_argument("--observations", action="store_true",
                        help="also print the retrieved passages each search returned")
    parser.set_defaults(handler=_inspect)


class InspectError(Exception):
    """The run directory has no readable samples; the message says why."""


def load_samples(run_dir: str | Path) -> tuple[list[dict[str, Any]], int]:
    """(samples in file order, lines skipped)."""
    path = Path(run_dir) / SAMPLES_FILE
    if not Path(run_dir).is_dir():
        raise InspectError(f"run directory {run_dir} does not exist")
    if not path.is_file():
        raise InspectError(f"{path} does not exist: the learner writes it at every evaluation "
                           "and every learner.log_samples_every steps")
    rows, skipped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            skipped += 1
    return rows, skipped


def select(rows: list[dict[str, Any]], step: int | None, wrong: bool, kind: str | None
           ) -> tuple[list[dict[str, Any]], int | None]:
    """The samples to show and the step they were picked from (None when nothing matched)."""
    pool = [r for r in rows if kind is None or r.get("kind") == kind]
    if step is None:
        step = max((r["step"] for r in pool), default=None)
    chosen = [r for r in pool if r["step"] == step]
    if wrong:
        chosen = [r for r in chosen if not r.get("correct", float(r.get("reward", 0)) >= 1)]
    return chosen, step


def _truth(value: Any) -> str:
    if isinstance(value, dict) and "target" in value:
        target = value["target"]
        return " | ".join(map(str, target)) if isinstance(target, list) else str(target)
    return json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value


def _indent(text: str, prefix: str = "      ") -> str:
    return "\n".join(prefix + line for line in text.strip().splitlines()) or prefix + "(empty)"


def format_sample(row: dict[str, Any], observations: bool = False) -> str:
    """One sample as terminal text."""
    mark = "correct" if row.get("correct") else "wrong"
    components = ", ".join(f"{k} {v:.2f}" for k, v in (row.get("reward_components") or {}).items())
    head = (f"=== step {row['step']} {row.get('kind', '?')} | policy v{row.get('policy_version')}"
            f" | {row.get('data_source')} | reward {float(row.get('reward', 0)):.2f} ({mark}"
            f"{'; ' + components if components else ''}) | {row.get('sample_id', '')}")
    lines = [head, f"Q:      {row.get('question')}",
             f"truth:  {_truth(row.get('ground_truth'))}"]
    for index, turn in enumerate(row.get("turns") or [], start=1):
        label = f"  [{index}] {turn.get('action')}"
        if turn.get("query"):
            label += f' "{turn["query"]}"'
        lines.append(f"{label}  (policy v{turn.get('policy_version')})")
        lines.append(_indent(str(turn.get("text", ""))))
        docs = turn.get("docs") or []
        if docs:
            lines.append("      retrieved: " + "; ".join(
                f"{d.get('id')} \"{d.get('title')}\"" for d in docs))
        if observations and turn.get("observation"):
            lines.append(_indent(turn["observation"], "      | "))
    lines.append(f"answer: {row.get('answer')!r}   finish: {row.get('finish_reason')}   "
                 f"searches: {row.get('num_searches')}   tokens: {row.get('response_tokens')}")
    fractions, scores = row.get("probe_fractions"), row.get("probe_scores")
    if fractions and scores:
        lines.append("probe:  " + "  ".join(f"{f:.2f}->{s:.2f}"
                                            for f, s in zip(fractions, scores, strict=False))
                     + "  (fraction of reasoning seen -> forced-answer accuracy)")
    return "\n".join(lines)


def _steps_summary(rows: list[dict[str, Any]]) -> str:
    parts = []
    for kind in ("train", "eval"):
        steps = sorted({r["step"] for r in rows if r.get("kind") == kind})
        if steps:
            shown = ", ".join(map(str, steps[:12])) + (" ..." if len(steps) > 12 else "")
            parts.append(f"{kind} at steps {shown}")
    return "; ".join(parts) or "none"


def _inspect(args: argparse.Namespace) -> int:
    try:
        rows, skipped = load_samples(args.run_dir)
    except InspectError as exc:
        print(f"forage inspect: error: {exc}", file=sys.stderr)
        return 2
    chosen, step = select(rows, args.step, args.wrong, args.kind)
    if args.step is not None and not any(r["step"] == args.step for r in rows
                                         if args.kind is None or r.get("kind") == args.kind):
        print(f"forage inspect: error: no samples at step {args.step}; logged: "
              f"{_steps_summary(rows)}", file=sys.stderr)
        return 2
    if args.limit is not None:
        chosen = chosen[: max(args.limit, 0)]
    print(f"{len(rows)} samples in {Path(args.run_dir) / SAMPLES_FILE} ({_steps_summary(rows)})"
          + (f"; {skipped} unreadable line(s) skipped" if skipped else ""))
    if not chosen:
        what = "wrong " if args.wrong else ""
        print(f"no {what}samples to show at step {step}")
        return 0
    for row in chosen:
        print()
        print(format_sample(row, args.observations))
    return 0
