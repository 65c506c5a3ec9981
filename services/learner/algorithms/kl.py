"""KL to a frozen reference policy: per-token estimators, coefficient controllers, reward penalty.

Estimators of KL(pi || ref) from samples of pi, with d = logp - ref_logp (Schulman's k1/k2/k3):

- `k1` / `kl`: d (unbiased, high variance, can be negative per token)
- `abs`: |d|
- `k2` / `mse`: d^2 / 2
- `k3` / `low_var_kl`: e^{-d} + d - 1 (unbiased, non-negative). verl clamps the exponent to
  +-20 and the value to +-10 (`clamp=True`); TRL clamps nothing (`clamp=False`).
- a trailing "+" (e.g. `k3+`): the value of the named estimator, the gradient of k2 (verl 0.9.1),
  because k2's gradient is the unbiased one for the KL as a loss term.

As a loss term the trainer adds `coef * agg_loss(kl_penalty(logp, ref, kind), mask, mode)`;
aggregation is linear, so this equals TRL adding beta * KL per token before its normalisation.
With TRL's `use_bias_correction_kl` the per-token estimate is first multiplied by the
importance ratio pi_theta / pi_old (`bias_corrected_kl`).
As a reward penalty, `apply_kl_penalty` subtracts beta * KL from the token-level scores.
"""

from __future__ import annotations

from typing import Any

import torch

from services.learner.algorithms.masked import masked_mean

KL_KINDS: tuple[str, ...] = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, kind: str, *, clamp: bool = True
) -> torch.Tensor:
    """Per-token KL estimate (see the module doc for `kind`)."""
    if kind.endswith("+"):
        value = kl_penalty(logp, ref_logp, kind[:-1], clamp=clamp)
        surrogate = 0.5 * (logp - ref_logp).square()
        return surrogate - surrogate.detach() + value.detach()
    diff = logp - ref_logp
    if kind in ("k1", "kl"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("k2", "mse"):
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        x = -diff
        if clamp:
            x = x.clamp(min=-20.0, max=20.0)
        value = torch.exp(x) - x - 1
        return value.clamp(min=-10.0, max=10.0) if clamp else value
    if kind == "full":
        raise NotImplementedError("the full-distribution KL needs logits, not log-probs")
    raise ValueError(f"unknown KL kind {kind!r}; choose one of {', '.join(KL_KINDS)} (+ '+')")


def kl_importance_weight(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    log_ratio_clamp: float | None = None,
) -> torch.Tensor:
    """TRL's `coef_1` (trl 1.16.0 `GRPOTrainer._compute_loss`), differentiable: exp(logp - old)
    per token (`level="token"`, (B, T)), or exp of the row's mean log ratio over its masked
    tokens, divisor max(tokens, 1) (`level="sequence"`, TRL importance_sampling_level, (B, 1)).
    `log_ratio_clamp` bounds the log weight to +-clamp (Forage's `log_ratio_clamp`; None: TRL,
    no clamp)."""
    log_ratio = log_prob - old_log_prob
    if level == "token":
        log_weight = log_ratio
    elif level == "sequence":
        weights = mask.to(log_ratio.dtype)
        log_weight = ((log_ratio * weights).sum(dim=-1)
                      / weights.sum(dim=-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        raise ValueError(f"importance sampling level must be 'token' or 'sequence', got {level!r}")
    if log_ratio_clamp is not None:
        log_weight = log_weight.clamp(min=-log_ratio_clamp, max=log_ratio_clamp)
    return torch.exp(log_weight)


def bias_corrected_kl(
    kl: torch.Tensor,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    log_ratio_clamp: float | None = None,
) -> torch.Tensor:
    """TRL `use_bias_correction_kl` (trl 1.16.0 `GRPOTrainer._compute_loss`;
    DeepSeek-V3.2, arXiv 2512.02556): the per-token KL estimate times the importance ratio
    pi_theta / pi_old (`kl_importance_weight`, not detached).

    Why: the KL estimate is taken on tokens sampled from pi_old, not pi_theta; weighting it by
    the ratio makes its gradient the unbiased gradient of the reverse KL(pi_theta || ref). The
    ratio's gradient counts even where its value is 1 (on-policy), so this changes the KL
    gradient whenever the KL loss is on."""
    return kl * kl_importance_weight(log_prob, old_log_prob, mask, level, log_ratio_clamp)


class FixedKLController:
    """A constant coefficient (verl's default, kl_coef=0.001)."""

    def __init__(self, kl_coef: float = 0.001) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; present so the trainer treats both controllers alike."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al.'s proportional controller: steer the measured KL toward `target_kl`.

    value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError("AdaptiveKLController needs target_kl > 0 and horizon > 0")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(
    kind: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1, horizon: int = 10000
) -> KLController:
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; choose 'fixed' or 'adaptive'")


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    controller: KLController,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards = scores - beta * KL per token (verl's use_kl_in_reward), then adapt beta.

    `logp` are the log-probs of the policy that generated the batch (old / behaviour). beta is read
    before the update, and the controller sees the batch mean of per-sequence mean KL with
    n_steps = batch size, as verl does.
    """
    kld = kl_penalty(logp, ref_logp, kind) * mask
    beta = controller.value
    rewards = token_level_scores - beta * kld
    current_kl = float(masked_mean(kld, mask, dim=-1).mean())
    controller.update(current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
