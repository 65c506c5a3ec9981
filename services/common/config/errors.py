"""Config error messages: the key, what is wrong, where the value came from, and a suggestion.

One problem reads as one line, e.g.
`invalid config: learner.lrr: unknown key (did you mean learner.lr?); in configs/run.yaml`;
several read as a header and one indented line each. The suggestion is a close spelling in the
same section (difflib), unless the same key name exists in another section (`learner.n_samples` ->
`data.n_samples`, `learner.clip_ratio_high` -> `learner.algorithm.clip_ratio_high`), which is
the mistake users coming from verl's differently nested config make most.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from services.common.config.layers import Key, Layered


def describe_problems(problems: Sequence[str]) -> str:
    if len(problems) == 1:
        return f"invalid config: {problems[0]}"
    return "\n".join([f"invalid config ({len(problems)} problems):",
                      *(f"  {line}" for line in problems)])


def validation_problems(
    exc: ValidationError,
    model: type[BaseModel],
    layered: Layered,
    prefix: Key = (),
    elsewhere: Iterable[tuple[Key, type[BaseModel]]] = (),
) -> list[str]:
    """One line per pydantic error. `prefix` is where `model` sits in the run config (for a
    sub-section validated on its own, e.g. learner.algorithm); `elsewhere` lists other models
    (and where they sit) whose keys a misplaced key may belong to."""
    lines = []
    for error in exc.errors():
        rel = tuple(str(part) for part in error["loc"])
        loc = (*prefix, *rel)
        key = ".".join(loc) or "<root>"
        if error["type"] == "extra_forbidden":
            hint = suggest_key(model, rel, prefix, elsewhere)
            what = "unknown key" + (f" ({hint})" if hint else "")
        else:
            what = f"{error['msg']} (got {_short(error.get('input'))})"
        lines.append(f"{key}: {what}; {source_label(layered.source_of(loc))}")
    return lines


def source_label(source: str) -> str:
    """`in FILE`, `on the command line: a.b=c`, `from the environment: REDIS_URL`."""
    parts = []
    for one in source.split(" and "):
        if one.startswith("the command line ("):
            parts.append(f"on the command line: {one[len('the command line ('):-1]}")
        elif one.startswith("the environment ("):
            parts.append(f"from the environment: {one[len('the environment ('):-1]}")
        elif one == "<defaults>":
            parts.append("in the defaults")
        else:
            parts.append(f"in {one}")
    return " and ".join(parts)


def suggest_key(model: type[BaseModel], rel: Key, prefix: Key = (),
                elsewhere: Iterable[tuple[Key, type[BaseModel]]] = ()) -> str | None:
    """'it is x.y' when a key of exactly that name exists in another section (the likelier
    mistake), else 'did you mean a.b?' for a close spelling in the same section."""
    if not rel:
        return None
    parent, name = rel[:-1], rel[-1]
    homes = [".".join((*where, name)) for where, section in
             [*sections_of(model, prefix), *elsewhere]
             if name in section.model_fields and (*where,) != (*prefix, *parent)]
    if homes:
        return f"it is {' or '.join(homes)}"
    fields = fields_at(model, parent)
    if fields:
        close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
        if close:
            return f"did you mean {'.'.join((*prefix, *parent, close[0]))}?"
    return None


def fields_at(model: type[BaseModel], path: Key) -> list[str] | None:
    """The field names of the section at `path` inside `model`, or None when it is not one."""
    current: type[BaseModel] = model
    for part in path:
        info = current.model_fields.get(part)
        section = _model_of(info.annotation) if info is not None else None
        if section is None:
            return None
        current = section
    return list(current.model_fields)


def sections_of(model: type[BaseModel], prefix: Key) -> list[tuple[Key, type[BaseModel]]]:
    """Every (path, model) of `model` and its nested sections."""
    found: list[tuple[Key, type[BaseModel]]] = [(prefix, model)]
    for name, info in model.model_fields.items():
        section = _model_of(info.annotation)
        if section is not None:
            found.extend(sections_of(section, (*prefix, name)))
    return found


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):  # Optional[Section]
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
