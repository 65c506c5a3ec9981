"""Loss aggregation: how a (batch, T) per-token loss becomes one scalar.

The mode decides how much each token and each sequence weighs (the Dr. GRPO length-bias
argument), so it is a named option, not a detail. Modes and their counterparts:

- `token-mean`: sum(l m) / sum(m) — verl token-mean; TRL "bnpo" (local) or "dapo" (global).
- `seq-mean-token-sum`: mean over sequences of sum_t(l m).
- `seq-mean-token-mean`: mean over sequences of mean_t(l m) — TRL "grpo".
- `seq-mean-token-sum-norm`: sum(l m) / (num_seqs * max_response_len) — verl 0.9.1, TRL
  "dr_grpo". (verl 0.7-0.8 divided by max_response_len only, without the sequence count.)
- `token-sum`: sum(l m).

Multi-rank / micro-batch exactness: pass `global_token_count` (token-mean) or
`global_seq_count` (the seq-* modes), the counts over the WHOLE mini-batch on all ranks. The
value returned is then this micro-batch's share, and summing the shares over micro-batches and
ranks gives exactly the single-process loss. DeepSpeed/DDP average gradients over ranks, so the
trainer multiplies the share by the data-parallel world size (verl's `dp_size` factor) and must
not divide by the number of accumulation steps.
Sequences with an all-zero mask count for nothing (verl 0.9.1).
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "token-sum",
)


def _divide(numerator: torch.Tensor, count: torch.Tensor | float) -> torch.Tensor:
    """numerator / count, but 0 for an empty batch instead of NaN (numerator is 0 there)."""
    count = torch.as_tensor(count, dtype=numerator.dtype, device=numerator.device)
    return torch.where(count > 0, numerator / count.clamp(min=1e-12), numerator * 0)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
    max_response_len: int | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss under `mode` (see the module doc for the modes)."""
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} differ")
    mask = mask.to(loss_mat.dtype)
    seq_sums = (loss_mat * mask).sum(dim=-1)
    seq_lens = mask.sum(dim=-1)
    valid = (seq_lens > 0).to(loss_mat.dtype)
    seq_count = valid.sum() if global_seq_count is None else global_seq_count

    if mode == "token-mean":
        count = mask.sum() if global_token_count is None else global_token_count
        return _divide(seq_sums.sum(), count)
    if mode == "seq-mean-token-sum":
        return _divide((seq_sums * valid).sum(), seq_count)
    if mode == "seq-mean-token-mean":
        per_seq = seq_sums / (seq_lens + 1e-8)
        return _divide((per_seq * valid).sum(), seq_count)
    if mode == "seq-mean-token-sum-norm":
        norm = float(max_response_len if max_response_len is not None else loss_mat.shape[-1])
        return _divide((seq_sums * valid).sum(), seq_count) / norm
    if mode == "token-sum":
        return seq_sums.sum()
    raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")
