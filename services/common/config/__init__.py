"""One YAML file configures a run; several merge in order; `a.b=c` overrides any key (docs/architecture.md).

Each section lives in its own module so that a service adds its keys without touching the
others. Loading is strict: an unknown or ill-typed key raises `ConfigError` naming the key,
what is wrong, where the value came from (which file, the command line, or the environment)
and, for an unknown key, the key that was probably meant (layers.py, errors.py). Maps that a
service package types, such as `learner.algorithm`, are checked at load too (subsections.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from services.common.config.base import ConfigError, Section
from services.common.config.data import DataSection
from services.common.config.errors import (
    describe_problems,
    sections_of,
    source_label,
    validation_problems,
)
from services.common.config.layers import (
    Layered,
    bare_override_pattern,
    command_line_source,
    environment_source,
    parse_override,
)
from services.common.config.learner import LearnerSection
from services.common.config.model import ModelSection
from services.common.config.probe import ProbeSection
from services.common.config.redis import RedisSection
from services.common.config.retriever import RetrieverSection
from services.common.config.rollout import RolloutSection
from services.common.config.scorer import ScorerSection
from services.common.config.subsections import (
    register_subsection,
    subsection_models,
    subsection_problems,
)
from services.common.config.yaml_input import read_yaml_file
from services.common.redact import (
    PLACEHOLDER,
    dotted,
    is_secret_key,
    placeholders,
    redact_text,
    restore,
    scrub,
)

__all__ = [
    "ConfigError",
    "RunConfig",
    "Section",
    "apply_overrides",
    "is_bare_override",
    "load_config",
    "load_config_layers",
    "parse_override",
    "register_subsection",
]

ConfigPaths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None


class RunConfig(Section):
    run_id: str = "default"  # the run's name: log lines, trackers and report titles
    run_dir: str = "runs/default"  # where the run's config.yaml, metrics.jsonl, samples and logs go
    log_level: str = "INFO"  # Python logging level of every service (DEBUG, INFO, WARNING, ...)
    redis: RedisSection = Field(default_factory=RedisSection)
    retriever: RetrieverSection = Field(default_factory=RetrieverSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    scorer: ScorerSection = Field(default_factory=ScorerSection)
    learner: LearnerSection = Field(default_factory=LearnerSection)
    probe: ProbeSection = Field(default_factory=ProbeSection)
    data: DataSection = Field(default_factory=DataSection)
    model: ModelSection = Field(default_factory=ModelSection)


def is_bare_override(word: str) -> bool:
    """Is a bare command-line word an override (`learner.lr=1e-6`, as Hydra users type it)?
    Its first part must be a top-level key, so a path with '=' in it is never taken for one."""
    return bool(_BARE_OVERRIDE.match(word))


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of `raw` with each dotted override set (intermediate maps created)."""
    layered = Layered()
    layered.merge(raw, "<input>")
    _apply(layered, overrides)
    return layered.raw


def load_config(
    path: ConfigPaths = None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> RunConfig:
    """Load a run config: YAML file(s) merged in order (or defaults when `path` is None or
    empty), then the overrides, then validation.

    `REDIS_URL` in the environment replaces `redis.url`, `FORAGE_WEIGHT_SYNC_TOKEN`
    `learner.weight_sync_token`, and so on for each of ENVIRONMENT_KEYS, unless an override
    sets that key explicitly.

    A secret that was redacted when the config was saved (`***`, services/common/redact.py:
    a run's config.yaml) is an error naming the key and where to pass it again, unless
    FORAGE_CONFIG_SECRETS (set by `forage up` for its children) holds its real value. No
    error message shows a secret of the config.
    """
    layered = _layers(path, overrides, os.environ if environ is None else environ)
    problems = _redacted_problems(layered)
    try:
        config = RunConfig.model_validate(layered.raw)
    except ValidationError as exc:
        extra = any(e["type"] == "extra_forbidden" for e in exc.errors())
        problems += validation_problems(exc, RunConfig, layered,
                                        elsewhere=subsection_models() if extra else ())
    problems.extend(subsection_problems(layered, sections_of(RunConfig, ())))
    if problems:
        raise ConfigError(scrub(describe_problems(problems), layered.raw))
    return config


def load_config_layers(
    path: ConfigPaths = None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Every key the files, overrides and environment set (dotted, leaves only) -> its source
    (a file path, `the command line (a.b=c)` or `the environment (REDIS_URL)`)."""
    layered = _layers(path, overrides, os.environ if environ is None else environ)
    keys = sorted(layered.origin)
    return {".".join(key): scrub(layered.origin[key], layered.raw) for key in keys
            if not any(len(other) > len(key) and other[: len(key)] == key for other in keys)}


# Environment variables that set a key unless the command line sets it: the Redis address
# (every tool's convention), and the weight-sync token, a secret that belongs in the
# environment (a compose .env file, a Kubernetes Secret) rather than in a config file or a
# process's command line (visible in `ps`). The files a deployment mounts (Redis's password,
# the TLS certificates) are named here too, by the deploy file that mounts them, so the run
# config stays the same with TLS on or off (docs/deploy.md, "Security"). An empty variable
# counts as unset.
ENVIRONMENT_KEYS: dict[str, list[str]] = {
    "REDIS_URL": ["redis", "url"],
    "REDIS_USERNAME": ["redis", "username"],
    "REDIS_PASSWORD_FILE": ["redis", "passfile"],
    "REDIS_TLS_CA_FILE": ["redis", "tls_ca_file"],
    "FORAGE_WEIGHT_SYNC_TOKEN": ["learner", "weight_sync_token"],
    "FORAGE_WEIGHT_SYNC_TLS_CERT_FILE": ["learner", "weight_sync_tls_cert_file"],
    "FORAGE_WEIGHT_SYNC_TLS_KEY_FILE": ["learner", "weight_sync_tls_key_file"],
    "FORAGE_WEIGHT_SYNC_TLS_CA_FILE": ["learner", "weight_sync_tls_ca_file"],
    "FORAGE_WEIGHT_RELAY_TLS_CERT_FILE": ["rollout", "weight_relay_tls_cert_file"],
    "FORAGE_WEIGHT_RELAY_TLS_KEY_FILE": ["rollout", "weight_relay_tls_key_file"],
    "FORAGE_WEIGHT_RELAY_TLS_NAME": ["rollout", "weight_relay_tls_name"],
}

# The secrets `forage up` redacted in RUN_DIR/config.yaml, handed to its children in their
# environment (a JSON list of [path, value]; services/launch/up.py) so that they read the saved
# config with the real values.
SECRETS_VARIABLE = "FORAGE_CONFIG_SECRETS"


def _layers(path: ConfigPaths, overrides: Iterable[str], environ: Mapping[str, str]) -> Layered:
    layered = Layered()
    for file_path in _as_paths(path):
        layered.merge(read_config_file(file_path), str(file_path))
    overrides = list(overrides)
    _apply(layered, overrides)
    overridden = [parse_override(o)[0] for o in overrides]
    for variable, key in ENVIRONMENT_KEYS.items():
        if not environ.get(variable) or key in overridden:
            continue
        section = layered.raw.get(key[0])
        if section is not None and not isinstance(section, dict):
            raise ConfigError(describe_problems([
                f"{key[0]}: must be a mapping (got {section!r}); "
                f"{source_label(layered.source_of([key[0]]))}"]))
        layered.set(list(key), environ[variable], environment_source(variable), variable)
    if environ.get(SECRETS_VARIABLE):
        try:
            leaves = [(tuple(path), value)
                      for path, value in json.loads(environ[SECRETS_VARIABLE])]
        except (ValueError, TypeError):
            raise ConfigError(f"{SECRETS_VARIABLE} in the environment is not the JSON list of "
                              "[path, value] that `forage up` sets; unset it") from None
        restore(layered.raw, leaves)
    return layered


def _redacted_problems(layered: Layered) -> list[str]:
    """One line per secret still redacted (`***`) after files, overrides and environment."""
    hints = {tuple(key): variable for variable, key in ENVIRONMENT_KEYS.items()}
    lines = []
    for path in placeholders(layered.raw):
        key = dotted(path)
        variable = hints.get(path)
        where = (f"{variable} in the environment or --set {key}=..." if variable else
                 f"--set {key}=... or a config file of your own that holds it")
        lines.append(f"{key}: holds {PLACEHOLDER}, a secret hidden when this config was saved; "
                     f"pass the real value again ({where}); "
                     f"{source_label(layered.source_of(path))}")
    return lines


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """One config file's top-level mapping (an empty file is an empty mapping)."""
    source = str(path)
    file_path = Path(path)
    if not file_path.exists():
        raise ConfigError(f"config file {source} does not exist")
    if not file_path.is_file():
        raise ConfigError(f"config file {source} is not a file")
    loaded = read_yaml_file(file_path, source)  # one ConfigError for any unreadable file
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    return loaded


def _as_paths(path: ConfigPaths) -> list[str | os.PathLike[str]]:
    if path is None:
        return []
    if isinstance(path, str | os.PathLike):
        return [path]
    return list(path)


def _apply(layered: Layered, overrides: Iterable[str]) -> None:
    for override in overrides:
        try:
            keys, value = parse_override(override)
            layered.set(keys, value, command_line_source(override), override)
        except ConfigError as exc:  # it quotes the override: not a secret's value
            key, _, value = override.partition("=")
            if value and any(is_secret_key(part) for part in key.split(".")):
                raise ConfigError(str(exc).replace(value, PLACEHOLDER)) from None
            raise ConfigError(redact_text(str(exc))) from None


_BARE_OVERRIDE = bare_override_pattern(RunConfig.model_fields)
