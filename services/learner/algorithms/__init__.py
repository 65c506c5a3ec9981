"""RL algorithms for the learner as pure tensor functions (docs/architecture.md; docs/algorithms.md).

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
from services.learner.algorithms.group_variants import gdpo, gpg, grpo_passk
from services.learner.algorithms.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    bias_corrected_kl,
    kl_importance_weight,
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
from services.learner.algorithms.pf_ppo import PF_PPO_METHODS, pf_ppo_resample, pf_ppo_weights
from services.learner.algorithms.policy_loss import entropy_from_logits, policy_loss
from services.learner.algorithms.policy_losses import (
    POLICY_LOSSES,
    LossSettings,
    compute_policy_loss,
    get_policy_loss_fn,
)
from services.learner.algorithms.registry import ADVANTAGE_ESTIMATORS, get_adv_estimator_fn
from services.learner.algorithms.rollout_correction import is_weights as rollout_is_weights
from services.learner.algorithms.rollout_correction import rollout_correction
from services.learner.algorithms.shaping import (
    apply_overconfidence_penalty,
    overconfidence_penalty,
    overconfidence_penalty_metrics,
)
from services.learner.algorithms.token_baselines import (
    optimal_token_baseline,
    tir_optimal_token_baseline,
)
from services.learner.algorithms.token_masks import (
    entropy_threshold,
    high_entropy_mask,
    linear_quantile,
    off_policy_sequence_mask,
)
from services.learner.algorithms.value_loss import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdaptiveKLController",
    "AlgorithmSettings",
    "BNPOState",
    "FixedKLController",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "LossSettings",
    "MULTI_TURN_MODES",
    "PF_PPO_METHODS",
    "POLICY_LOSSES",
    "agg_loss",
    "apply_kl_penalty",
    "apply_overconfidence_penalty",
    "bias_corrected_kl",
    "bnpo",
    "compute_advantage",
    "compute_policy_loss",
    "count_step_rows",
    "entropy_from_logits",
    "entropy_threshold",
    "filter_groups",
    "gae",
    "gdpo",
    "get_adv_estimator_fn",
    "get_policy_loss_fn",
    "gpg",
    "grpo",
    "grpo_passk",
    "high_entropy_mask",
    "kl_importance_weight",
    "kl_penalty",
    "linear_quantile",
    "make_kl_controller",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "off_policy_sequence_mask",
    "opo",
    "optimal_token_baseline",
    "overconfidence_penalty",
    "overconfidence_penalty_metrics",
    "pf_ppo_resample",
    "pf_ppo_weights",
    "policy_loss",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "rollout_correction",
    "rollout_is_weights",
    "step_index_row",
    "step_regions",
    "step_rows",
    "stepwise_broadcast",
    "stepwise_per_step",
    "tir_optimal_token_baseline",
    "value_loss",
]
