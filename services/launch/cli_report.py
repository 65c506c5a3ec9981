"""`forage report RUN_DIR [--out DIR] [--x step|wall] [--smoothing W]`: summary.json, PNG plots
and report/index.html (one offline page: summary, plots, samples, config), and a short table.

matplotlib is imported by the handler only, so `forage report --help` stays quick. Exit status 2
with a message naming the path when the run directory or its metrics.jsonl is missing or holds
no valid line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

QUICK_NOTE = ("note: this run is `forage demo --quick`: it checks the plumbing at toy size and "
              "does not learn (flat curves and an unchanged EM are expected)")


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl (and demo.json)")
    parser.add_argument("--out", default=None,
                        help="where to write summary.json and the plots (default: RUN_DIR/report)")
    parser.add_argument("--x", dest="x_axis", choices=("step", "wall"), default="step",
                        help="x axis of the curves: RL step (default) or wall-clock minutes")
    parser.add_argument("--smoothing", type=float, default=0.6,
                        help="moving-average weight of the bold curves, in [0, 1): 0 = raw "
                             "only, 0.9 = very smooth (default 0.6, TensorBoard's)")
    parser.set_defaults(handler=_report)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _fmt_ci(interval: list[float] | None) -> str:
    return "n/a" if not interval else f"[{interval[0]:.3f}, {interval[1]:.3f}]"


def _fmt_delta(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.3f}"


def _fmt_wall(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    minutes, rest = divmod(seconds, 60.0)
    hours, minutes = divmod(int(minutes), 60)
    clock = f"{hours}h {minutes:02d}m {rest:04.1f}s" if hours else f"{minutes}m {rest:04.1f}s"
    return f"{clock} ({seconds:.1f} s)"


def format_table(summary: dict[str, Any]) -> str:
    """The few lines a person reads first: EM before -> after, steps, wall time, searches."""
    rows = [
        ("EM (eval)", f"{_fmt(summary['em_before'])} -> {_fmt(summary['em_after'])}"
                      f"  (delta {_fmt_delta(summary['em_delta'])})"),
        ("EM 95% CI", f"{_fmt_ci(summary.get('em_before_ci'))} -> "
                      f"{_fmt_ci(summary.get('em_after_ci'))}  (Wilson, n = "
                      f"{'n/a' if summary.get('eval_n') is None else int(summary['eval_n'])})"),
        ("RL steps", str(summary["steps"])),
        ("wall time", _fmt_wall(summary["wall_seconds"])),
        ("searches (eval)", f"{_fmt(summary['searches_before'], 2)} -> "
                            f"{_fmt(summary['searches_after'], 2)}"),
        ("reward (train)", f"{_fmt(summary['reward_first'])} -> {_fmt(summary['reward_last'])}"
                           f"  (first/last up to 5 steps)"),
    ]
    if summary.get("eval_samples", 1) > 1:  # learner.eval_samples: EM is mean@k
        k = summary["eval_samples"]
        rows.insert(1, ("EM sampling", f"{summary['eval_mode']} (Wilson n counts questions)"))
        rows.insert(2, (f"pass@{k} (eval)", f"{_fmt(summary.get('pass_before'))} -> "
                                            f"{_fmt(summary.get('pass_after'))}"))
    if "played_reward_first" in summary:  # the group filter ran: its batches hide the rest
        rows.append(("reward (played)", f"{_fmt(summary['played_reward_first'])} -> "
                                        f"{_fmt(summary['played_reward_last'])}  (dropped "
                                        f"groups included)"))
    if summary.get("probe_overconf_start") is not None:
        rows.append(("probe overconf", f"{_fmt(summary['probe_overconf_start'])} -> "
                                       f"{_fmt(summary['probe_overconf_end'])}"))
    if summary.get("evidence_gap_end") is not None:  # probe.evidence ran
        rows.append(("evidence gap", f"{_fmt(summary['evidence_gap_start'])} -> "
                                     f"{_fmt(summary['evidence_gap_end'])}  (EM real - swapped)"))
    rows += retrieval_rows(summary.get("retrieval"))
    if summary.get("malformed_lines"):
        rows.append(("skipped lines", str(summary["malformed_lines"])))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def retrieval_rows(found: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Retrieval health, first -> last up to 5 train steps (none when no search returned)."""
    if not found:
        return []
    first, last = found["first"], found["last"]

    def pair(*names: str, digits: int = 3) -> str:
        return (" / ".join(_fmt(first[n], digits) for n in names) + " -> "
                + " / ".join(_fmt(last[n], digits) for n in names))

    return [("gold in passages", pair("gold_hit_rate") + "  (share of searching trajectories)"),
            ("empty results", pair("empty_rate") + "  (share of search turns)"),
            ("repeated passages/queries", pair("repeated_passage_rate", "repeated_query_rate")),
            ("retrieval p50/p99 ms", pair("latency_p50_ms", "latency_p99_ms", digits=1)),
            ("retrieval cache hits", pair("cache_hit_rate"))]


def _report(args: argparse.Namespace) -> int:
    from services.common.logs import setup_logging
    from services.launch.report import ReportError, write_report

    setup_logging("report", level="WARNING")
    out = Path(args.out) if args.out else Path(args.run_dir) / "report"
    try:
        summary = write_report(args.run_dir, out, x_axis=args.x_axis, smoothing=args.smoothing)
    except ReportError as exc:
        print(f"forage report: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(summary))
    if summary.get("quick"):
        print(QUICK_NOTE)
    print("written:")
    for name in summary["files"]:
        print(f"  {out / name}")
    return 0
