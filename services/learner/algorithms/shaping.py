"""Probe shaping: penalise overconfident reasoning (docs/architecture.md, TinyZero-PRM's overconf term).

overconfidence = sum_k w_k score_k with w = linspace(0.5, -0.5, N+1): high when the model answers
correctly from truncated reasoning (the reasoning did not matter). With `probe.overconf_coeff`
!= 0 the learner subtracts coeff * overconfidence from each PROBED trajectory's advantage on its
loss-mask tokens, after the estimator's normalisation (so the penalty's scale is the coeff's,
not the batch's). Unprobed rows carry NaN (or None) and are left unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _as_overconf(
    overconfidence: torch.Tensor | Sequence[float | None], dtype, device=None
) -> torch.Tensor:
    if isinstance(overconfidence, torch.Tensor):
        return overconfidence.to(dtype=dtype, device=device).reshape(-1)
    values = [float("nan") if v is None else float(v) for v in overconfidence]
    return torch.tensor(values, dtype=dtype, device=device)


def overconfidence_penalty(
    overconfidence: torch.Tensor | Sequence[float | None],
    coeff: float,
    dtype=torch.float32,
    device=None,
) -> torch.Tensor:
    """Per-row penalty coeff * overconfidence; 0 for unprobed rows (NaN / None)."""
    over = _as_overconf(overconfidence, dtype, device)
    return torch.where(torch.isnan(over), torch.zeros_like(over), coeff * over)


def apply_overconfidence_penalty(
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    overconfidence: torch.Tensor | Sequence[float | None],
    coeff: float,
) -> torch.Tensor:
    """advantages - coeff * overconfidence on each probed row's masked tokens (a new tensor)."""
    penalty = overconfidence_penalty(overconfidence, coeff, advantages.dtype, advantages.device)
    if penalty.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"overconfidence has {penalty.shape[0]} rows for {advantages.shape[0]} advantages"
        )
    if coeff == 0:
        return advantages.clone()
    return advantages - penalty.unsqueeze(-1) * response_mask.to(advantages.dtype)


def overconfidence_penalty_metrics(
    overconfidence: torch.Tensor | Sequence[float | None], coeff: float
) -> dict[str, float]:
    """`probe_all/overconf_penalty_mean` and `..._abs_mean` over probed rows (0 when none)."""
    over = _as_overconf(overconfidence, torch.float64)
    probed = over[~torch.isnan(over)]
    if probed.numel() == 0:
        return {"probe_all/overconf_penalty_mean": 0.0, "probe_all/overconf_penalty_abs_mean": 0.0}
    penalty = coeff * probed
    return {
        "probe_all/overconf_penalty_mean": float(penalty.mean()),
        "probe_all/overconf_penalty_abs_mean": float(penalty.abs().mean()),
    }
