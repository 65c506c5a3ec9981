"""bench/retrieval_health.py runs as documented (bench/README.md), at toy size: its lines and
ratios, and the step it builds judged as the rules say (a tenth of the passages hold gold)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_overhead_bench_prints_both_sides_and_the_step_ratio() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "retrieval_health.py"),
                           "--trajectories", "8", "--turns", "2", "--topk", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("step: 8 trajectories x 2 search turns x top-2 passages"), out
    assert re.search(r"rollout, per search turn: telemetry [\d.]+ us, tokenizing its "
                     r"observation [\d.]+ us, ratio \d+\.\d{3}", out), out
    assert re.search(r"learner, per step: health_metrics [\d.]+ ms, codec decode [\d.]+ ms, "
                     r"ratio \d+\.\d{3}", out), out
    assert re.search(r"\(gold hit rate (0|1)\.\d{3}, 24 metrics\)", out), out
    assert re.fullmatch(r"step total: telemetry [\d.]+ ms vs tokenize \+ encode \+ decode "
                        r"[\d.]+ ms: ratio \d+\.\d{3}", out.strip().splitlines()[-1]), out
