"""The skill-gated SFT loop (`forage learner sft` with learner.sft_until, issue 15), run for real:
the CLI, the tiny policy, held-out demonstrations beside the SFT data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.launch.demo import warm_start_line

FORAGE = Path(sys.executable).with_name("forage")


def _world(tmp_path: Path, policy: Path, rows: Callable[..., list[dict]],
           **learner: object) -> tuple[Path, Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist(rows(16)), str(data))
    pq.write_table(pa.Table.from_pylist(rows(4, offset=16)),
                   str(tmp_path / "sft_heldout.parquet"))
    run_dir = tmp_path / "run"
    settings = {"lr": 0.002, "sft_batch_size": 4, "sft_epochs": 1, "micro_batch_tokens": 256,
                **learner}
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps({"run_dir": str(run_dir), "model": {"path": str(policy)},
                               "rollout": {"max_tokens_per_turn": 16}, "learner": settings}))
    return cfg, data, run_dir / "sft"


def _sft(cfg: Path, data: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([str(FORAGE), "learner", "sft", "--config", str(cfg), "--data",
                           str(data)], env=env, capture_output=True, text=True, timeout=300)


def _steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "sft_metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # a real `forage learner sft` run: 30-140 s on the shared 2 cores
def test_gate_stops_at_the_first_measurement_that_meets_the_thresholds(tiny_policy, tmp_path, sft_rows):
    # 16 rows / 4 = 4 steps per epoch: the gated run repeats epochs; thresholds of 0 are met at
    # the first measurement at or after min_steps (6 -> step 6, the 3rd measurement).
    cfg, data, out = _world(tmp_path, tiny_policy, sft_rows, sft_until={"format": 0.0, "answer": 0.0},
                            sft_eval_every=2, sft_min_steps=5, sft_max_steps=40)
    proc = _sft(cfg, data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "sft_result.json").read_text())
    assert result["stopped"] == "thresholds" and result["steps"] == 6
    assert result["max_steps"] == 40
    assert result["thresholds"] == {"format": 0.0, "answer": 0.0}
    assert [h["step"] for h in result["history"]] == [2, 4, 6]
    assert set(result["skills"]) == {"format", "first_query", "query", "answer"}
    steps = _steps(out)
    assert [s["step"] for s in steps] == list(range(1, 7))
    assert [s["epoch"] for s in steps] == [0, 0, 0, 0, 1, 1]  # epochs repeat under the gate
    assert [s["step"] for s in steps if "skill/format" in s] == [2, 4, 6]
    assert "step 6: skills format" in proc.stderr and "SFT skills reached at step 6" in proc.stderr
    assert (out / "policy" / "config.json").is_file()
    # the LR schedule's horizon is the cap, not the steps run: same LR as a 40-step run
    assert "40 steps at most" in proc.stderr
    # resuming a run the gate stopped does not train on
    env = dict(os.environ, OMP_NUM_THREADS="1")
    again = subprocess.run([str(FORAGE), "learner", "sft", "--config", str(cfg), "--data",
                            str(data), "--resume"], env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and [s["step"] for s in _steps(out)] == list(range(1, 7))
    assert json.loads((out / "sft_result.json").read_text())["stopped"] == "thresholds"


@pytest.mark.slow  # a real `forage learner sft` run: 30-140 s on the shared 2 cores
def test_gate_hits_the_cap_with_one_warning_line(tiny_policy, tmp_path, sft_rows):
    cfg, data, out = _world(tmp_path, tiny_policy, sft_rows, sft_until={"format": 1.0, "answer": 1.0},
                            sft_eval_every=2, sft_max_steps=3)
    proc = _sft(cfg, data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "sft_result.json").read_text())
    assert result["stopped"] == "cap" and result["steps"] == 3
    assert [h["step"] for h in result["history"]] == [2, 3]  # the last step is measured too
    warnings = [line for line in proc.stderr.splitlines() if " WARNING " in line
                and "sft_max_steps" in line]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "SFT hit the cap learner.sft_max_steps=3" in warnings[0]
    assert "format 0.00 < 1.00, answer 0.00 < 1.00 at step 3" in warnings[0]
    line = warm_start_line(result)
    assert line.startswith("warm start: WARNING: the cap of 3 SFT steps was hit")
    assert "format 0.00 < 1.00, answer 0.00 < 1.00" in line


@pytest.mark.slow  # a real `forage learner sft` run: 30-140 s on the shared 2 cores
def test_measuring_without_a_gate_keeps_the_fixed_length(tiny_policy, tmp_path, sft_rows):
    cfg, data, out = _world(tmp_path, tiny_policy, sft_rows, sft_eval_every=3, sft_epochs=2)
    proc = _sft(cfg, data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "sft_result.json").read_text())
    assert result["stopped"] == "epochs" and result["steps"] == 8 and result["thresholds"] is None
    assert [h["step"] for h in result["history"]] == [3, 6, 8]
    assert warm_start_line(result).endswith("after 8 steps (no gate)")


def test_missing_heldout_set_is_one_line(tiny_policy, tmp_path, sft_rows):
    cfg, data, _ = _world(tmp_path, tiny_policy, sft_rows, sft_until={"format": 0.5}, sft_eval_every=2,
                          sft_max_steps=4)
    (tmp_path / "sft_heldout.parquet").unlink()
    proc = _sft(cfg, data)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "sft_heldout.parquet" in lines[0] and "does not exist" in lines[0]


@pytest.mark.parametrize(("learner", "message"), [
    ({"sft_until": {"format": 0.9}, "sft_max_steps": 10}, "needs learner.sft_eval_every"),
    ({"sft_until": {"format": 0.9}, "sft_eval_every": 5}, "needs learner.sft_max_steps"),
    ({"sft_min_steps": 20, "sft_max_steps": 10}, "sft_min_steps is above"),
])
def test_gate_settings_are_checked(learner, message, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps({"learner": learner}))
    with pytest.raises(ConfigError, match=message):
        load_config(cfg)


def test_unknown_skill_names_the_known_ones(tiny_policy, tmp_path, sft_rows):
    cfg, data, _ = _world(tmp_path, tiny_policy, sft_rows, sft_until={"copying": 0.5}, sft_eval_every=2,
                          sft_max_steps=4)
    proc = _sft(cfg, data)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unknown skills ['copying']" in proc.stderr and "'query'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_warm_start_line_when_reached() -> None:
    result = {"steps": 360, "max_steps": 1200, "stopped": "thresholds",
              "skills": {"format": 1.0, "first_query": 0.7, "query": 0.875, "answer": 0.84},
              "thresholds": {"format": 0.95, "query": 0.8, "answer": 0.8}}
    assert warm_start_line(result) == (
        "warm start: format 1.00, query 0.88, answer 0.84 (thresholds 0.95 / 0.80 / 0.80) "
        "reached at step 360 of at most 1200")
