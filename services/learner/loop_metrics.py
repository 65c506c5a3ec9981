"""Prometheus metrics of the learner's RL loop (docs/architecture.md); names start with forage_learner_.

`forage_stream_lag{stream}` is exported here because the learner is the one process that always
runs: the rollout HPA on Kubernetes scales on `forage_stream_lag{stream="prompts"}`
(deploy/k8s/rollout-hpa.yaml through prometheus-adapter).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
