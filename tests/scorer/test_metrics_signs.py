"""The scorer's reward metrics accept any real reward: negative sums used to raise in the worker
(a prometheus Counter refuses to decrease) after the batch was published."""

from __future__ import annotations

import math

from prometheus_client import REGISTRY

from services.scorer import metrics
from services.scorer.worker import ScorerWorker


def _value(name: str, source: str) -> float:
    value = REGISTRY.get_sample_value(name, {"data_source": source})
    return 0.0 if value is None else value


def test_negative_rewards_and_nan_rows_are_recorded_without_error() -> None:
    source = "test_metrics_signs"
    before_sum = _value("forage_scorer_reward_sum", source)
    before_scored = _value("forage_scorer_scored_total", source)
    before_items = _value("forage_scorer_items_total", source)
    ScorerWorker._observe({source: [-1.0, -0.5, math.nan, 0.25]}, [], 4, 0.1)
    assert math.isclose(_value("forage_scorer_reward_sum", source) - before_sum, -1.25)
    assert _value("forage_scorer_scored_total", source) - before_scored == 3
    assert _value("forage_scorer_items_total", source) - before_items == 4
    assert math.isclose(REGISTRY.get_sample_value("forage_scorer_reward_mean",
                                                  {"data_source": source}), -1.25 / 3)
    assert metrics.REWARD_SUM is not None
