"""One YAML file configures a run; `--set a.b=c` overrides any key (DESIGN.md 8).

Each section lives in its own module so that a service adds its keys without touching the
others. Loading is strict: an unknown or ill-typed key raises `ConfigError` naming the key and
the file it came from.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError

from services.common.config.base import Section
from services.common.config.data import DataSection
from services.common.config.learner import LearnerSection
from services.common.config.model import ModelSection
from services.common.config.probe import ProbeSection
from services.common.config.redis import RedisSection
from services.common.config.retriever import RetrieverSection
from services.common.config.rollout import RolloutSection
from services.common.config.scorer import ScorerSection

__all__ = [
    "ConfigError",
    "RunConfig",
    "Section",
    "apply_overrides",
    "load_config",
    "parse_override",
]


class ConfigError(ValueError):
    """A config file or override that does not validate; the message names key and source."""


class RunConfig(Section):
    run_id: str = "default"
    run_dir: str = "runs/default"
    log_level: str = "INFO"
    redis: RedisSection = Field(default_factory=RedisSection)
    retriever: RetrieverSection = Field(default_factory=RetrieverSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    scorer: ScorerSection = Field(default_factory=ScorerSection)
    learner: LearnerSection = Field(default_factory=LearnerSection)
    probe: ProbeSection = Field(default_factory=ProbeSection)
    data: DataSection = Field(default_factory=DataSection)
    model: ModelSection = Field(default_factory=ModelSection)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `learner.lr=1e-6` into (["learner", "lr"], 1e-6); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    dotted, raw_value = text.split("=", 1)
    keys = [part.strip() for part in dotted.split(".")]
    if not dotted or any(not part for part in keys):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw_value) if raw_value != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from exc
    return keys, value


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of `raw` with each dotted override set (intermediate maps created)."""
    result: dict[str, Any] = _deep_copy(raw)
    for override in overrides:
        keys, value = parse_override(override)
        node = result
        for position, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = {}
                node[key] = child
            elif not isinstance(child, dict):
                prefix = ".".join(keys[: position + 1])
                raise ConfigError(f"override {override!r}: {prefix} is not a section")
            node = child
        node[keys[-1]] = value
    return result


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> RunConfig:
    """Load a run config from YAML (or defaults when `path` is None), apply overrides, validate.

    `REDIS_URL` in the environment replaces `redis.url` unless an override set it explicitly.
    """
    environ = os.environ if environ is None else environ
    source = str(path) if path is not None else "<defaults>"
    raw: dict[str, Any] = {}
    if path is not None:
        file_path = Path(path)
        if not file_path.is_file():
            raise ConfigError(f"config file {source} does not exist")
        try:
            loaded = yaml.safe_load(file_path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections")
        raw = loaded
    overrides = list(overrides)
    redis_url_overridden = any(o.split("=", 1)[0].strip() == "redis.url" for o in overrides)
    raw = apply_overrides(raw, overrides)
    if environ.get("REDIS_URL") and not redis_url_overridden:
        raw.setdefault("redis", {})
        if not isinstance(raw["redis"], dict):
            raise ConfigError(f"{source}: key 'redis' must be a mapping")
        raw["redis"]["url"] = environ["REDIS_URL"]
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe_validation_error(exc, source)) from None


def _describe_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"]) or "<root>"
        if error["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            lines.append(f"  {key}: {error['msg']} (got {error.get('input')!r})")
    return "\n".join(lines)


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _deep_copy(child) for key, child in value.items()}
    if isinstance(value, list):
        return [_deep_copy(child) for child in value]
    return value
