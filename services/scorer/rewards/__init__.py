"""Reward library: `compute_score(data_source, solution_str, ground_truth, extra_info=None)`
with verl's signature (docs/architecture.md), so reward functions written for verl plug in.

This entry point runs in the calling process, from any thread: math_verify (and any reward
marked `isolated`) runs here on the main thread, and in a shared worker-process pool
(services.scorer.pool.shared_pool) on any other thread, since its SIGALRM limits work only on
the main thread. The scorer service scores through services.scorer.scoring.Scorer instead,
which sends isolated rewards to its own pool.
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
    """Call one reward function; a timeout scores 0 and is counted, an error raises.

    An isolated function called off the main thread runs in the shared process pool (bounded
    by its wall-clock limit, killable), so the caller's threading never changes the score."""
    from services.scorer import metrics
    from services.scorer.pool import on_main_thread

    options = component.call_options(for_probe)
    args = (data_source, solution_str, ground_truth, extra_info)
    if component.function.isolated and not on_main_thread():
        return _call_in_pool(component, args, options)
    function = component.function.load()
    try:
        return function(*args, **options)
    except RewardTimeout as exc:
        metrics.TIMEOUTS.labels(component.name).inc()
        log.warning("%s timed out (%s): scored 0", component.name, exc)
        return 0.0


def _call_in_pool(component: Component, args: tuple, options: dict[str, Any]) -> Any:
    from services.scorer import metrics
    from services.scorer.pool import STATUS_OK, STATUS_TIMEOUT, Job, RewardFailed, shared_pool

    outcome = shared_pool().run([Job(component.function.ref, args, options)])[0]
    if outcome.status == STATUS_OK:
        return outcome.value
    if outcome.status == STATUS_TIMEOUT:
        metrics.TIMEOUTS.labels(component.name).inc()
        log.warning("%s timed out (%s): scored 0", component.name, outcome.error)
        return 0.0
    metrics.ERRORS.labels(component.name).inc()
    raise RewardFailed(f"{component.name}: {outcome.error}")


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
