"""Prometheus metrics of the learner's RL loop (docs/architecture.md); names start with forage_learner_.

`forage_stream_lag{stream}` is exported here because the learner is the one process that always
runs: the rollout HPA on Kubernetes scales on `forage_stream_lag{stream="prompts"}`
(deploy/k8s/rollout-hpa.yaml through prometheus-adapter).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from services.common.retrieval_health import LATENCIES, PREFIX, RATES

STEP = Gauge("forage_learner_step", "RL steps completed")
POLICY_VERSION = Gauge("forage_learner_policy_version", "Newest published policy version")
REWARD_MEAN = Gauge("forage_learner_reward_mean", "Mean reward of the last batch", ["data_source"])
EM_MEAN = Gauge("forage_learner_em_mean", "Fraction of the last batch with reward >= 1")
EVAL_EM = Gauge("forage_learner_eval_em", "Exact match of the last greedy evaluation")
STALENESS_MEAN = Gauge("forage_learner_staleness_mean",
                       "Mean policy-version lag of the last batch's trajectories")
STEP_SECONDS = Histogram(
    "forage_learner_step_seconds", "Wall time of one RL step (wait + compute + publish)",
    buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
PHASE_SECONDS = Gauge("forage_learner_phase_seconds", "Time of each phase of the last step",
                      ["phase"])
GROUPS = Counter("forage_learner_groups", "Prompt-group events", ["outcome"])
TRAJECTORIES = Counter("forage_learner_trajectories", "Scored trajectories received by outcome",
                       ["outcome"])
IN_FLIGHT = Gauge("forage_learner_groups_in_flight", "Groups issued and not yet trained")
STREAM_LAG = Gauge("forage_stream_lag", "Entries not yet acked by the stream's consumer group",
                   ["stream"])
TOKENS_PER_SECOND = Gauge("forage_learner_tokens_per_second", "Trained tokens/s of the last step")

# Retrieval health of the last step (services/common/retrieval_health.py; docs/learner.md):
# one gauge per rate and one for the latency percentiles, by data source ("all": every source).
# Names written out: the dashboard test finds exported metrics by reading these calls.
RETRIEVAL_RATES = {
    "gold_hit_rate": Gauge("forage_learner_retrieval_gold_hit_rate",
                           "Share of the last step's searching trajectories with a gold answer "
                           "in a retrieved passage", ["data_source"]),
    "empty_rate": Gauge("forage_learner_retrieval_empty_rate",
                        "Share of the last step's search turns with no or only empty passages",
                        ["data_source"]),
    "repeated_passage_rate": Gauge("forage_learner_retrieval_repeated_passage_rate",
                                   "Share of the last step's passages an earlier turn of the "
                                   "same trajectory returned", ["data_source"]),
    "repeated_query_rate": Gauge("forage_learner_retrieval_repeated_query_rate",
                                 "Share of the last step's search turns repeating an earlier "
                                 "query of the same trajectory", ["data_source"]),
    "cache_hit_rate": Gauge("forage_learner_retrieval_cache_hit_rate",
                            "Share of the last step's search turns answered by the retrieval "
                            "cache", ["data_source"]),
}
assert set(RETRIEVAL_RATES) == set(RATES)
RETRIEVAL_LATENCY_MS = Gauge(
    "forage_learner_retrieval_latency_ms",
    "Retrieval latency per search turn of the last step, in ms, by percentile",
    ["data_source", "quantile"],
)
_QUANTILES = {"latency_p50_ms": "0.5", "latency_p99_ms": "0.99"}
assert set(_QUANTILES) == set(LATENCIES)


def export_retrieval(record: Mapping[str, Any]) -> None:
    """Set the retrieval gauges from a metrics line's `retrieval/...` keys. A source (or the
    whole step) without search results this step keeps its last values, as other gauges do."""
    for key, value in record.items():
        if not key.startswith(PREFIX):
            continue
        name, _, source = key[len(PREFIX):].partition("/")
        source = source or "all"
        if name in RETRIEVAL_RATES:
            RETRIEVAL_RATES[name].labels(source).set(float(value))
        elif name in _QUANTILES:
            RETRIEVAL_LATENCY_MS.labels(source, _QUANTILES[name]).set(float(value))
