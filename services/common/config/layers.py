"""Config layers: several files merged in order, then command-line overrides, with provenance.

Why provenance: with `--config base.yaml --config exp.yaml learner.lr=-1` a bad value can come
from any of three places, and "learner.lr: must be > 0" alone leaves the user to guess which.
Every key a layer sets is recorded with where it came from (a file path, the command line with
the override as typed, or the environment), so the error message can name it
(`errors.describe_validation_error`).

Merge rule (OmegaConf's, which verl/Hydra users know): maps merge key by key, recursively; any
other value (a list, a scalar, null) replaces what was there. An override `a.b=c` sets one key
(creating missing maps); its value is parsed as YAML, so `a.b=[x, y]` is a list and
`a.b=null` is None. Hydra's `+a.b=c` and `++a.b=c` are read as `a.b=c`: every Forage key already
exists in the schema, so "add" and "force-add" mean "set" here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from services.common.config.base import ConfigError
from services.common.config.yaml_input import check_shape, shown

Key = tuple[str, ...]

# A bare command-line word that is an override, as Hydra users type them: `learner.lr=1e-6`,
# `run_id=x`, `+data.seed=7`. The first part must be a top-level config key (`top_keys`), so a
# file path that happens to hold '=' is never mistaken for one.
_BARE = r"^\+{{0,2}}(?:{keys})(?:\.[^=\s]+)?="


def bare_override_pattern(top_keys: Iterable[str]) -> re.Pattern[str]:
    keys = "|".join(re.escape(key) for key in sorted(top_keys, key=len, reverse=True))
    return re.compile(_BARE.format(keys=keys))


def command_line_source(text: str) -> str:
    return f"the command line ({text})"


def environment_source(variable: str) -> str:
    return f"the environment ({variable})"


@dataclass
class Layered:
    """The merged raw config and, for every key any layer set, where its value came from."""

    raw: dict[str, Any] = field(default_factory=dict)
    origin: dict[Key, str] = field(default_factory=dict)

    def merge(self, layer: Mapping[str, Any], source: str) -> None:
        """Merge one file's mapping over what is there (maps recursively, the rest replaces)."""
        _merge_into(self.raw, layer, source, self.origin, ())

    def set(self, keys: list[str], value: Any, source: str, text: str) -> None:
        """Set one dotted key (an override); `text` is the override as typed, for errors."""
        node = self.raw
        for position, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = {}
                node[key] = child
            elif not isinstance(child, dict):
                prefix = ".".join(keys[: position + 1])
                where = self.source_of(keys[: position + 1])
                raise ConfigError(f"override {text!r}: {prefix} is not a section "
                                  f"(it is a {type(child).__name__}, from {where})")
            node = child
        node[keys[-1]] = _deep_copy(value)
        path = tuple(keys)
        _forget_under(self.origin, path)
        _record(self.origin, path, value, source)

    def source_of(self, loc: Iterable[Any]) -> str:
        """Where the value at `loc` (a key path, e.g. a pydantic error's loc) came from: the
        source of the longest recorded prefix; for a whole section, every source that set a key
        in it. '<defaults>' when nothing set it."""
        path = tuple(str(part) for part in loc)
        for end in range(len(path), 0, -1):
            found = self.origin.get(path[:end])
            if found is None:
                continue
            if end < len(path):
                return found
            inner = [src for key, src in self.origin.items() if key[:end] == path and
                     len(key) > end]
            sources = list(dict.fromkeys([*inner, found]))
            return " and ".join(sources)
        return "<defaults>"


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `learner.lr=1e-6` into (["learner", "lr"], 1e-6); the value is parsed as YAML.
    A leading `+` or `++` (Hydra's add / force-add) is accepted and ignored."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    dotted, raw_value = text.split("=", 1)
    dotted = dotted.strip()
    if dotted.startswith("+"):
        dotted = dotted[2:] if dotted.startswith("++") else dotted[1:]
    keys = [part.strip() for part in dotted.split(".")]
    if not dotted or any(not part for part in keys):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw_value) if raw_value != "" else ""
    except yaml.YAMLError as exc:
        problem = str(exc).replace("\n", " ")
        raise ConfigError(f"override {text!r}: value is not valid YAML ({problem})") from None
    except RecursionError:
        raise ConfigError(f"override {shown(text)}: value nested too deeply") from None
    check_shape(value, f"override {shown(text)}")
    return keys, value


def _merge_into(base: dict[str, Any], layer: Mapping[Any, Any], source: str,
                origin: dict[Key, str], prefix: Key) -> None:
    for key, value in layer.items():
        path = (*prefix, str(key))
        current = base.get(key)
        if isinstance(value, Mapping) and isinstance(current, dict):
            origin[path] = source
            _merge_into(current, value, source, origin, path)
        else:
            base[key] = _deep_copy(value)
            _forget_under(origin, path)
            _record(origin, path, value, source)


def _record(origin: dict[Key, str], path: Key, value: Any, source: str) -> None:
    origin[path] = source
    if isinstance(value, Mapping):
        for key, child in value.items():
            _record(origin, (*path, str(key)), child, source)


def _forget_under(origin: dict[Key, str], path: Key) -> None:
    for key in [k for k in origin if len(k) > len(path) and k[: len(path)] == path]:
        del origin[key]


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _deep_copy(child) for key, child in value.items()}
    if isinstance(value, list):
        return [_deep_copy(child) for child in value]
    return value
