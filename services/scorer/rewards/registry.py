"""Which reward functions score which data source, and how their values combine.

A data source maps to one or more components (function, weight, options). The total is the
weighted sum of the components' values; a function may return None, which is recorded as NaN
and left out of the sum (TRL's rule; when all return None the total is NaN: unscorable), and a
dict, whose "score" is its value and whose other
numeric entries are kept as `name/key` components. Functions are named by registry name
(`qa_em`, `math_verify`, ...), by `module:function` or by verl's file form
`path/to/reward.py:function` (any callable with verl's signature; `load_ref`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common import plugins
from services.common.data_sources import BUILTIN_DATA_SOURCES

FUNCTIONS_MODULE = "services.scorer.rewards.functions"


class UnknownDataSource(KeyError):
    """No reward function is configured for this data source."""

    def __init__(self, data_source: str, known: Iterable[str]) -> None:
        self.data_source = data_source
        known_list = ", ".join(sorted(known))
        super().__init__(f"unknown data source {data_source!r}; known: {known_list}")

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class RewardFunction:
    """A callable reward. `isolated` ones run in the worker-process pool (math_verify);
    `probe_options` are the options that remove format credit when probe samples are scored."""

    name: str
    ref: str  # "module:function", importable in a worker process
    isolated: bool = False
    builtin: bool = False
    probe_options: Mapping[str, Any] = field(default_factory=dict)

    def load(self) -> Callable[..., Any]:
        return load_ref(self.ref)


BUILTIN_FUNCTIONS: dict[str, RewardFunction] = {
    "qa_em": RewardFunction("qa_em", f"{FUNCTIONS_MODULE}:qa_em", builtin=True,
                            probe_options={"format_score": 0.0}),
    "qa_subem": RewardFunction("qa_subem", f"{FUNCTIONS_MODULE}:qa_subem", builtin=True,
                               probe_options={"format_score": 0.0}),
    "qa_f1": RewardFunction("qa_f1", f"{FUNCTIONS_MODULE}:qa_f1", builtin=True),
    "qa_em_format": RewardFunction(
        "qa_em_format", f"{FUNCTIONS_MODULE}:qa_em_format", builtin=True,
        probe_options={"structure_format_score": 0.0, "final_format_score": 0.0,
                       "retrieval_score": 0.0},
    ),
    "countdown": RewardFunction("countdown", f"{FUNCTIONS_MODULE}:countdown", builtin=True,
                                probe_options={"format_score": 0.0}),
    # Probe samples are one "\n#### n" line (docs/probe.md); read flexibly (the last number),
    # so a boxed `probe.suffix` override scores too.
    "gsm8k": RewardFunction("gsm8k", f"{FUNCTIONS_MODULE}:gsm8k", builtin=True,
                            probe_options={"format_score": 0.0, "method": "flexible"}),
    "math_verify": RewardFunction("math_verify", f"{FUNCTIONS_MODULE}:math_verify",
                                  isolated=True, builtin=True),
}


# The table of built-in sources lives in services.common.data_sources, so that `forage data
# check` and the learner can reject a dataset this registry cannot score without importing it.
DEFAULT_DATA_SOURCES: dict[str, str] = dict(BUILTIN_DATA_SOURCES)


def load_ref(ref: str) -> Callable[..., Any]:
    """Import a reward function named `module:function` or `path/to/file.py:function`.

    The module form imports `module` (dots allowed after the colon for attributes); a module
    that is not importable but sits in the working directory (`my_rewards.py` beside the run)
    is found there, so no PYTHONPATH is needed. The file form is verl's
    `custom_reward_function.path` + `.name`: the file is executed as a module of its own,
    relative paths counting from the working directory. Both forms resolve the same way in the
    scorer's worker processes (services/scorer/pool.py). The loader is shared with the
    rollout's user tools (services/common/plugins.py)."""
    return plugins.load_ref(ref, f"reward function {ref!r}", module_prefix="forage_reward_")


def resolve_function(name: str, isolated: bool | None = None) -> RewardFunction:
    """A registry name or a `module:function` reference (checked to import)."""
    if name in BUILTIN_FUNCTIONS:
        function = BUILTIN_FUNCTIONS[name]
    elif ":" in name:
        load_ref(name)
        module_part, _, attr_path = name.rpartition(":")
        ref = name
        if plugins.is_file_ref(module_part):  # pinned: a worker process may not share the cwd
            ref = f"{Path(module_part).expanduser().resolve()}:{attr_path}"
        function = RewardFunction(name=name, ref=ref)
    else:
        raise ValueError(
            f"unknown reward function {name!r}; built-ins: {', '.join(sorted(BUILTIN_FUNCTIONS))}"
            " (or name one as module:function)"
        )
    if isolated is not None and isolated != function.isolated:
        function = RewardFunction(function.name, function.ref, isolated, function.builtin,
                                  function.probe_options)
    return function


@dataclass(frozen=True)
class Component:
    function: RewardFunction
    weight: float = 1.0
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.function.name

    def call_options(self, for_probe: bool) -> dict[str, Any]:
        """Keyword options for the call; only built-ins take them (users' functions keep
        verl's exact signature)."""
        if not self.function.builtin:
            return {}
        options = dict(self.options)
        if for_probe:
            options.update(self.function.probe_options)
        return options


class RewardTable:
    """data_source -> components. `overrides` (config `scorer.rewards`) replace or add sources;
    each value is a list of {function, weight, options, isolated} maps or objects."""

    def __init__(self, overrides: Mapping[str, Iterable[Any]] | None = None) -> None:
        self._table: dict[str, list[Component]] = {
            source: [Component(BUILTIN_FUNCTIONS[name])]
            for source, name in DEFAULT_DATA_SOURCES.items()
        }
        for source, specs in (overrides or {}).items():
            components = [self._component(source, spec) for spec in specs]
            if not components:
                raise ValueError(f"scorer.rewards.{source}: needs at least one function")
            self._table[source] = components

    @staticmethod
    def _component(source: str, spec: Any) -> Component:
        get = spec.get if isinstance(spec, Mapping) else lambda key, default=None: getattr(
            spec, key, default)
        name = get("function")
        if not isinstance(name, str):
            raise ValueError(f"scorer.rewards.{source}: each entry needs a 'function' name")
        try:
            function = resolve_function(name, get("isolated", None))
        except ValueError as exc:
            raise ValueError(f"scorer.rewards.{source}: {exc}") from None
        return Component(function, float(get("weight", 1.0)), dict(get("options", None) or {}))

    def known_sources(self) -> list[str]:
        return sorted(self._table)

    def components(self, data_source: str) -> list[Component]:
        try:
            return self._table[data_source]
        except KeyError:
            raise UnknownDataSource(data_source, self._table) from None


def component_values(name: str, value: Any) -> dict[str, float]:
    """A reward function's return value as named numbers: `{name: value, name/key: ...}`."""
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"reward function {name} returned a dict without 'score'")
        values = {name: _number(name, value["score"])}
        for key, item in value.items():
            if key != "score" and isinstance(item, int | float) and not isinstance(item, bool):
                values[f"{name}/{key}"] = float(item)
        return values
    return {name: _number(name, value)}


def _number(name: str, value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if hasattr(value, "item"):  # numpy / torch scalars
        return float(value.item())
    raise ValueError(f"reward function {name} returned {type(value).__name__}, not a number")


def combine(components: list[Component], values: list[Any]) -> tuple[float, dict[str, float]]:
    """Weighted sum over the components' values (NaN ones left out) and every component.

    TRL's GRPOTrainer: None → NaN per function, the row's reward is the weighted nansum, and a
    row for which EVERY function returned None is unscorable: its reward is NaN (not 0), so the
    learner leaves it out of the group baseline and gives it advantage 0."""
    total = 0.0
    scored = False
    recorded: dict[str, float] = {}
    for component, value in zip(components, values, strict=True):
        named = component_values(component.name, value)
        recorded.update(named)
        main = named[component.name]
        if not math.isnan(main):
            total += component.weight * main
            scored = True
    return (total if scored else math.nan), recorded
