"""Free-form config maps that a service package types, checked when the config is loaded.

`learner.algorithm` is a plain dict in the learner section: its keys belong to
services.learner.algorithms (`AlgorithmSettings`), which imports torch and must not be imported
by services/common (services/common imports no service). Left at that, a typo such as
`learner.algorithm.polcy_loss` would pass `forage up` and every other service and fail only when
the learner started, minutes later. So the composition root — the `forage` command,
services/cli.py, which already names every service's module — registers here, by name, the
pydantic model that types such a map; `load_config` validates the map against it when the map
is not empty. The model is imported only then (an empty map is valid by construction), so a
command whose config leaves the map empty pays no import. A library caller that never
registers gets the old behaviour: the service validates when it starts.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from services.common.config.errors import validation_problems
from services.common.config.layers import Key, Layered

# key path -> "module:Model"
_REGISTERED: dict[Key, str] = {}


def register_subsection(dotted: str, model_ref: str) -> None:
    """Type the map at `dotted` (e.g. "learner.algorithm") with the pydantic model named by
    `model_ref` ("package.module:Model"), imported lazily."""
    if ":" not in model_ref:
        raise ValueError(f"model_ref {model_ref!r} must look like 'module:Model'")
    _REGISTERED[tuple(dotted.split("."))] = model_ref


def registered_subsections() -> dict[str, str]:
    return {".".join(key): ref for key, ref in _REGISTERED.items()}


def _load_model(ref: str) -> type[BaseModel] | None:
    module_name, _, attr = ref.partition(":")
    try:
        model = getattr(importlib.import_module(module_name), attr)
    except ImportError:
        return None  # that service is not installed here: it validates when it starts
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _get(raw: Mapping[str, Any], path: Key) -> Any:
    node: Any = raw
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def subsection_problems(
    layered: Layered, elsewhere: Iterable[tuple[Key, type[BaseModel]]] = ()
) -> list[str]:
    """Error lines for every registered map the config sets that its model rejects;
    `elsewhere` (the run config's sections) lets a misplaced key name its real home."""
    problems: list[str] = []
    for path, ref in _REGISTERED.items():
        value = _get(layered.raw, path)
        if not isinstance(value, Mapping) or not value:
            continue
        model = _load_model(ref)
        if model is None:
            continue
        try:
            model.model_validate(dict(value))
        except ValidationError as exc:
            problems.extend(validation_problems(exc, model, layered, prefix=path,
                                                elsewhere=elsewhere))
    return problems


def subsection_models() -> list[tuple[Key, type[BaseModel]]]:
    """The registered models that are importable (for 'it is learner.algorithm.x' hints)."""
    found = []
    for path, ref in _REGISTERED.items():
        model = _load_model(ref)
        if model is not None:
            found.append((path, model))
    return found
