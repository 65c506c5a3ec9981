"""PPO-family policy loss: clip with separate low/high epsilon, dual clip, GSPO, truncated IS.

Per token, with ratio rho = exp(logp - old_logp) and advantage A:

    L = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))        (PPO; DAPO clip-higher)
    L = min(L, -A c)   where A < 0                                   (dual clip, c > 1)

How the knobs map onto the libraries (reference/algorithms.md sections 2, 4, 6):

- verl `vanilla`: the defaults (log-ratio clamped to +-20, dual clip c = 3).
- TRL GRPO: `log_ratio_clamp=None`, `clip_ratio_c=None`; TRL's `delta` (ratio cap) is the same
  function as the dual clip, so `clip_ratio_c=delta` reproduces it when delta >= 1 + eps_high.
- GSPO (`ratio_kind="sequence"`): rho is the sequence's geometric-mean ratio
  exp(mean_t(logp - old)) on every token, with the per-token gradient of verl's stop-gradient
  form (equal to TRL's sequence-level importance sampling for every aggregation mode, since the
  aggregation weights are constant within a sequence). verl clamps log rho <= 10 there (applied
  when `log_ratio_clamp` is not None) and uses no dual clip, so none is applied.
- Truncated importance sampling (stale, off-policy samples): when `rollout_log_prob` and
  `tis_cap` are both given, each token's loss is multiplied by the constant
  min(exp(old_logp - rollout_logp), tis_cap), correcting for the gap between the behaviour
  policy that sampled the token and the policy `old_logp` came from (verl's TIS).
"""

from __future__ import annotations

import torch

from services.learner.algorithms.aggregation import agg_loss
from services.learner.algorithms.masked import masked_mean

GSPO_LOG_RATIO_MAX = 10.0  # verl's cap on the sequence log-ratio


def _ratio(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mask: torch.Tensor,
    ratio_kind: str,
    log_ratio_clamp: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio, token log-ratio for the approx-KL metric)."""
    diff = log_prob - old_log_prob
    if ratio_kind == "token":
        log_ratio = diff
        if log_ratio_clamp is not None:
            log_ratio = log_ratio.clamp(min=-log_ratio_clamp, max=log_ratio_clamp)
        return torch.exp(log_ratio), log_ratio
    if ratio_kind == "sequence":
        lengths = mask.sum(dim=-1).clamp(min=1)
        log_seq = (diff * mask).sum(dim=-1) / lengths
        log_ratio = log_prob - log_prob.detach() + log_seq.detach().unsqueeze(-1)
        if log_ratio_clamp is not None:
            log_ratio = log_ratio.clamp(max=GSPO_LOG_RATIO_MAX)
        return torch.exp(log_ratio), diff
    raise ValueError(f"ratio_kind must be 'token' or 'sequence' (GSPO), got {ratio_kind!r}")


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    ratio_kind: str = "token",
    rollout_log_prob: torch.Tensor | None = None,
    tis_cap: float | None = None,
    log_ratio_clamp: float | None = 20.0,
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
    max_response_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate loss (to minimise) and detached metrics.

    Metrics: `clipfrac_high` (rho > 1 + eps_high with A > 0: the update is cut),
    `clipfrac_low` (rho < 1 - eps_low with A < 0), `clipfrac_dual` (the dual clip is active;
    verl pg_clipfrac_lower), `clipfrac` (verl pg_clipfrac: the clipped branch was taken),
    `approx_kl` (verl ppo_kl, mean of old - new), and with TIS `tis_weight_mean`,
    `tis_clipfrac`. Fractions are over masked tokens of this call (not global).
    """
    mask = response_mask.to(log_prob.dtype)
    ratio, log_ratio = _ratio(log_prob, old_log_prob, mask, ratio_kind, log_ratio_clamp)
    unclipped = -advantages * ratio
    clipped_ratio = ratio.clamp(min=1.0 - clip_ratio_low, max=1.0 + clip_ratio_high)
    clipped = -advantages * clipped_ratio
    loss_mat = torch.maximum(unclipped, clipped)
    negative = advantages < 0
    dual_active = torch.zeros_like(negative)
    if clip_ratio_c is not None and ratio_kind == "token":
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c}")
        bound = -advantages * clip_ratio_c
        dual_active = negative & (loss_mat > bound)
        loss_mat = torch.where(negative, torch.minimum(loss_mat, bound), loss_mat)

    metrics: dict[str, torch.Tensor] = {}
    if rollout_log_prob is not None and tis_cap is not None:
        behaviour_log_ratio = (old_log_prob - rollout_log_prob).detach()
        if log_ratio_clamp is not None:
            behaviour_log_ratio = behaviour_log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
        raw_weight = torch.exp(behaviour_log_ratio)
        weight = raw_weight.clamp(max=tis_cap)
        loss_mat = loss_mat * weight
        metrics["tis_weight_mean"] = masked_mean(weight, mask)
        metrics["tis_clipfrac"] = masked_mean((raw_weight > tis_cap).to(mask.dtype), mask)

    loss = agg_loss(
        loss_mat,
        mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        max_response_len=max_response_len,
    )
    with torch.no_grad():
        ratio_d = ratio.detach()
        metrics["clipfrac_high"] = masked_mean(
            ((ratio_d > 1.0 + clip_ratio_high) & (advantages > 0)).to(mask.dtype), mask
        )
        metrics["clipfrac_low"] = masked_mean(
            ((ratio_d < 1.0 - clip_ratio_low) & negative).to(mask.dtype), mask
        )
        metrics["clipfrac_dual"] = masked_mean(dual_active.to(mask.dtype), mask)
        metrics["clipfrac"] = masked_mean((clipped > unclipped).detach().to(mask.dtype), mask)
        metrics["approx_kl"] = masked_mean(-log_ratio.detach(), mask)
    return loss, {k: v.detach() for k, v in metrics.items()}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits) over the last dim: logsumexp(z) - sum(p z)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
