"""BNPO: Beta-normalised advantages for binary rewards (Xiao et al. 2025, arXiv 2506.02864).

A = (r - p_g) / f(p_g; alpha, beta), where p_g is the group's success rate and f the Beta
density. The paper fits Beta(a, b) to the success rates of recent prompts by the method of
moments and sets alpha = max(1 + a/3, 1), beta = max(1 + b/3, 1), which minimises the gradient
variance under its model. The authors' code fits (a, b) on the current batch only; `BNPOState`
fits them online over a window of recent groups so that the normalisation follows the policy
without swinging with one batch's sample of prompts.

Differences from the authors' code, on purpose: singleton groups (no success-rate estimate) get
A = r (verl's singleton convention, weight 1) and do not enter the moments, where the paper
treats them as p = 0 and can give them a weight of up to 1e6; a degenerate fit (fewer than two
rates, or zero variance) falls back to alpha = beta = 1, i.e. plain REINFORCE with a group
baseline.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from services.learner.algorithms.advantages import GroupIds, _check_shapes, _scores
from services.learner.algorithms.masked import group_index, group_stats


def beta_moments(rates: Iterable[float]) -> tuple[float, float]:
    """Paper's (alpha, beta) from success rates: method-of-moments (a, b), then 1 + x/3 >= 1."""
    values = [float(v) for v in rates]
    if len(values) < 2:
        return 1.0, 1.0
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)  # unbiased, as torch.var
    if var <= 1e-12:
        return 1.0, 1.0
    common = mean * (1 - mean) / var - 1
    a, b = common * mean, common * (1 - mean)
    return max(1.0 + a / 3, 1.0), max(1.0 + b / 3, 1.0)


def beta_log_pdf(p: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    log_norm = math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta)
    return (
        torch.xlogy(torch.tensor(alpha - 1.0, dtype=p.dtype), p)
        + torch.xlogy(torch.tensor(beta - 1.0, dtype=p.dtype), 1 - p)
        - log_norm
    )


class BNPOState:
    """Online Beta fit over the success rates of the last `window` groups (a checkpointable deque)."""

    def __init__(self, window: int = 512) -> None:
        if window < 2:
            raise ValueError("BNPOState window must hold at least 2 groups")
        self.window = window
        self.rates: deque[float] = deque(maxlen=window)

    def update(self, rates: Iterable[float]) -> None:
        self.rates.extend(float(r) for r in rates)

    def parameters(self) -> tuple[float, float]:
        return beta_moments(self.rates)

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "rates": list(self.rates)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window = int(state["window"])
        self.rates = deque((float(r) for r in state["rates"]), maxlen=self.window)


@torch.no_grad()
def bnpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    state: BNPOState | None = None,
    min_value: float = 0.0,
    max_value: float = 1.0,
    weight_cap: float = 1e6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BNPO advantages. Rewards are rescaled to [0, 1] by (r - min_value) / (max_value - min_value).

    With `state`, this batch's group success rates join the window before (alpha, beta) are
    fitted; without it the fit uses this batch alone (the authors' code).
    """
    _check_shapes(token_level_rewards, response_mask)
    if max_value <= min_value:
        raise ValueError("bnpo needs max_value > min_value")
    scores = (_scores(token_level_rewards) - min_value) / (max_value - min_value)
    if bool(((scores < -1e-9) | (scores > 1 + 1e-9)).any()):
        raise ValueError("bnpo: rewards outside [min_value, max_value]; set both options")
    index, num_groups = group_index(group_ids, scores.shape[0])
    index = index.to(scores.device)
    count, mean, _ = group_stats(scores, index, num_groups)
    multi = count > 1
    rates = mean[multi].tolist()
    if state is not None:
        state.update(rates)
        alpha, beta = state.parameters()
    else:
        alpha, beta = beta_moments(rates)
    p = mean.clamp(0.0, 1.0)
    weight = torch.exp(-beta_log_pdf(p, alpha, beta)).clamp(min=0.0, max=weight_cap)
    weight = torch.where(multi, weight, torch.ones_like(weight))
    baseline = torch.where(multi, p, torch.zeros_like(p))
    adv = (weight[index] * (scores - baseline[index])).unsqueeze(-1) * response_mask
    return adv, adv
