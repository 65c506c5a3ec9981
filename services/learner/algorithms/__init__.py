"""RL algorithms for the learner as pure tensor functions (DESIGN.md 6, 9; docs/algorithms.md).

`ADVANTAGE_ESTIMATORS[name](token_level_rewards, response_mask, group_ids, **options)` ->
`(advantages, returns)` over `(batch, T)` tensors; trajectory-level rewards sit on the last
response token (verl's convention). Names and defaults follow verl; options select the TRL or
rllm variant where they differ.
"""

from services.learner.algorithms.advantages import (
    gae,
    grpo,
    opo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)
from services.learner.algorithms.aggregation import LOSS_AGG_MODES, agg_loss
from services.learner.algorithms.bnpo import BNPOState, bnpo
from services.learner.algorithms.config import AlgorithmSettings
from services.learner.algorithms.filters import filter_groups
from services.learner.algorithms.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)
from services.learner.algorithms.masked import masked_mean, masked_var, masked_whiten
from services.learner.algorithms.multi_turn import (
    MULTI_TURN_MODES,
    compute_advantage,
    count_step_rows,
    step_index_row,
    step_regions,
    step_rows,
    stepwise_broadcast,
    stepwise_per_step,
)
from services.learner.algorithms.policy_loss import entropy_from_logits, policy_loss
from services.learner.algorithms.registry import ADVANTAGE_ESTIMATORS, get_adv_estimator_fn
from services.learner.algorithms.shaping import (
    apply_overconfidence_penalty,
    overconfidence_penalty,
    overconfidence_penalty_metrics,
)
from services.learner.algorithms.value_loss import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "MULTI_TURN_MODES",
    "AdaptiveKLController",
    "AlgorithmSettings",
    "BNPOState",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "apply_overconfidence_penalty",
    "bnpo",
    "compute_advantage",
    "count_step_rows",
    "entropy_from_logits",
    "filter_groups",
    "gae",
    "get_adv_estimator_fn",
    "grpo",
    "kl_penalty",
    "make_kl_controller",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "opo",
    "overconfidence_penalty",
    "overconfidence_penalty_metrics",
    "policy_loss",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "step_index_row",
    "step_regions",
    "step_rows",
    "stepwise_broadcast",
    "stepwise_per_step",
    "value_loss",
]
