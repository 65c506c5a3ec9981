"""2 CPU ranks (gloo, torchrun) give the same updates as 1 rank on the same batches, including
a batch of one sequence (one rank only runs a dummy pass) and a batch of one GRPO group whose
prompt each row computes once (learner.shared_prompts); and on 2 ranks only rank 0 copies the
exported weights to the host, while rank 1 still joins every ZeRO-3 gather."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("dist_step_script.py")
EXPORT_SCRIPT = Path(__file__).with_name("dist_export_script.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")


def step_command(policy: Path, out: Path, nproc: int, zero_stage: int,
                 launch: Sequence[str] = ("--standalone",)) -> list[str]:
    """torchrun running SCRIPT with `nproc` ranks (per node, with a multi-node `launch`)."""
    return [str(TORCHRUN), *launch, f"--nproc_per_node={nproc}", str(SCRIPT), str(policy),
            str(out), str(zero_stage)]


def step_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path.cwd()))


def step_results(out: Path) -> tuple[dict, dict]:
    """The weights and metrics SCRIPT's rank 0 wrote to `out`."""
    from safetensors.torch import load_file

    return load_file(str(out / "weights.safetensors")), json.loads((out / "metrics.json").read_text())


def _run(policy: Path, out: Path, nproc: int, zero_stage: int) -> tuple[dict, dict]:
    out.mkdir(parents=True)
    result = subprocess.run(step_command(policy, out, nproc, zero_stage), env=step_env(),
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    return step_results(out)


def assert_same_updates(one: dict, m1: dict, two: dict, m2: dict) -> None:
    """Two ranks' run (`two`, `m2`) made the updates of the one-rank run (`one`, `m1`): the
    same losses, gradient norms and weights up to reduction order, and the tokens each
    computed (the group's prompt once per rank with shared prompts)."""
    for case in ("mixed", "single", "group"):
        a, b = m1[case], m2[case]
        assert a["sft"]["loss"] == pytest.approx(b["sft"]["loss"], rel=1e-5), case
        assert a["sft"]["grad_norm"] == pytest.approx(b["sft"]["grad_norm"], rel=1e-4), case
        assert a["rl"]["pg_loss"] == pytest.approx(b["rl"]["pg_loss"], rel=1e-4, abs=1e-6), case
        assert a["rl"]["loss"] == pytest.approx(b["rl"]["loss"], rel=1e-4, abs=1e-6), case
    assert m1["mixed"]["sft"]["tokens_computed"] == m2["mixed"]["sft"]["tokens_computed"]
    # One rank computes the group's prompt once; two ranks once each (half the group each).
    prompt = 30 - 1
    assert m2["group"]["sft"]["tokens_computed"] == m1["group"]["sft"]["tokens_computed"] + prompt
    initial = None
    for name, value in one.items():
        assert torch.allclose(value, two[name], atol=2e-5, rtol=1e-4), name
        initial = value
    assert initial is not None


@pytest.mark.slow
def test_two_ranks_equal_one_rank(tiny_policy, tmp_path) -> None:
    one, m1 = _run(tiny_policy, tmp_path / "one", 1, 0)
    two, m2 = _run(tiny_policy, tmp_path / "two", 2, 2)  # and ZeRO-2 shards the optimizer
    assert_same_updates(one, m1, two, m2)


def test_only_rank_0_copies_the_export(tiny_policy, tmp_path) -> None:
    """Rank 1 gets {} and makes no host copy at ZeRO 0, 2 and 3 (where it still runs every
    grouped gather: had it skipped one, rank 0 would hang in it and the run time out); rank 0
    gets the same names and values as a whole-model export, tied lm_head as one copy."""
    stages = (0, 2, 3)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path.cwd()))
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(EXPORT_SCRIPT),
           str(tiny_policy), str(tmp_path), ",".join(map(str, stages))]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-4000:]
    for stage in stages:
        first, second = (json.loads((tmp_path / f"export_z{stage}_rank{r}.json").read_text())
                         for r in (0, 1))
        assert second["keys"] == [], stage
        assert second["copies"] == {"host_copy": 0, "clone": 0, "cpu": 0}, stage
        assert first["keys"] == first["reference_keys"], stage  # same names, same order
        assert first["equal"] and first["tied_shared"], stage
        assert first["copies"]["host_copy"] == len(first["keys"]) - 1, stage  # lm_head: shared
        assert second["groups"] == first["groups"], stage
    assert first["groups"] >= 4  # ZeRO-3: one gather per decoder layer at least
