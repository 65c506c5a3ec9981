"""Critic loss for GAE: clipped value regression (PPO / verl `compute_value_loss`)."""

from __future__ import annotations

import torch

from services.learner.algorithms.aggregation import agg_loss
from services.learner.algorithms.masked import masked_mean


def value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float = 0.5,
    mode: str = "token-mean",
    *,
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
    max_response_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * agg(max((v - R)^2, (clip(v, V - c, V + c) - R)^2)); `values` V are the rollout-time
    critic values, so the clip keeps the new critic near the one the advantages came from.

    Returns the loss and `{"vf_clipfrac": fraction of tokens where the clipped branch won}`.
    """
    clipped_preds = torch.maximum(
        torch.minimum(vpreds, values + cliprange_value), values - cliprange_value
    )
    unclipped_err = (vpreds - returns) ** 2
    clipped_err = (clipped_preds - returns) ** 2
    per_token = torch.maximum(unclipped_err, clipped_err)
    loss = 0.5 * agg_loss(
        per_token,
        mask,
        mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        max_response_len=max_response_len,
    )
    fmask = mask.to(vpreds.dtype)
    clipfrac = masked_mean((clipped_err > unclipped_err).to(fmask.dtype), fmask).detach()
    return loss, {"vf_clipfrac": clipfrac}
