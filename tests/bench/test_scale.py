"""bench/scale.py --quick end to end: a private Redis, the learner loop, the scorer and 1 then 4
replicas on the simulated engine; the report's shape, the last line, and that the learner
trained trajectories from every replica count."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_scale_bench_trains_and_reports_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "scale"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "scale.py"), "--quick", "--hosts", "1",
         "--per-token-ms", "5", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"ratio: \d+\.\d+", lines[-1]), lines[-1]
    rows = [line for line in lines if re.match(r"\| (1|4) \| ", line)]
    assert len(rows) == 2, proc.stdout
    results = json.loads((out / "scale.json").read_text())
    assert [r["n"] for r in results] == [1, 4]
    for result in results:
        # 3 measured steps of N × 2 groups × 4 samples, stale drops aside
        assert result["trajectories"] > 0 and result["rate"] > 0
        assert result["trajectories"] <= 3 * result["n"] * 2 * 4
        assert result["commands_per_trajectory"] > 0
        assert result["learner_cpu_per_step_s"] > 0
    assert float(lines[-1].split()[1]) == pytest.approx(results[1]["linear"], abs=0.01)
