"""Several config files merged in order, overrides as `--set a.b=c` or bare `a.b=c`, errors that
name where the bad value came from, "did you mean" for keys, and `learner.algorithm` checked at
load (services/common/config/layers.py, errors.py, subsections.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import services.cli  # noqa: F401  (registers learner.algorithm, as every `forage` command does)
from services.common.config import ConfigError, load_config, load_config_layers

FORAGE = [sys.executable, "-m", "services.cli"]


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def forage(*args: str, cwd: Path | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    return subprocess.run([*FORAGE, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)


def test_files_merge_in_order(tmp_path: Path) -> None:
    base = write(tmp_path / "base.yaml", {
        "run_id": "base",
        "learner": {"lr": 1e-5, "total_steps": 7, "algorithm": {"clip_ratio_high": 0.28}},
        "data": {"train_files": ["a.parquet", "b.parquet"], "n_samples": 4},
    })
    exp = write(tmp_path / "exp.yaml", {
        "learner": {"lr": 3e-6, "algorithm": {"policy_loss": "cispo"}},
        "data": {"train_files": ["c.parquet"]},
    })
    cfg = load_config([base, exp], environ={})
    assert cfg.run_id == "base"
    assert cfg.learner.lr == pytest.approx(3e-6)           # the later file wins
    assert cfg.learner.total_steps == 7                    # maps merge key by key
    assert cfg.learner.algorithm == {"clip_ratio_high": 0.28, "policy_loss": "cispo"}
    assert cfg.data.train_files == ["c.parquet"]           # a list replaces, as in OmegaConf
    assert cfg.data.n_samples == 4
    swapped = load_config([exp, base], environ={})
    assert swapped.learner.lr == pytest.approx(1e-5)
    assert swapped.data.train_files == ["a.parquet", "b.parquet"]
    sources = load_config_layers([base, exp], ["learner.total_steps=2"], environ={})
    assert sources["learner.lr"] == str(exp)
    assert sources["data.n_samples"] == str(base)
    assert sources["learner.total_steps"] == "the command line (learner.total_steps=2)"


def test_error_names_the_file_or_the_command_line(tmp_path: Path) -> None:
    base = write(tmp_path / "base.yaml", {"learner": {"lr": -1.0}})
    exp = write(tmp_path / "exp.yaml", {"rollout": {"max_turns": "many"}})
    with pytest.raises(ConfigError) as info:
        load_config([base, exp], environ={})
    text = str(info.value)
    lr_line = next(line for line in text.splitlines() if "learner.lr" in line)
    turns_line = next(line for line in text.splitlines() if "rollout.max_turns" in line)
    assert lr_line.endswith(f"in {base}") and "greater than 0" in lr_line
    assert turns_line.endswith(f"in {exp}")
    # The same bad value from the command line names the override as typed.
    with pytest.raises(ConfigError) as info:
        load_config([exp], ["rollout.max_turns=2", "learner.lr=-1"], environ={})
    assert str(info.value) == ("invalid config: learner.lr: Input should be greater than 0 "
                               "(got -1); on the command line: learner.lr=-1")
    # A file value overridden on the command line is blamed on the command line.
    with pytest.raises(ConfigError, match=r"on the command line: learner.lr=0$"):
        load_config([base], ["learner.lr=0"], environ={})


def test_one_problem_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path / "run.yaml", {"learner": {"lrr": 0.1}})
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert str(info.value) == ("invalid config: learner.lrr: unknown key (did you mean "
                               f"learner.lr?); in {path}")


@pytest.mark.parametrize(("override", "hint"), [
    ("learner.lrr=1", "did you mean learner.lr?"),
    ("rollout.max_turn=2", "did you mean rollout.max_turns?"),
    ("learner.n_samples=4", "it is data.n_samples"),        # a key in the wrong section
    ("learner.clip_ratio_high=0.28", "it is learner.algorithm.clip_ratio_high"),
    ("learner.algorithm.polcy_loss=cispo", "did you mean learner.algorithm.policy_loss?"),
    ("learner.algorithm.lr=1", "it is learner.lr"),
])
def test_unknown_keys_suggest_the_likely_one(override: str, hint: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override], environ={})
    assert f"{override.split('=')[0]}: unknown key ({hint})" in str(info.value)


def test_algorithm_values_are_checked_at_load() -> None:
    with pytest.raises(ConfigError, match=r"learner\.algorithm\.clip_ratio_low: .*greater than"):
        load_config(None, ["learner.algorithm.clip_ratio_low=-1"], environ={})
    with pytest.raises(ConfigError, match=r"learner\.algorithm\.policy_loss: "):
        load_config(None, ["learner.algorithm.policy_loss=nonsense"], environ={})
    cfg = load_config(None, ["learner.algorithm.policy_loss=cispo"], environ={})
    assert cfg.learner.algorithm == {"policy_loss": "cispo"}


def test_hydra_add_prefixes_are_read_as_set() -> None:
    cfg = load_config(None, ["+learner.lr=2e-6", "++data.seed=3"], environ={})
    assert cfg.learner.lr == pytest.approx(2e-6) and cfg.data.seed == 3


def test_environment_is_named_as_the_source() -> None:
    sources = load_config_layers(None, environ={"REDIS_URL": "redis://10.0.0.5:6380/0"})
    assert sources == {"redis.url": "the environment (REDIS_URL)"}
    with pytest.raises(ConfigError, match=r"redis: must be a mapping \(got 3\); on the command "
                                          r"line: redis=3$"):
        load_config(None, ["redis=3"], environ={"REDIS_URL": "redis://x"})


def test_bare_and_set_overrides_on_the_command_line_apply_in_order(tmp_path: Path) -> None:
    base = write(tmp_path / "base.yaml", {"learner": {"lr": 1e-5}, "data": {"seed": 1}})
    exp = write(tmp_path / "exp.yaml", {"data": {"seed": 2}})
    done = forage("config", "show", "--config", str(base), "--config", str(exp),
                  "learner.lr=2e-6", "--set", "learner.lr=3e-6", "learner.total_steps=5",
                  "+probe.enable=true")
    assert done.returncode == 0, done.stderr
    shown = yaml.safe_load(done.stdout)
    assert shown["learner"]["lr"] == pytest.approx(3e-6)   # the last one given wins
    assert shown["learner"]["total_steps"] == 5
    assert shown["data"]["seed"] == 2 and shown["probe"]["enable"] is True
    done = forage("config", "show", "--set", "learner.lr=3e-6", "learner.lr=2e-6")
    assert yaml.safe_load(done.stdout)["learner"]["lr"] == pytest.approx(2e-6)
    # A bare word that is not an override stays an error, with a hint for a mistyped section.
    done = forage("config", "show", "lerner.lr=1")
    assert done.returncode == 2
    assert "unrecognized arguments: lerner.lr=1 (did you mean learner.lr=1?)" in done.stderr


def test_forage_up_rejects_an_unknown_algorithm_key_before_starting_anything(
        tmp_path: Path) -> None:
    """Failed before: `forage up` started Redis and the services, and only the learner found the
    typo, after loading its model (and `up` then restarted it)."""
    run_dir = tmp_path / "run"
    done = forage("up", "--config", str(Path("configs/demo_quick.yaml").resolve()),
                  f"run_dir={run_dir}", "learner.algorithm.polcy_loss=cispo", timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "forage up: error: invalid config: learner.algorithm.polcy_loss: unknown key (did you "
        "mean learner.algorithm.policy_loss?); on the command line: "
        "learner.algorithm.polcy_loss=cispo")
    assert not run_dir.exists()
