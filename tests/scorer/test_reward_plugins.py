"""Reward plug-ins: `module:function` and verl's `path/to/reward.py:function`, without PYTHONPATH.

The `forage` console script (not `python -m`, which puts the working directory on sys.path) is
what users run, so the command-line tests run `.venv/bin/forage` with PYTHONPATH unset, from a
directory that holds the user's file, as a user beside their run would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.scorer.pool import STATUS_OK, Job, RewardPool
from services.scorer.rewards.registry import RewardTable, load_ref, resolve_function
from tests.suite_rules import MISSING_PACKAGE

FORAGE = Path(sys.executable).with_name("forage")
NO_SCRIPT = f"{MISSING_PACKAGE} no forage console script beside {sys.executable} (make install)"
REWARD = '''
def brevity(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0 - len(solution_str) / 100, "chars": len(solution_str)}
'''


def run_forage(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(FORAGE), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def score_with(tmp_path: Path, function: str) -> subprocess.CompletedProcess:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"scorer": {"rewards": {"mytask": [
        {"function": function, "weight": 2.0}]}}}))
    return run_forage(tmp_path, "score", "--config", "run.yaml", "--data-source", "mytask",
                      "--solution", "0123456789", "--ground-truth", "x")


@pytest.mark.skipif(not FORAGE.exists(), reason=NO_SCRIPT)
def test_file_form_works_without_pythonpath(tmp_path: Path) -> None:
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "brevity.py").write_text(REWARD)
    done = score_with(tmp_path, "rewards/brevity.py:brevity")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["score"] == pytest.approx(2 * 0.9)
    assert result["components"]["rewards/brevity.py:brevity/chars"] == 10


@pytest.mark.skipif(not FORAGE.exists(), reason=NO_SCRIPT)
def test_module_form_finds_a_module_in_the_working_directory(tmp_path: Path) -> None:
    """Failed before: the console script's sys.path has no working directory, so
    `my_rewards:brevity` beside the run was 'cannot import my_rewards' unless PYTHONPATH=."""
    (tmp_path / "my_rewards.py").write_text(REWARD)
    done = score_with(tmp_path, "my_rewards:brevity")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["score"] == pytest.approx(1.8)


@pytest.mark.skipif(not FORAGE.exists(), reason=NO_SCRIPT)
def test_a_missing_file_is_one_line_naming_it(tmp_path: Path) -> None:
    done = score_with(tmp_path, "nowhere/reward.py:brevity")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "nowhere/reward.py" in lines[0] and "does not exist" in lines[0]


def test_file_form_errors_name_the_problem(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "ok.py").write_text(REWARD + "NOT_CALLABLE = 3\n")
    with pytest.raises(ValueError, match=r"raised on import: RuntimeError: boom"):
        load_ref(f"{tmp_path}/broken.py:brevity")
    with pytest.raises(ValueError, match=r"has no nothing"):
        load_ref(f"{tmp_path}/ok.py:nothing")
    with pytest.raises(ValueError, match=r"is not callable"):
        load_ref(f"{tmp_path}/ok.py:NOT_CALLABLE")
    with pytest.raises(ValueError, match=r"must look like"):
        load_ref("ok.py")


def test_two_files_of_the_same_name_stay_apart(tmp_path: Path) -> None:
    for name, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "reward.py").write_text(f"def f(*args, **kw):\n    return {value}\n")
    assert load_ref(f"{tmp_path}/a/reward.py:f")() == 1.0
    assert load_ref(f"{tmp_path}/b/reward.py:f")() == 2.0


def test_isolated_file_reward_runs_in_the_pool_from_another_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's spawned workers resolve refs with the same rule; a relative file ref is pinned
    to an absolute path when the table is built, so a worker's directory does not matter."""
    (tmp_path / "r.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)
    function = resolve_function("r.py:brevity", isolated=True)
    assert function.ref == f"{tmp_path.resolve()}/r.py:brevity"
    table = RewardTable({"mytask": [{"function": "r.py:brevity", "isolated": True}]})
    assert table.components("mytask")[0].function.isolated
    monkeypatch.chdir("/")
    with RewardPool(num_workers=1, timeout_s=30.0, preload=()) as pool:
        result = pool.run([Job(function.ref, ("mytask", "01234", "x", None))])[0]
    assert result.status == STATUS_OK, result.error
    assert result.value == {"score": 0.95, "chars": 5}
