"""PPO-family policy loss: clip with separate low/high epsilon, dual clip, GSPO, TRL's delta.

Per token, with ratio rho = exp(logp - old_logp) and advantage A:

    L = max(-A min(rho, delta), -A clip(rho, 1 - eps_low, 1 + eps_high))  (PPO; DAPO clip-higher;
                                                                          TRL's delta cap)
    L = min(L, -A c)   where A < 0                                         (dual clip, c > 1)

How the knobs map onto the libraries (reference/algorithms.md sections 2, 4, 6):

- verl `vanilla`: the defaults (log-ratio clamped to +-20, dual clip c = 3, no delta).
- TRL GRPO: `log_ratio_clamp=None`, `clip_ratio_c=None`, `delta` = TRL's `delta` (the upper clamp
  of the unclipped ratio, INTELLECT-2's two-sided clip). With delta >= 1 + eps_high it equals a
  dual clip c = delta at the token level; unlike the dual clip it also applies at the sequence
  level (TRL clamps the sequence ratio coef_1 the same way), which is why it is its own option.
- GSPO (`ratio_kind="sequence"`): rho is the sequence's geometric-mean ratio
  exp(mean_t(logp - old)) on every token, with the per-token gradient of verl's stop-gradient
  form (equal to TRL's sequence-level importance sampling for every aggregation mode, since the
  aggregation weights are constant within a sequence). verl clamps log rho <= 10 there (applied
  when `log_ratio_clamp` is not None) and uses no dual clip, so none is applied; `delta` is.
- Off-policy correction: `rollout_is_weights` (from `rollout_correction`, detached) multiply each
  token's loss, as verl's losses do with their `rollout_is_weights` argument.
- `token_keep`: a detached 0/1 multiplier of each token's loss (TRL's off-policy sequence mask
  and top-entropy mask, token_masks.py); the aggregation mask, hence every normaliser, is
  unchanged, as in TRL's `per_token_loss * mask`. With it the sequence ratio takes TRL's
  gradient (`importance_ratio(..., sequence_grad="mean")`), since the keep weights need not be
  constant within a row.

Metrics use verl's names (`pg_clipfrac`, `ppo_kl`, `pg_clipfrac_lower`; the trainer prefixes
`actor/`) plus TRL's clip-region fractions (`clipfrac_high`, `clipfrac_low`).
"""

from __future__ import annotations

import torch

from services.learner.algorithms.aggregation import agg_loss
from services.learner.algorithms.masked import masked_mean

GSPO_LOG_RATIO_MAX = 10.0  # verl's cap on the sequence log-ratio


def importance_ratio(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mask: torch.Tensor,
    ratio_kind: str,
    log_ratio_clamp: float | None,
    sequence_grad: str = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio, token log-ratio for the approx-KL metric) at the token or sequence level.

    The sequence ratio's gradient: `sequence_grad="token"` is verl's stop-gradient form (each
    token's loss differentiates its own log-prob); "mean" is TRL's plain exp(mean_t log ratio),
    whose gradient reaches every token of the row by 1/|y|. The two agree whenever each
    token's loss weight is the same within a row; they part under a per-token mask such as
    TRL's top-entropy mask, where "mean" is TRL's."""
    diff = log_prob - old_log_prob
    if ratio_kind == "token":
        log_ratio = diff
        if log_ratio_clamp is not None:
            log_ratio = log_ratio.clamp(min=-log_ratio_clamp, max=log_ratio_clamp)
        return torch.exp(log_ratio), log_ratio
    if ratio_kind == "sequence":
        lengths = mask.sum(dim=-1).clamp(min=1)
        log_seq = (diff * mask).sum(dim=-1) / lengths
        if sequence_grad == "mean":
            log_ratio = log_seq.unsqueeze(-1).expand_as(log_prob)
        elif sequence_grad == "token":
            log_ratio = log_prob - log_prob.detach() + log_seq.detach().unsqueeze(-1)
        else:
            raise ValueError(f"sequence_grad must be 'token' or 'mean', got {sequence_grad!r}")
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
    delta: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float | None = 20.0,
    token_keep: torch.Tensor | None = None,
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
    max_response_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate loss (to minimise) and detached metrics.

    Metrics: `pg_clipfrac` (verl: the clipped branch was taken), `pg_clipfrac_lower` (verl: the
    dual clip is active), `ppo_kl` (verl: mean of old - new log-prob), `clipfrac_high`
    (TRL clip_ratio/high_mean: rho > 1 + eps_high with A > 0), `clipfrac_low` (TRL low_mean:
    rho < 1 - eps_low with A < 0). Fractions are over masked tokens of this call.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c}")
    if delta is not None and delta <= 0:
        raise ValueError(f"delta must be > 0 (TRL's ratio cap), got {delta}")
    mask = response_mask.to(log_prob.dtype)
    # TRL's masks vary the weight within a row: take TRL's sequence-ratio gradient with them
    ratio, log_ratio = importance_ratio(log_prob, old_log_prob, mask, ratio_kind, log_ratio_clamp,
                                        "token" if token_keep is None else "mean")
    unclipped = -advantages * ratio
    clipped_ratio = ratio.clamp(min=1.0 - clip_ratio_low, max=1.0 + clip_ratio_high)
    clipped = -advantages * clipped_ratio
    capped = unclipped if delta is None else -advantages * ratio.clamp(max=delta)
    loss_mat = torch.maximum(capped, clipped)
    negative = advantages < 0
    dual_active = torch.zeros_like(negative)
    if clip_ratio_c is not None and ratio_kind == "token":
        bound = -advantages * clip_ratio_c
        dual_active = negative & (loss_mat > bound)
        loss_mat = torch.where(negative, torch.minimum(loss_mat, bound), loss_mat)
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.detach()
    if token_keep is not None:  # TRL's off-policy / top-entropy masks (token_masks.py)
        loss_mat = loss_mat * token_keep.detach().to(loss_mat.dtype)

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
        metrics = {
            "pg_clipfrac": masked_mean((clipped > unclipped).to(mask.dtype), mask),
            "ppo_kl": masked_mean(-log_ratio.detach(), mask),
            "pg_clipfrac_lower": masked_mean(dual_active.to(mask.dtype), mask),
            "clipfrac_high": masked_mean(
                ((ratio_d > 1.0 + clip_ratio_high) & (advantages > 0)).to(mask.dtype), mask
            ),
            "clipfrac_low": masked_mean(
                ((ratio_d < 1.0 - clip_ratio_low) & negative).to(mask.dtype), mask
            ),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits) over the last dim: logsumexp(z) - sum(p z)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
