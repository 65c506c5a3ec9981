"""Score many (data source, text, ground truth) items at once, with isolated reward functions
(math_verify) sent to the worker-process pool and the rest run here.

The stream worker, `POST /score` and `forage score` all score through this class, so a reward
means the same thing everywhere. A reward function that raises makes its item fail with the
error (the service dead-letters it); a timeout scores 0 and is counted.

`isolate_all=True` (what `POST /score` asks for) sends every reward call to the pool: a request
from the network must not hold a server thread for as long as a reward function likes, and a
Python thread cannot be stopped, while a pool worker is killed after `timeout_s` without
progress (the call scores 0 and is counted, as a math_verify timeout is). The stream path runs
the built-in text rewards here (linear in the response, which the rollout bounds) and users'
functions where their `isolated` flag says.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from services.scorer import metrics
from services.scorer.pool import (
    STATUS_OK,
    STATUS_TIMEOUT,
    Job,
    RewardPool,
    on_main_thread,
    shared_pool,
)
from services.scorer.rewards import RewardTimeout
from services.scorer.rewards.registry import Component, RewardTable, combine

log = logging.getLogger("forage.scorer")


@dataclass
class ScoreRequest:
    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict | None = None
    # Probe samples are scored without format credit (docs/architecture.md).
    for_probe: bool = False


@dataclass
class ScoreResult:
    score: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    timeouts: int = 0
    error: str | None = None  # set when the item could not be scored


class Scorer:
    def __init__(self, table: RewardTable | None = None, pool: RewardPool | None = None,
                 inner_timeout_s: int | None = None) -> None:
        self.table = table or RewardTable()
        self.pool = pool
        # math_verify's own (SIGALRM) limit per step, kept under the pool's outer limit.
        self.inner_timeout_s = inner_timeout_s

    @classmethod
    def from_config(cls, section: Any, use_pool: bool = True) -> Scorer:
        """From the `scorer` config section: table overrides, pool size and time limit."""
        table = RewardTable(section.rewards)
        pool = None
        if use_pool:
            pool = RewardPool(num_workers=section.num_workers, timeout_s=section.math_timeout_s)
        inner = max(1, int(section.math_timeout_s // 3))
        return cls(table, pool, inner_timeout_s=inner)

    def start(self) -> Scorer:
        if self.pool is not None:
            self.pool.start()
        return self

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def components(self, data_source: str) -> list[Component]:
        """The reward components of a data source; raises UnknownDataSource."""
        return self.table.components(data_source)

    def _options(self, component: Component, for_probe: bool) -> dict[str, Any]:
        options = component.call_options(for_probe)
        if component.name == "math_verify" and self.inner_timeout_s and "timeout_s" not in options:
            options["timeout_s"] = self.inner_timeout_s
        return options

    def score_many(self, requests: list[ScoreRequest],
                   isolate_all: bool = False) -> list[ScoreResult]:
        """One result per request, in order; `isolate_all` runs every reward in the pool."""
        plans: list[list[Component] | None] = []
        results = [ScoreResult() for _ in requests]
        for request, result in zip(requests, results, strict=True):
            try:
                plans.append(self.components(request.data_source))
            except KeyError as exc:
                plans.append(None)
                result.error = str(exc)
        values: list[list[Any]] = [[None] * len(p) if p else [] for p in plans]
        # Without a pool of its own, isolated rewards still run in a pool off the main thread
        # (math_verify's SIGALRM limits need the main thread): the shared one.
        pool = self.pool
        if pool is None and (isolate_all or not on_main_thread()) and any(
                isolate_all or c.function.isolated for plan in plans for c in plan or []):
            pool = shared_pool()
        jobs: list[Job] = []
        job_slots: list[tuple[int, int]] = []
        for i, (request, plan) in enumerate(zip(requests, plans, strict=True)):
            for j, component in enumerate(plan or []):
                args = (request.data_source, request.solution_str, request.ground_truth,
                        request.extra_info)
                options = self._options(component, request.for_probe)
                if (isolate_all or component.function.isolated) and pool is not None:
                    jobs.append(Job(component.function.ref, args, options))
                    job_slots.append((i, j))
                    continue
                values[i][j] = self._call_here(component, args, options, results[i])
        if jobs:
            assert pool is not None
            for (i, j), outcome in zip(job_slots, pool.run(jobs), strict=True):
                component = (plans[i] or [])[j]
                if outcome.status == STATUS_OK:
                    values[i][j] = outcome.value
                elif outcome.status == STATUS_TIMEOUT:
                    metrics.TIMEOUTS.labels(component.name).inc()
                    results[i].timeouts += 1
                    values[i][j] = 0.0
                else:
                    metrics.ERRORS.labels(component.name).inc()
                    results[i].error = results[i].error or f"{component.name}: {outcome.error}"
        for plan, value_list, result in zip(plans, values, results, strict=True):
            if plan is None or result.error is not None:
                result.score = math.nan
                continue
            try:
                result.score, result.components = combine(plan, value_list)
            except ValueError as exc:
                result.error = str(exc)
                result.score = math.nan
        return results

    @staticmethod
    def _call_here(component: Component, args: tuple, options: dict[str, Any],
                   result: ScoreResult) -> Any:
        try:
            return component.function.load()(*args, **options)
        except RewardTimeout:
            metrics.TIMEOUTS.labels(component.name).inc()
            result.timeouts += 1
            return 0.0
        except Exception as exc:
            metrics.ERRORS.labels(component.name).inc()
            if result.error is None:
                result.error = f"{component.name}: {type(exc).__name__}: {exc}"
            return None

    def score_texts(self, data_source: str, texts: list[str], ground_truth: Any) -> list[float]:
        """Probe helper (rewards.probe.score_probe's `score_many`): format credit 0."""
        results = self.score_many(
            [ScoreRequest(data_source, text, ground_truth, for_probe=True) for text in texts]
        )
        for result in results:
            if result.error:
                raise ValueError(f"probe sample could not be scored: {result.error}")
        return [result.score for result in results]

    def score_one(self, data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict | None = None, isolate_all: bool = False) -> ScoreResult:
        return self.score_many([ScoreRequest(data_source, solution_str, ground_truth,
                                             extra_info)], isolate_all=isolate_all)[0]
