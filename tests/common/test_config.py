"""Config loading: YAML + dotted overrides + REDIS_URL, errors that name the key and the file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import ConfigError, apply_overrides, load_config, parse_override

REPO = Path(__file__).resolve().parents[2]


def test_defaults_validate() -> None:
    config = load_config(None, environ={})
    assert config.redis.namespace == "forage"
    assert config.redis.url is None
    assert config.learner.max_staleness == 1


def test_yaml_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("learner:\n  lr: 1.0e-5\n  total_steps: 7\nprobe:\n  enable: true\n")
    config = load_config(path, ["learner.lr=3e-6", "rollout.max_turns=2"], environ={})
    assert config.learner.lr == pytest.approx(3e-6)
    assert config.learner.total_steps == 7
    assert config.rollout.max_turns == 2
    assert config.probe.enable is True


def test_override_values_are_parsed_as_yaml() -> None:
    assert parse_override("data.train_files=[a.parquet, b.parquet]") == (
        ["data", "train_files"],
        ["a.parquet", "b.parquet"],
    )
    assert parse_override("probe.enable=false") == (["probe", "enable"], False)
    assert parse_override("run_id=abc") == (["run_id"], "abc")
    assert apply_overrides({"a": {"b": 1}}, ["a.c=2"]) == {"a": {"b": 1, "c": 2}}


def test_unknown_key_names_key_and_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("learner:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert "learner.lrr: unknown key" in str(info.value)
    assert str(path) in str(info.value)


def test_ill_typed_key_names_key() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.max_turns: .*integer"):
        load_config(None, ["rollout.max_turns=many"], environ={})
    with pytest.raises(ConfigError, match=r"redis\.backpressure"):
        load_config(None, ["redis.backpressure=drop"], environ={})


@pytest.mark.parametrize(
    ("override", "message"),
    [("learner.lr", "must look like"), (".lr=1", "empty key"), ("learner.lr.x=1", "learner.lr")],
)
def test_malformed_overrides(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["learner.lr=1e-6", override] if "x=" in override else [override], environ={})


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text("learner: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)


def test_redis_url_from_environment_unless_overridden() -> None:
    env = {"REDIS_URL": "redis://10.0.0.5:6380/0"}
    assert load_config(None, environ=env).redis.url == "redis://10.0.0.5:6380/0"
    explicit = load_config(None, ["redis.url=redis://127.0.0.1:7000/0"], environ=env)
    assert explicit.redis.url == "redis://127.0.0.1:7000/0"


def test_weight_sync_token_from_environment_unless_overridden() -> None:
    """The deploy files hand the token to the learner and the replicas as an environment
    variable (a compose .env / a Kubernetes Secret), never on a command line or in a file."""
    env = {"FORAGE_WEIGHT_SYNC_TOKEN": "s3cret"}
    assert load_config(None, environ=env).learner.weight_sync_token == "s3cret"
    assert load_config(None, environ={}).learner.weight_sync_token is None
    explicit = load_config(None, ["learner.weight_sync_token=other"], environ=env)
    assert explicit.learner.weight_sync_token == "other"
    from services.common.config import load_config_layers

    sources = load_config_layers(None, environ=env)
    assert sources == {"learner.weight_sync_token": "the environment (FORAGE_WEIGHT_SYNC_TOKEN)"}


def test_every_shipped_config_validates() -> None:
    shipped = sorted((REPO / "configs").glob("*.yaml"))
    assert shipped, "configs/ must hold at least one documented example"
    for path in shipped:
        load_config(path, environ={})


def test_cli_reports_config_errors_and_unknown_commands() -> None:
    forage = [sys.executable, "-m", "services.cli"]
    result = subprocess.run([*forage, "frobnicate"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2
    assert "unknown command 'frobnicate'" in result.stderr
    help_result = subprocess.run([*forage, "--help"], capture_output=True, text=True, cwd=REPO)
    assert help_result.returncode == 0
    assert "retriever" in help_result.stdout and "learner" in help_result.stdout
