"""2 CPU ranks (gloo, torchrun) give the same update as 1 rank on the same batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("dist_step_script.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _run(policy: Path, out: Path, nproc: int, zero_stage: int) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path.cwd()))
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", str(SCRIPT),
           str(policy), str(out), str(zero_stage)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    return load_file(str(out / "weights.safetensors")), json.loads((out / "metrics.json").read_text())


@pytest.mark.slow
def test_two_ranks_equal_one_rank(tiny_policy, tmp_path) -> None:
    one, m1 = _run(tiny_policy, tmp_path / "one", 1, 0)
    two, m2 = _run(tiny_policy, tmp_path / "two", 2, 2)  # and ZeRO-2 shards the optimizer
    assert m1["sft"]["loss"] == pytest.approx(m2["sft"]["loss"], rel=1e-5)
    assert m1["sft"]["grad_norm"] == pytest.approx(m2["sft"]["grad_norm"], rel=1e-4)
    assert m1["sft"]["tokens_computed"] == m2["sft"]["tokens_computed"]
    if "rl" in m1:
        assert m1["rl"]["pg_loss"] == pytest.approx(m2["rl"]["pg_loss"], rel=1e-4, abs=1e-6)
    initial = None
    for name, value in one.items():
        assert torch.allclose(value, two[name], atol=2e-5, rtol=1e-4), name
        initial = value
    assert initial is not None
