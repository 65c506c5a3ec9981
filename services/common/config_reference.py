"""docs/config.md, generated: every config key with its type, default, readers and meaning.

The config classes (services/common/config/*.py) are the one source: a key's meaning is its
`Field(description=...)`, else the comment on its own line(s), else the comment block right
above it (the style those modules are written in); the first sentence of that text goes in
the table. Which services read a key is declared here, per section with per-key exceptions
(`READERS`, `KEY_READERS`), because services alias their sections (`lc = cfg.learner`) and a
text search cannot say it; tests/common/test_config_reference.py checks each claim against
the readers' sources. `forage config reference` prints the page, `--check FILE` compares.
Pure functions of the classes: the same code always gives the same page.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal, Union

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

# The commands a reader label stands for.
READER_COMMANDS: dict[str, str] = {
    "retriever": "`forage retriever serve` (and `build-index` for its build keys)",
    "rollout": "`forage rollout serve`, a rollout replica",
    "scorer": "`forage scorer serve` and `forage score`",
    "learner": "`forage learner train` / `sft`",
    "up": "`forage up` and `forage demo`, the launchers",
    "eval": "`forage eval` (`--run` reads a run's saved config)",
    "data": "`forage data` / `forage model init`",
}
ALL = ("retriever", "rollout", "scorer", "learner", "up")

# Section -> the services that read its keys, unless KEY_READERS names a key.
READERS: dict[str, tuple[str, ...]] = {
    "": ALL,
    "redis": ("rollout", "scorer", "learner", "up", "eval"),
    "retriever": ("retriever",),
    "rollout": ("rollout",),
    "scorer": ("scorer",),
    "learner": ("learner",),
    "probe": ("rollout",),
    "data": ("learner",),
    "model": ("learner", "rollout", "scorer"),
}
# Dotted key (without its section's readers) -> who reads it.
KEY_READERS: dict[str, tuple[str, ...]] = {
    "run_dir": ("learner", "up", "eval"),
    "retriever.url": ("rollout", "eval", "up"),
    "retriever.topk": ("retriever", "rollout", "eval"),
    "retriever.timeout_s": ("rollout", "eval"),
    "retriever.retries": ("rollout",),
    "retriever.index_dir": ("retriever", "up", "eval"),
    "retriever.host": ("retriever", "up"),
    "retriever.port": ("retriever", "up"),
    "retriever.max_query_chars": ("retriever", "rollout"),
    "retriever.query_dtype": ("retriever", "eval"),
    "rollout.engine": ("rollout", "eval"),
    "rollout.dtype": ("rollout", "eval"),
    "rollout.max_turns": ("rollout", "eval"),
    "rollout.max_tokens_per_turn": ("rollout", "eval"),
    "rollout.max_obs_length": ("rollout", "eval"),
    "rollout.max_response_length": ("rollout", "learner", "eval"),
    "rollout.max_prompt_length": ("rollout", "eval"),
    "rollout.protocol": ("rollout", "scorer", "eval", "data"),
    "rollout.stop_strings": ("rollout", "eval"),
    "rollout.tools": ("rollout", "scorer"),
    "rollout.gpu_memory_utilization": ("rollout", "eval"),
    "rollout.kv_cache_gib": ("rollout", "eval"),
    "rollout.tensor_parallel_size": ("rollout", "eval"),
    "rollout.enforce_eager": ("rollout", "eval"),
    "rollout.enable_prefix_caching": ("rollout", "eval"),
    "rollout.max_model_len": ("rollout", "eval"),
    "rollout.vllm_engine_args": ("rollout", "eval"),
    "scorer.rewards": ("scorer", "learner"),
    "scorer.port": ("scorer", "up"),
    "scorer.metrics_port": ("scorer", "up"),
    "learner.total_steps": ("learner", "up"),
    "learner.checkpoint_dir": ("learner", "eval"),
    "learner.weight_sync_host": ("rollout",),
    "learner.weight_sync_port": ("learner", "rollout", "up"),
    "learner.weight_sync_token": ("learner", "rollout"),
    "learner.weight_sync_tls_ca_file": ("learner", "rollout"),
    "learner.metrics_port": ("learner", "up"),
    "learner.lora.publish": ("learner", "rollout"),
    "learner.eval_max_questions": ("learner", "eval"),
    "learner.eval_temperature": ("learner", "eval"),
    "probe.overconf_coeff": ("learner",),
    "probe.evidence.coeff": ("learner",),
    "data.n_samples": ("learner", "rollout"),
    "data.test_files": ("learner", "eval"),
    "data.max_test_items": ("learner", "eval"),
    "data.synth_size": ("data",),
    "data.synth_hard": ("data",),
    "data.sft_mix": ("data",),
    "data.sft_topk": ("data",),
    "model.path": ("learner", "rollout", "scorer", "eval"),
    "model.dtype": (),
    "model.gradient_checkpointing": ("learner",),
    "model.max_length": ("learner",),
    "model.init_preset": ("data",),
    "model.init_seed": ("data",),
    "model.init_vocab_size": ("data",),
}
# Maps whose keys another package types and documents (services/common/config/subsections.py).
DOCUMENTED_ELSEWHERE: dict[str, str] = {
    "learner.algorithm": "every key: [algorithms.md](algorithms.md#estimator-options-learneralgorithm)",
}
_SKIPPED_COMMENTS = re.compile(r"^(type:|noqa|pragma|---)")


@dataclass(frozen=True)
class Row:
    """One documented key: `rollout.mcp_servers[].name`, its type, default, readers, meaning."""

    key: str
    type: str
    default: str
    readers: tuple[str, ...]
    meaning: str


def readers_of(key: str) -> tuple[str, ...]:
    """Who reads `key`: the nearest declared key (a nested key inherits its parent's), else
    its section's readers."""
    plain = re.sub(r"\[\]|\.<[^>]+>", "", key)
    if plain != key and plain not in KEY_READERS:  # an item of a list or map: its section's
        return READERS[plain.split(".")[0]]
    parts = plain.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in KEY_READERS:
            return KEY_READERS[".".join(parts[:end])]
    return READERS[parts[0] if len(parts) > 1 else ""]


def rows(model: type[BaseModel], prefix: str = "") -> Iterator[Row]:
    """Every key of `model`, depth first in declaration order; a nested section's keys follow
    the key that holds it, with `[]` for list items and `.<name>` for a map's keys."""
    comments = inherited_comments(model)
    for name, field in model.model_fields.items():
        key = prefix + name
        child, container = _section_inside(field.annotation)
        note = comments.get(name, "") or (class_summary(child) if child else "")
        yield Row(key, type_text(field), default_text(field), readers_of(key),
                  meaning(field, note, key))
        if child is not None:
            yield from rows(child, key + container + ".")


def inherited_comments(model: type[BaseModel]) -> dict[str, str]:
    """`field_comments` of the model and of the sections it extends (a field keeps the comment
    of the class that declares it)."""
    found: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if isinstance(cls, type) and issubclass(cls, BaseModel) and cls is not BaseModel:
            found.update({k: v for k, v in field_comments(cls).items() if v})
    return found


def class_summary(model: type[BaseModel]) -> str:
    """The first sentence of a section class's own docstring ('' when it has none)."""
    doc = model.__dict__.get("__doc__")
    return first_sentence(inspect.cleandoc(doc)) if doc else ""


def _section_inside(annotation: Any) -> tuple[type[BaseModel] | None, str | None]:
    """(the model a field holds, how: "" itself, "[]" in a list, ".<source>[]" in a map of
    lists, ".<name>" in a map), or (None, None)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is list:
        for arg in _union_members(args[0]):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg, "[]"
    if origin is dict:
        inner, how = _section_inside(args[1])
        if inner is not None:
            return inner, ".<name>" + (how or "")
    return None, None


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def type_text(field: FieldInfo) -> str:
    """The field's type as a reader writes it, with its bounds: `int ≥ 1`, `"a" | "b"`."""
    text = _annotation_text(field.annotation)
    bounds = []
    for item in field.metadata:
        for kind, attr, sign in ((Ge, "ge", "≥"), (Gt, "gt", ">"), (Le, "le", "≤"),
                                 (Lt, "lt", "<")):
            if isinstance(item, kind):
                bounds.append(f"{sign} {_number(getattr(item, attr))}")
        if isinstance(item, MinLen):
            bounds.append(f"length ≥ {item.min_length}")
        if isinstance(item, MaxLen):
            bounds.append(f"length ≤ {item.max_length}")
    pattern = next((getattr(m, "pattern", None) for m in field.metadata
                    if getattr(m, "pattern", None)), None)
    if pattern:
        choices = re.fullmatch(r"\^\(([\w|]+)\)\$", pattern)
        text = " | ".join(f'"{c}"' for c in choices.group(1).split("|")) if choices else text
    return text + (" " + ", ".join(bounds) if bounds else "")


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _annotation_text(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_annotation_text(a) for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join(_annotation_text(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "map"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    """The default as YAML would spell it (JSON for compound values)."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(the keys below)"
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value, ensure_ascii=False)


def meaning(field: FieldInfo, comment: str, key: str) -> str:
    """The field's description, else the first sentence of its comment."""
    if key in DOCUMENTED_ELSEWHERE:
        return DOCUMENTED_ELSEWHERE[key]
    text = first_sentence(field.description or comment)
    return text[:1].upper() + text[1:]


def first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (not `e.g.`, `i.e.`, a decimal point or
    a dotted key)."""
    text = " ".join(text.split())
    match = re.search(r"(?<!\be\.g)(?<!\bi\.e)(?<!\betc)\.(?=\s+[A-Z(`])", text)
    return text[: match.start() + 1] if match else text


@cache
def field_comments(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> its comment in the class source: the comment on the field's own lines,
    else the block of comment lines right above it (a blank line or code ends a block)."""
    try:
        source = textwrap.dedent(inspect.getsource(model))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    found: dict[str, str] = {}
    class_node = ast.parse(source).body[0]
    assert isinstance(class_node, ast.ClassDef)
    for node in class_node.body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        start, end = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        own = [_comment_of(lines[i]) for i in range(start, end + 1)]
        own_text = " ".join(c for c in own if c)
        above: list[str] = []
        index = start - 1
        while index >= 0 and lines[index].strip().startswith("#"):
            above.insert(0, lines[index].strip().lstrip("#").strip())
            index -= 1
        above = [line for line in above if not _SKIPPED_COMMENTS.match(line)]
        found[node.target.id] = own_text or " ".join(above)
    return found


def _comment_of(line: str) -> str:
    """The comment at the end of a code line ('' when none, or a type/noqa pragma)."""
    in_string: str | None = None
    for index, char in enumerate(line):
        if in_string:
            if char == in_string:
                in_string = None
        elif char in "\"'":
            in_string = char
        elif char == "#":
            comment = line[index + 1:].strip()
            return "" if _SKIPPED_COMMENTS.match(comment) else comment
    return ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(config_model: type[BaseModel]) -> str:
    """docs/config.md for `config_model` (RunConfig)."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `forage config reference` from services/common/config/*.py; do not "
        "edit. tests/common/test_config_reference.py fails when this page is out of date. -->",
        "",
        "Every key of a run config: its type (with its bounds), default, the services that read "
        "it and what it means, generated from the config classes in `services/common/config/`. "
        "How files merge and `--set` overrides apply: "
        "[launch.md](launch.md#config-files-and-overrides); "
        "`forage config show --config FILE` prints what a run will read. How the services fit "
        "together: [architecture.md](architecture.md).",
        "",
        "Readers: " + "; ".join(f"**{label}**: {command}" for label, command
                                in READER_COMMANDS.items()) + ".",
        "",
    ]
    top = [(name, field) for name, field in config_model.model_fields.items()
           if _section_inside(field.annotation)[0] is None]
    out += ["## Top level", "", *_table_head()]
    comments = field_comments(config_model)
    for name, field in top:
        out.append(_table_row(Row(name, type_text(field), default_text(field), readers_of(name),
                                  meaning(field, comments.get(name, ""), name))))
    for name, field in config_model.model_fields.items():
        section, _ = _section_inside(field.annotation)
        if section is None:
            continue
        out += ["", f"## `{name}`", ""]
        summary = class_summary(section)
        if summary:
            out += [summary, ""]
        out += _table_head()
        out += [_table_row(row) for row in rows(section, name + ".")]
    return "\n".join(out) + "\n"


def _table_head() -> list[str]:
    return ["| key | type | default | read by | meaning |", "|---|---|---|---|---|"]


def _table_row(row: Row) -> str:
    readers = ", ".join(row.readers) or "none"
    return (f"| `{row.key}` | {_cell(row.type)} | `{_cell(row.default)}` | {readers} | "
            f"{_cell(row.meaning)} |")
