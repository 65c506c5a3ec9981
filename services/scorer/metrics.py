"""The scorer's Prometheus metrics (docs/architecture.md); exposed by services.common.metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ITEMS = Counter("forage_scorer_items_total", "Trajectories scored", ["data_source"])
# Scored rows only (an unscorable NaN row is not a reward): the mean over a window is
# delta(reward_sum) / increase(scored). A Gauge, not a Counter: rewards can be negative (format
# penalties, custom functions), and a Counter refuses to go down (it raised in the worker).
SCORED = Counter("forage_scorer_scored_total", "Trajectories with a (non-NaN) reward",
                 ["data_source"])
REWARD_SUM = Gauge("forage_scorer_reward_sum", "Running sum of rewards given (may decrease)",
                   ["data_source"])
REWARD_MEAN = Gauge("forage_scorer_reward_mean", "Mean reward of the last batch",
                    ["data_source"])
ITEMS_PER_SECOND = Gauge("forage_scorer_items_per_second",
                         "Trajectories scored per second over the last batch")
TIMEOUTS = Counter("forage_scorer_timeouts_total",
                   "Reward calls that ran out of time (scored 0)", ["function"])
ERRORS = Counter("forage_scorer_errors_total", "Reward calls that raised", ["function"])
DEAD_LETTERS = Counter("forage_scorer_dead_letters_total", "Records sent to the dead-letter "
                       "stream", ["reason"])
WORKER_RESTARTS = Counter("forage_scorer_pool_restarts_total",
                          "Pool worker processes killed (hung) or died and replaced")
BATCH_SECONDS = Histogram("forage_scorer_batch_seconds", "Wall time to score one batch")
PROBE_OVERCONF = Gauge("forage_scorer_probe_overconf", "Mean probe overconfidence of the last "
                       "batch")
PROBE_AUC = Gauge("forage_scorer_probe_auc", "Mean probe AUC of the last batch")
