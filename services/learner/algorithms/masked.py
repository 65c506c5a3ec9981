"""Masked statistics and group bookkeeping shared by the estimators and losses.

The constants follow verl's `torch_functional` helpers on purpose: a whitened advantage that is
off by an epsilon from verl's would make parity tests (and users comparing curves) guess which
side is wrong.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

MEAN_EPS = 1e-8  # verl masked_mean: sum(x*m) / (sum(m) + 1e-8)
WHITEN_EPS = 1e-8  # verl masked_whiten: (x - mean) * rsqrt(var + 1e-8)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    prod = x * mask
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """verl's masked mean; an all-zero mask gives 0 rather than NaN."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / (count + MEAN_EPS)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked entries of the batch (verl: unbiased, N/(N-1) correction).

    Raises on fewer than two masked entries when unbiased, like verl, because whitening one
    number is meaningless and silently returning inf/NaN would poison the whole batch.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count == 0:
            raise ValueError("masked_var: the mask selects no element")
        if count == 1:
            raise ValueError("masked_var: the mask selects one element; unbiased variance needs 2")
        var = var * count / (count - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over masked entries; the result is NOT re-masked (verl)."""
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


def group_index(
    group_ids: torch.Tensor | Sequence[Hashable], batch: int
) -> tuple[torch.Tensor, int]:
    """Map per-row group ids (a tensor or any hashable ids) to dense 0..G-1 indices.

    Groups are numbered by first appearance, so results never depend on how ids sort.
    """
    if isinstance(group_ids, torch.Tensor):
        keys: Sequence[Hashable] = group_ids.reshape(-1).tolist()
    else:
        keys = list(group_ids)
    if len(keys) != batch:
        raise ValueError(f"group_ids has {len(keys)} entries for a batch of {batch} rows")
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(key, len(dense)) for key in keys]
    return torch.tensor(index, dtype=torch.long), len(dense)


def group_stats(
    scores: torch.Tensor, index: torch.Tensor, num_groups: int, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group (count, mean, std) of a (batch,) score vector, returned per group."""
    index = index.to(scores.device)
    count = scores.new_zeros(num_groups).index_add_(0, index, torch.ones_like(scores))
    total = scores.new_zeros(num_groups).index_add_(0, index, scores)
    mean = total / count
    sq = scores.new_zeros(num_groups).index_add_(0, index, (scores - mean[index]) ** 2)
    denom = (count - 1) if unbiased else count
    std = torch.sqrt(sq / denom.clamp(min=1))
    return count, mean, std


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Column of each row's last nonzero mask entry (0 for an empty row)."""
    cols = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, cols, torch.zeros_like(cols)).max(dim=-1).values
