"""Reading YAML that a person wrote: every way it can be unreadable is one `ConfigError` line.

PyYAML raises more than `YAMLError` on hostile files (issue 14): a file that is not UTF-8
raised UnicodeDecodeError, nesting deeper than Python's recursion limit a RecursionError inside
its composer, and anchors and aliases build structures that the rest of the loader walks as
trees: an alias inside the node it names (`a: &a [*a]`) is a cycle that recursed until the
stack ran out, and aliases of aliases ("billion laughs": nine levels of nine repeats, 300 bytes)
expand to 9^9 values that the merge and the validation copied for minutes. Anchors stay
allowed (a config may reuse a block), but what they expand to is measured first, in time
linear in the distinct nodes, and refused past `MAX_DEPTH` levels or `MAX_VALUES` values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from services.common.config.base import ConfigError

# A run config is a few levels deep (scorer.rewards.<source>[i].options.<key> is the deepest
# built-in key) and a few hundred values; these bounds are far above any real one.
MAX_DEPTH = 64
MAX_VALUES = 100_000


def shown(text: str, limit: int = 80) -> str:
    """`text` quoted for an error line, cut to `limit` characters (an override can be huge)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def read_yaml_file(path: str | Path, source: str) -> Any:
    """The parsed content of a YAML file; ConfigError naming `source` when it cannot be."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read it ({exc.strerror})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                          f"{exc.start}); save it as UTF-8") from None
    return parse_yaml(text, source)


def parse_yaml(text: str, where: str) -> Any:
    """`yaml.safe_load(text)`, with its structure checked (`check_shape`)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to read (at most {MAX_DEPTH} levels)"
                          ) from None
    check_shape(value, where)
    return value


def check_shape(value: Any, where: str) -> None:
    """Refuse a cycle (an alias inside the node it names), more than MAX_DEPTH levels, or more
    than MAX_VALUES values once aliases are expanded. Shared nodes are measured once."""
    measured: dict[int, tuple[int, int]] = {}  # id -> (values, levels) once expanded
    _measure(value, 0, set(), measured, where)


def _measure(node: Any, depth: int, on_path: set[int], measured: dict[int, tuple[int, int]],
             where: str) -> tuple[int, int]:
    if isinstance(node, dict):
        children = list(node.values())
    elif isinstance(node, list):
        children = node
    else:
        return 1, 0
    key = id(node)
    if key in on_path:
        raise ConfigError(f"{where}: a YAML alias refers to a block that contains it "
                          "(a recursive structure)")
    if key not in measured:
        if depth >= MAX_DEPTH:
            raise ConfigError(f"{where}: nested more than {MAX_DEPTH} levels deep")
        on_path.add(key)
        values, levels = 1, 0
        for child in children:
            child_values, child_levels = _measure(child, depth + 1, on_path, measured, where)
            values += child_values
            levels = max(levels, child_levels + 1)
            if values > MAX_VALUES:
                raise ConfigError(f"{where}: more than {MAX_VALUES} values once its YAML aliases "
                                  "are expanded (each alias repeats the block it names)")
        on_path.discard(key)
        measured[key] = (values, levels)
    values, levels = measured[key]
    if depth + levels > MAX_DEPTH:
        raise ConfigError(f"{where}: nested more than {MAX_DEPTH} levels deep")
    return values, levels
