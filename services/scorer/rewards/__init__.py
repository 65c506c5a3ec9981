"""Reward library: `compute_score(data_source, solution_str, ground_truth, extra_info=None)`
with verl's signature (DESIGN.md 9), so reward functions written for verl plug in.

This entry point runs in the calling process. The scorer service scores through
services.scorer.scoring.Scorer instead, which sends math_verify to a worker-process pool.
"""

from __future__ import annotations

import logging
from typing import Any

from services.scorer.rewards.math import RewardTimeout
from services.scorer.rewards.registry import (
    BUILTIN_FUNCTIONS,
    DEFAULT_DATA_SOURCES,
    Component,
    RewardTable,
    UnknownDataSource,
    combine,
)

__all__ = [
    "BUILTIN_FUNCTIONS",
    "DEFAULT_DATA_SOURCES",
    "RewardTable",
    "RewardTimeout",
    "UnknownDataSource",
    "call_component",
    "compute_score",
    "default_table",
]

log = logging.getLogger("forage.scorer.rewards")
_default_table: RewardTable | None = None


def default_table() -> RewardTable:
    global _default_table
    if _default_table is None:
        _default_table = RewardTable()
    return _default_table


def call_component(component: Component, data_source: str, solution_str: str,
                   ground_truth: Any, extra_info: dict | None, for_probe: bool = False) -> Any:
    """Call one reward function in this process; a timeout scores 0 and is counted."""
    from services.scorer import metrics

    function = component.function.load()
    try:
        return function(data_source, solution_str, ground_truth, extra_info,
                        **component.call_options(for_probe))
    except RewardTimeout as exc:
        metrics.TIMEOUTS.labels(component.name).inc()
        log.warning("%s timed out (%s): scored 0", component.name, exc)
        return 0.0


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict | None = None, table: RewardTable | None = None
                  ) -> float | dict[str, float]:
    """The reward of one response: a float for a single plain reward function, else a dict
    with "score" (the weighted total) and every component."""
    components = (table or default_table()).components(data_source)
    values = [call_component(c, data_source, solution_str, ground_truth, extra_info)
              for c in components]
    total, recorded = combine(components, values)
    if len(recorded) == 1:
        return total
    return {"score": total, **recorded}
