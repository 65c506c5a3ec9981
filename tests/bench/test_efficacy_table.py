"""bench/efficacy.py's table says where each demo's time went (demo.json's phases)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _efficacy():
    spec = importlib.util.spec_from_file_location("forage_bench_efficacy",
                                                  REPO / "bench" / "efficacy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wall_cell_lists_the_phases_in_the_order_the_demo_runs_them(tmp_path) -> None:
    efficacy = _efficacy()
    out = tmp_path / "seed-3"
    (out / "report").mkdir(parents=True)
    (out / "report" / "summary.json").write_text(json.dumps(
        {"em_before": 0.1, "em_after": 0.4, "em_delta": 0.3}))
    (out / "bench-run.json").write_text(json.dumps({"exit": 0, "wall_s": 672.0}))
    (out / "demo.json").write_text(json.dumps({"phases": {
        "rl_s": 270.0, "sft_s": 366.0, "world_s": 24.0, "policy_s": 6.0}}))
    (out / "metrics.jsonl").write_text("")
    row = efficacy.seed_row(3, out)
    [_, _, line] = efficacy.table([row])
    assert line.endswith("| 11.2 min (world 0.4, policy 0.1, SFT 6.1, RL 4.5) |"), line
    assert efficacy.wall_cell(600.0, {}) == "10.0 min"
    assert efficacy.wall_cell(None, {"rl_s": 1.0}) == "n/a"
