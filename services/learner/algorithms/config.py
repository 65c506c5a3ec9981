"""`learner.algorithm.*`: the typed view of the free-form algorithm dict in the learner config.

The learner section keeps `algorithm` as a plain dict (so this package owns its keys); this model
validates it with errors that name the bad key, and turns it into the keyword arguments of the
functions in this package, so config keys and function options cannot drift apart.
Every key is documented in docs/algorithms.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from services.common.config.base import Section
from services.learner.algorithms.aggregation import LOSS_AGG_MODES
from services.learner.algorithms.bnpo import BNPOState
from services.learner.algorithms.kl import KL_KINDS, KLController, make_kl_controller


class AlgorithmSettings(Section):
    # --- advantage estimation (the estimator itself is `learner.adv_estimator`) ---
    norm_adv_by_std: bool = True  # grpo: False = Dr. GRPO
    epsilon: float = Field(default=1e-6, ge=0)  # grpo std epsilon (TRL: 1e-4)
    unbiased_std: bool = True  # grpo: False = rllm's np.std
    std_scope: Literal["group", "batch"] = "group"  # grpo: TRL scale_rewards
    singleton: Literal["raw", "zero"] = "raw"  # grpo/rloo/rf++ baseline groups of one
    gamma: float = Field(default=1.0, ge=0, le=1)  # gae, reinforce_plus_plus
    lam: float = Field(default=1.0, ge=0, le=1)  # gae
    gae_whiten: bool = True
    rf_baseline_normalize: Literal["token_whiten", "seq_std"] = "token_whiten"
    rf_gap_mode: Literal["carry", "reset"] = "carry"
    bnpo_window: int = Field(default=512, ge=0)  # groups in the online Beta fit; 0 = batch only
    bnpo_min_value: float = 0.0
    bnpo_max_value: float = 1.0
    bnpo_weight_cap: float = Field(default=1e6, gt=0)
    # --- multi-turn credit ---
    multi_turn: Literal["trajectory", "broadcast", "per_step"] = "trajectory"
    # per_step discount: rllm's AgentExecutionEngine(gamma=0.2), the value its per-step MC
    # returns are computed with (rllm/engine/agent_execution_engine.py before 6d5c2c59).
    step_gamma: float = Field(default=0.2, ge=0, le=1)
    normalize_by_steps: bool = False
    broadcast_group_by: Literal["prompt", "prompt_and_steps"] = "prompt"
    # Rows of the loss aggregation: "trajectory" (one row per trajectory) or "step" (rllm: each
    # step is its own row, so seq-mean modes average over steps). None: "step" in the stepwise
    # modes (broadcast, per_step), which are rllm's, else "trajectory".
    loss_rows: Literal["trajectory", "step"] | None = None
    # --- policy loss ---
    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = Field(default=0.2, ge=0, lt=1)
    clip_ratio_high: float = Field(default=0.2, ge=0)
    clip_ratio_c: float | None = Field(default=3.0, gt=1)  # None: no dual clip
    ratio_kind: Literal["token", "sequence"] = "token"  # sequence = GSPO
    log_ratio_clamp: float | None = Field(default=20.0, gt=0)  # None: no clamp (TRL)
    tis_cap: float | None = Field(default=None, gt=0)  # None: no truncated IS
    max_response_len: int | None = Field(default=None, ge=1)  # seq-mean-token-sum-norm divisor
    entropy_coeff: float = 0.0
    # --- KL to the reference policy ---
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(default=0.001, ge=0)
    target_kl: float = Field(default=0.1, gt=0)
    horizon: int = Field(default=10000, ge=1)
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(default=0.001, ge=0)
    kl_loss_type: str = "low_var_kl"
    kl_clamp: bool = True  # k3 clamps (verl); False = TRL's unclamped k3
    # --- critic (gae) ---
    cliprange_value: float = Field(default=0.5, gt=0)
    # --- group filter (DAPO dynamic sampling) ---
    filter_groups: bool = False
    filter_keep_singletons: bool = True

    @field_validator("loss_agg_mode")
    @classmethod
    def _agg_mode(cls, value: str) -> str:
        if value not in LOSS_AGG_MODES:
            raise ValueError(f"must be one of {', '.join(LOSS_AGG_MODES)}")
        return value

    @field_validator("kl_penalty", "kl_loss_type")
    @classmethod
    def _kl_kind(cls, value: str) -> str:
        if value.rstrip("+") not in KL_KINDS:
            raise ValueError(f"must be one of {', '.join(KL_KINDS)} (optionally with '+')")
        return value

    def estimator_options(self, name: str, bnpo_state: BNPOState | None = None) -> dict[str, Any]:
        """Keyword options of estimator `name` (per-row inputs such as values are the caller's)."""
        if name == "grpo":
            return {
                "epsilon": self.epsilon,
                "norm_adv_by_std": self.norm_adv_by_std,
                "unbiased_std": self.unbiased_std,
                "std_scope": self.std_scope,
                "singleton": self.singleton,
            }
        if name == "rloo":
            return {"singleton": self.singleton}
        if name == "reinforce_plus_plus_baseline":
            return {
                "normalize": self.rf_baseline_normalize,
                "epsilon": self.epsilon,
                "singleton": self.singleton,
            }
        if name == "reinforce_plus_plus":
            return {"gamma": self.gamma, "gap_mode": self.rf_gap_mode}
        if name == "gae":
            return {"gamma": self.gamma, "lam": self.lam, "whiten": self.gae_whiten}
        if name == "bnpo":
            return {
                "state": bnpo_state,
                "min_value": self.bnpo_min_value,
                "max_value": self.bnpo_max_value,
                "weight_cap": self.bnpo_weight_cap,
            }
        return {}  # opo, remax (remax's reward_baselines come from the greedy rollouts)

    def advantage_options(self, name: str, bnpo_state: BNPOState | None = None) -> dict[str, Any]:
        """Keyword arguments of `compute_advantage` for estimator `name`."""
        return {
            "estimator": name,
            "mode": self.multi_turn,
            "step_gamma": self.step_gamma,
            "normalize_by_steps": self.normalize_by_steps,
            "broadcast_group_by": self.broadcast_group_by,
            **self.estimator_options(name, bnpo_state),
        }

    @property
    def step_rows(self) -> bool:
        """Whether the loss aggregates one row per step (rllm) instead of per trajectory."""
        if self.loss_rows is None:
            return self.multi_turn != "trajectory"
        return self.loss_rows == "step"

    def make_bnpo_state(self) -> BNPOState | None:
        return BNPOState(self.bnpo_window) if self.bnpo_window >= 2 else None

    def policy_loss_options(self) -> dict[str, Any]:
        return {
            "loss_agg_mode": self.loss_agg_mode,
            "clip_ratio_low": self.clip_ratio_low,
            "clip_ratio_high": self.clip_ratio_high,
            "clip_ratio_c": self.clip_ratio_c,
            "ratio_kind": self.ratio_kind,
            "tis_cap": self.tis_cap,
            "log_ratio_clamp": self.log_ratio_clamp,
            "max_response_len": self.max_response_len,
        }

    def make_kl_controller(self) -> KLController:
        return make_kl_controller(self.kl_ctrl, self.kl_coef, self.target_kl, self.horizon)
