"""`learner.algorithm.*`: the typed view of the free-form algorithm dict in the learner config.

The learner section keeps `algorithm` as a plain dict (so this package owns its keys); this model
validates it with errors that name the bad key, and turns it into the keyword arguments of the
functions in this package, so config keys and function options cannot drift apart.
Every key is documented in docs/algorithms.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from services.common.config.base import Section
from services.learner.algorithms.aggregation import LOSS_AGG_MODES
from services.learner.algorithms.bnpo import BNPOState
from services.learner.algorithms.kl import KL_KINDS, KLController, make_kl_controller
from services.learner.algorithms.policy_losses import POLICY_LOSSES, LossSettings
from services.learner.algorithms.rollout_correction import parse_is_threshold, parse_rs


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
    # --- estimator extras ---
    gpg_f_norm: float = Field(default=1.0, gt=0)  # gpg: A = alpha (r - mean) / f_norm
    gdpo_reward_keys: list[str] = Field(default_factory=list)  # gdpo: reward_components keys
    gdpo_reward_weights: list[float] | None = None  # gdpo: one weight per key (None: ones)
    otb_handle_zero_tail: bool = True  # (tir_)optimal_token_baseline
    otb_epsilon: float = Field(default=1e-8, ge=0)
    # --- policy loss (policy_losses.py; verl `policy_loss.loss_mode`) ---
    policy_loss: str = "vanilla"
    loss_agg_mode: str = "token-mean"
    # >= 1 turns the lower clip off (verl's CISPO example sets 10: only the upper bound).
    clip_ratio_low: float = Field(default=0.2, ge=0)
    clip_ratio_high: float = Field(default=0.2, ge=0)
    clip_ratio_c: float | None = Field(default=3.0, gt=1)  # None: no dual clip
    delta: float | None = Field(default=None, gt=0)  # TRL: cap on the unclipped ratio
    ratio_kind: Literal["token", "sequence"] = "token"  # sequence = GSPO
    log_ratio_clamp: float | None = Field(default=20.0, gt=0)  # None: no clamp (TRL)
    tau_pos: float = Field(default=1.0, gt=0)  # sapo (TRL sapo_temperature_pos)
    tau_neg: float = Field(default=1.05, gt=0)  # sapo (TRL sapo_temperature_neg)
    clip_cov_ratio: float = Field(default=2e-4, gt=0)
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = Field(default=2e-4, gt=0)
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = Field(default=None, gt=0)
    cispo_eps_max: float | None = Field(default=None, gt=0)  # set: TRL's CISPO
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # None: rollout.max_response_length (the run's constant), the divisor of
    # seq-mean-token-sum-norm (verl loss_scale_factor, TRL max_completion_length).
    max_response_len: int | None = Field(default=None, ge=1)
    mask_truncated_completions: bool = False  # TRL: no loss on finish_reason "length" rows
    entropy_coeff: float = 0.0
    # TRL off_policy_mask_threshold (token_masks.off_policy_sequence_mask; GRPOTrainer
    # .get_off_policy_mask, trl 1.16.0): drop the policy loss of negative-advantage sequences
    # whose mean log pi_behaviour - log pi_theta exceeds it. None: off (TRL's default).
    off_policy_mask_threshold: float | None = Field(default=None, gt=0)
    # TRL top_entropy_quantile (token_masks.high_entropy_mask; GRPOTrainer
    # .get_high_entropy_mask): policy loss only on the tokens whose entropy is in the top
    # quantile of the mini-batch's loss tokens. 1.0: every token (TRL's default).
    top_entropy_quantile: float = Field(default=1.0, ge=0, le=1)
    # --- rollout correction (rollout_correction.py; verl algorithm.rollout_correction) ---
    rollout_is: Literal["token", "sequence"] | None = None
    rollout_is_threshold: float | str = 2.0  # "2.0": truncate (TIS); "0.5_5.0": IcePop
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None  # e.g. "token_k1" or "seq_mean_k1,token_k3"
    rollout_rs_threshold: float | str | None = None
    bypass_mode: bool = False  # old log-probs := rollout log-probs; loss = bypass_mode
    bypass_loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    tis_cap: float | None = Field(default=None, gt=0)  # = rollout_is: token with this threshold
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
    # TRL use_bias_correction_kl (kl.bias_corrected_kl; GRPOTrainer._compute_loss): the KL loss
    # per token times pi_theta / pi_old. TRL defaults to True; False here keeps verl's KL loss.
    use_bias_correction_kl: bool = False
    # --- critic (gae) ---
    cliprange_value: float = Field(default=0.5, gt=0)
    # --- group filter (DAPO dynamic sampling) ---
    filter_groups: bool = False
    filter_keep_singletons: bool = True
    # --- PF-PPO (pf_ppo.py; verl algorithm.use_pf_ppo / pf_ppo.reweight_method / weight_pow,
    # core_algos.compute_pf_ppo_reweight_data): resample the batch by reward-based weights.
    # verl applies it only with adv_estimator gae (rl_batch.check_estimator says so at start).
    use_pf_ppo: bool = False
    pf_ppo_reweight_method: Literal["pow", "max_min", "max_random"] = "pow"
    pf_ppo_weight_pow: float = 2.0

    @field_validator("loss_agg_mode")
    @classmethod
    def _agg_mode(cls, value: str) -> str:
        if value not in LOSS_AGG_MODES:
            raise ValueError(f"must be one of {', '.join(LOSS_AGG_MODES)}")
        return value

    @field_validator("policy_loss")
    @classmethod
    def _policy_loss(cls, value: str) -> str:
        if value not in POLICY_LOSSES:
            raise ValueError(f"must be one of {', '.join(sorted(POLICY_LOSSES))}")
        return value

    @field_validator("rollout_is_threshold")
    @classmethod
    def _is_threshold(cls, value: float | str) -> float | str:
        parse_is_threshold(value)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmSettings:
        if self.rollout_rs is not None:
            parse_rs(self.rollout_rs, self.rollout_rs_threshold)
        if self.tis_cap is not None and self.rollout_is is not None:
            raise ValueError("tis_cap is rollout_is='token' with rollout_is_threshold=tis_cap; "
                             "set one of them")
        if self.policy_loss == "dro" and self.dro_beta is None:
            raise ValueError("policy_loss 'dro' needs dro_beta > 0 (verl has no default)")
        if self.gdpo_reward_weights is not None and (
                len(self.gdpo_reward_weights) != len(self.gdpo_reward_keys)):
            raise ValueError("gdpo_reward_weights needs one weight per gdpo_reward_keys entry")
        if self.use_bias_correction_kl and not self.use_kl_loss:
            raise ValueError("use_bias_correction_kl weights the KL loss term: it needs "
                             "use_kl_loss: true")
        if self.uses_token_keep and self.effective_policy_loss == "geo_mean":
            raise ValueError("off_policy_mask_threshold / top_entropy_quantile < 1 mask the "
                             "per-token loss, which policy_loss geo_mean does not have")
        return self

    @property
    def uses_entropy_mask(self) -> bool:
        """TRL applies the top-entropy mask only below 1.0 (`top_entropy_quantile < 1.0`)."""
        return self.top_entropy_quantile < 1.0

    @property
    def uses_token_keep(self) -> bool:
        """Whether the policy loss gets a 0/1 per-token multiplier (token_masks.py)."""
        return self.off_policy_mask_threshold is not None or self.uses_entropy_mask

    @property
    def importance_sampling_level(self) -> Literal["token", "sequence"]:
        """TRL's importance_sampling_level of the configured loss: "sequence" for
        `ratio_kind: sequence` and the sequence-ratio losses (gspo, luspo); the level of the
        bias-corrected KL's ratio. Bypass mode's loss is token-level (policy_losses.py)."""
        name = self.effective_policy_loss
        if name in ("gspo", "luspo") or (self.ratio_kind == "sequence" and name != "bypass_mode"):
            return "sequence"
        return "token"

    def pf_ppo_options(self) -> dict[str, Any]:
        """Keyword arguments of `pf_ppo_resample` (besides the scores and the generator)."""
        return {"method": self.pf_ppo_reweight_method, "weight_pow": self.pf_ppo_weight_pow}

    @property
    def effective_policy_loss(self) -> str:
        """verl's bypass mode replaces the loss with `bypass_mode` (apply_bypass_mode)."""
        return "bypass_mode" if self.bypass_mode else self.policy_loss

    @property
    def uses_bypass(self) -> bool:
        return self.effective_policy_loss == "bypass_mode"

    @property
    def effective_rollout_is(self) -> str | None:
        return "token" if self.tis_cap is not None else self.rollout_is

    @property
    def effective_rollout_is_threshold(self) -> float | str:
        return self.tis_cap if self.tis_cap is not None else self.rollout_is_threshold

    @property
    def uses_rollout_correction(self) -> bool:
        """Decoupled rollout correction: IS weights / rejection computed once per batch from
        old vs rollout log-probs (in bypass mode the loss does it instead)."""
        return not self.uses_bypass and (
            self.effective_rollout_is is not None or self.rollout_rs is not None)

    @property
    def rollout_correction_needs_batch(self) -> bool:
        """Whether the decoupled correction needs the whole batch and the old log-probs before
        the update: rejection (it changes the advantages' mask), batch normalisation and
        sequence-level weights (a whole trajectory, which a step row is not). Token-level IS
        alone is per token: with one update per batch (old = current policy) the loss computes
        it from the current log-probs, and no extra forward pass is spent (`tis_cap`)."""
        return self.uses_rollout_correction and (
            self.rollout_rs is not None or self.rollout_is_batch_normalize
            or self.effective_rollout_is == "sequence")

    def rollout_correction_options(self) -> dict[str, Any]:
        return {
            "rollout_is": self.effective_rollout_is,
            "rollout_is_threshold": self.effective_rollout_is_threshold,
            "rollout_is_batch_normalize": self.rollout_is_batch_normalize,
            "rollout_rs": self.rollout_rs,
            "rollout_rs_threshold": self.rollout_rs_threshold,
        }

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
        if name in ("grpo_vectorized", "grpo_passk"):
            return {"epsilon": self.epsilon, "norm_adv_by_std": self.norm_adv_by_std}
        if name == "gdpo":
            return {"epsilon": self.epsilon, "norm_adv_by_std": self.norm_adv_by_std,
                    "weights": self.gdpo_reward_weights}
        if name == "gpg":
            return {"f_norm": self.gpg_f_norm}
        if name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
            return {"handle_zero_tail": self.otb_handle_zero_tail, "epsilon": self.otb_epsilon}
        # opo, rloo_vectorized; remax (its reward_baselines come from the greedy rollouts).
        return {}

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
        """Keyword arguments of `policy_loss` (the vanilla / GSPO function)."""
        return {
            "loss_agg_mode": self.loss_agg_mode,
            "clip_ratio_low": self.clip_ratio_low,
            "clip_ratio_high": self.clip_ratio_high,
            "clip_ratio_c": self.clip_ratio_c,
            "ratio_kind": self.ratio_kind,
            "delta": self.delta,
            "log_ratio_clamp": self.log_ratio_clamp,
            "max_response_len": self.max_response_len,
        }

    def loss_settings(self) -> LossSettings:
        """Every knob of the registered policy losses (policy_losses.py)."""
        return LossSettings(
            loss_agg_mode=self.loss_agg_mode,
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
            clip_ratio_c=self.clip_ratio_c,
            delta=self.delta,
            ratio_kind=self.ratio_kind,
            log_ratio_clamp=self.log_ratio_clamp,
            tau_pos=self.tau_pos,
            tau_neg=self.tau_neg,
            clip_cov_ratio=self.clip_cov_ratio,
            clip_cov_lb=self.clip_cov_lb,
            clip_cov_ub=self.clip_cov_ub,
            kl_cov_ratio=self.kl_cov_ratio,
            ppo_kl_coef=self.ppo_kl_coef,
            dro_beta=self.dro_beta,
            cispo_eps_max=self.cispo_eps_max,
            vespo_k_pos=self.vespo_k_pos,
            vespo_lambda_pos=self.vespo_lambda_pos,
            vespo_k_neg=self.vespo_k_neg,
            vespo_lambda_neg=self.vespo_lambda_neg,
            bypass_loss_type=self.bypass_loss_type,
            rollout_is=self.effective_rollout_is,
            rollout_is_threshold=self.effective_rollout_is_threshold,
            rollout_is_batch_normalize=self.rollout_is_batch_normalize,
            rollout_rs=self.rollout_rs,
            rollout_rs_threshold=self.rollout_rs_threshold,
            max_response_len=self.max_response_len,
        )

    def make_kl_controller(self) -> KLController:
        return make_kl_controller(self.kl_ctrl, self.kl_coef, self.target_kl, self.horizon)
