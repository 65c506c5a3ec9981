"""The advantage-estimator registry: name -> fn(token_level_rewards, response_mask, group_ids,
**options) -> (advantages, returns). Names are verl's `AdvantageEstimator` values."""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.learner.algorithms import advantages as adv
from services.learner.algorithms.bnpo import bnpo

Estimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "gae": adv.gae,
    "grpo": adv.grpo,
    "rloo": adv.rloo,
    "reinforce_plus_plus": adv.reinforce_plus_plus,
    "reinforce_plus_plus_baseline": adv.reinforce_plus_plus_baseline,
    "remax": adv.remax,
    "opo": adv.opo,
    "bnpo": bnpo,
}

# Estimators that read per-row tensors besides the rewards (a critic's values, greedy
# baselines); the stepwise multi-turn modes cannot split those across steps.
NEEDS_ROW_INPUTS: frozenset[str] = frozenset({"gae", "remax"})


def get_adv_estimator_fn(name: str | Estimator) -> Estimator:
    """The estimator for `name` (a callable passes through, for custom estimators)."""
    if callable(name):
        return name
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; known: {known}") from None
