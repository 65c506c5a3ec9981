"""TRL's two 0/1 masks on the policy-loss term: off-policy sequence masking and top-entropy tokens.

Both follow trl 1.16.0 `trl/trainer/grpo_trainer.py` (read from the PyPI wheel):

- `off_policy_sequence_mask` is `GRPOTrainer.get_off_policy_mask` (DeepSeek-V3.2's off-policy
  sequence masking, arXiv 2512.02556 eq. 9; TRL's `off_policy_mask_threshold`). Why: a
  negative advantage on a sequence the current policy has drifted far from pushes down tokens
  the policy no longer produces, which destabilises training; such sequences are dropped.
- `high_entropy_mask` is `GRPOTrainer.get_high_entropy_mask` (Beyond the 80/20 Rule, arXiv
  2506.01939; TRL's `top_entropy_quantile`). Why: the policy-gradient signal that matters comes
  from the few "forking" tokens of high entropy; training on the top-rho of them alone matches
  or beats training on all tokens.

How `_compute_loss` uses them, and so how Forage does: each multiplies the per-token policy
loss (`per_token_loss * mask`), never the aggregation mask, so every normaliser (token count,
per-sequence length, sequence count) still counts the dropped tokens; they are detached; they
touch neither the KL term nor the clip metrics. The trainer hands their product to the loss as
`LossSettings.token_keep` (policy_losses.py).
"""

from __future__ import annotations

import torch


def off_policy_sequence_mask(
    advantages: torch.Tensor,
    log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """1.0 = keep, 0.0 = drop; TRL `GRPOTrainer.get_off_policy_mask` (trl 1.16.0).

    Per row, the mean over its masked tokens of log pi_behaviour - log pi_theta (a k1 estimate of
    KL(pi_behaviour || pi_theta) on the behaviour policy's samples; NaN behaviour log-probs count
    0, as TRL does for tokens vLLM could not score; the divisor is max(tokens, 1)). A token is
    kept iff its advantage >= 0 or its row's mean <= `threshold`. `behaviour_log_prob` is what
    TRL calls `sampling_per_token_logps`: the rollout engine's log-probs when there are any,
    else the old policy's. Advantages of shape (B, 1) give a (B, 1) mask, (B, T) a (B, T) one
    (TRL broadcasts the same way), so with one advantage per sequence whole sequences go.
    """
    kl = (behaviour_log_prob - log_prob.detach()).nan_to_num(nan=0.0)
    weights = mask.to(kl.dtype)
    seq_kl = (kl * weights).sum(dim=-1, keepdim=True) / weights.sum(dim=-1, keepdim=True).clamp(
        min=1.0)
    return ((advantages >= 0) | (seq_kl <= threshold)).to(weights.dtype)


def linear_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """`torch.quantile(values, q)` (linear interpolation) of a non-empty 1-D tensor.

    The same arithmetic as ATen's quantile (rank = q (n - 1) in the values' dtype, truncated
    below, ceil above, lerp), by a sort, so it has no torch.quantile size limit (2**24
    elements): a mini-batch of long agent trajectories can pass that."""
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError("linear_quantile needs a non-empty 1-D tensor")
    ordered = torch.sort(values).values
    rank = torch.tensor(q, dtype=values.dtype, device=values.device) * (values.numel() - 1)
    below = rank.long()
    weight = rank - below
    above = rank.ceil().long()
    return torch.lerp(ordered[below], ordered[above], weight)


def entropy_threshold(pooled_entropies: torch.Tensor, top_quantile: float) -> torch.Tensor | None:
    """The entropy a token needs to be kept: the (1 - top_quantile) quantile of the pooled
    entropies in float32 (TRL: `torch.quantile(gathered, 1 - top_entropy_quantile)` over the
    loss tokens of all processes); None when there is no token."""
    pooled = pooled_entropies.reshape(-1).float()
    if pooled.numel() == 0:
        return None
    return linear_quantile(pooled, 1 - top_quantile)


def high_entropy_mask(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    top_quantile: float,
    threshold: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Boolean (B, T): the masked tokens whose entropy is >= the threshold; TRL
    `GRPOTrainer.get_high_entropy_mask` (trl 1.16.0), called with 1 - `top_quantile`.

    The threshold is `entropy_threshold` of the masked entropies here unless given (the trainer
    computes it over a whole mini-batch and passes it). Ties at the threshold are all kept
    (`>=`), so `top_quantile=0` keeps every token that has the largest entropy and 1.0 keeps
    every masked token; no masked token at all: nothing is kept (TRL returns all False)."""
    keep = mask.bool()
    if threshold is None:
        threshold = entropy_threshold(entropies[keep], top_quantile)
        if threshold is None:
            return torch.zeros_like(keep)
    return ((entropies * mask.to(entropies.dtype)) >= threshold) & keep
