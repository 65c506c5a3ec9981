"""The advantage-estimator registry: name -> fn(token_level_rewards, response_mask, group_ids,
**options) -> (advantages, returns). Names are verl 0.9.1's `AdvantageEstimator` values (plus
`bnpo`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from services.learner.algorithms import advantages as adv
from services.learner.algorithms import group_variants as gv
from services.learner.algorithms import token_baselines as tb
from services.learner.algorithms.bnpo import bnpo

Estimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "gae": adv.gae,
    "grpo": adv.grpo,
    # verl's vectorised GRPO: the same numbers (singleton mean 0, std 1; statistics in float32
    # there), so the same function.
    "grpo_vectorized": adv.grpo,
    "grpo_passk": gv.grpo_passk,
    "gpg": gv.gpg,
    "gdpo": gv.gdpo,
    "rloo": adv.rloo,
    # verl's vectorised RLOO differs in one place: a singleton group gets 0, not its reward.
    "rloo_vectorized": partial(adv.rloo, singleton="zero"),
    "reinforce_plus_plus": adv.reinforce_plus_plus,
    "reinforce_plus_plus_baseline": adv.reinforce_plus_plus_baseline,
    "remax": adv.remax,
    "opo": adv.opo,
    "optimal_token_baseline": tb.optimal_token_baseline,
    "tir_optimal_token_baseline": tb.tir_optimal_token_baseline,
    "bnpo": bnpo,
}

# Estimators that read per-row tensors besides the rewards (a critic's values, greedy
# baselines, per-component rewards, per-token policy statistics); the stepwise multi-turn modes
# cannot split those across steps.
NEEDS_ROW_INPUTS: frozenset[str] = frozenset(
    {"gae", "remax", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline"}
)
# Estimators whose inputs include the policy's log-probs and sum of squared probabilities
# (computed in the learner's old-log-prob pass).
NEEDS_POLICY_STATS: frozenset[str] = frozenset(
    {"optimal_token_baseline", "tir_optimal_token_baseline"}
)


def get_adv_estimator_fn(name: str | Estimator) -> Estimator:
    """The estimator for `name` (a callable passes through, for custom estimators)."""
    if callable(name):
        return name
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; known: {known}") from None
