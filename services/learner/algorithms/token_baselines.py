"""Optimal token baselines (verl 0.9.1 `optimal_token_baseline`, `tir_optimal_token_baseline`).

A baseline per response position instead of one per trajectory. With G_t the reward-to-go and
the path-variance proxy W_t = sum_{j<=t} w_j, w_j = 1 - 2 pi_j + sum_v pi(v)^2 (pi_j the
probability of the sampled token under the policy that computed `old_log_probs`, the sum over
the vocabulary, both from the same forward pass; times the squared rollout IS weight when one is
given), the variance-minimising baseline at position t of a prompt group is

    B_t = sum_i G_{i,t} W_{i,t} m_{i,t} / (sum_i W_{i,t} m_{i,t} + eps),    A = (G - B) m.

`optimal_token_baseline` aligns the group's rows by column; `tir_optimal_token_baseline` (tool-
integrated reasoning) first squeezes out masked positions (observations), so the k-th policy
token of each row is compared with the k-th policy token of the others whatever the tool output
lengths. A group of one keeps A = G. With `handle_zero_tail` the longest row's baseline is zeroed
past the second-longest row's length (only its own return is left there).

Written from verl's definitions (reference/algorithms.md section 1); the column cut-off of the
non-TIR zero tail uses the second-longest row's token COUNT as a column index, as verl does.
"""

from __future__ import annotations

import torch

from services.learner.algorithms.advantages import GroupIds, _check_shapes
from services.learner.algorithms.masked import group_index


def _path_weights(
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
) -> torch.Tensor:
    w = 1.0 - 2.0 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.square()
    return (w * response_mask).cumsum(dim=-1)


def _reward_to_go(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])


def _check(token_level_rewards, *tensors) -> None:
    for tensor in tensors:
        if tensor is not None and tensor.shape != token_level_rewards.shape:
            raise ValueError("optimal token baseline: old_log_probs, sum_pi_squared and "
                             "rollout_is_weights must have the rewards' (batch, T) shape")


def _zero_tail(baselines: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor) -> None:
    """Zero the longest row's baseline past the second-longest length (a unique longest only)."""
    ordered = torch.sort(lengths).values
    longest, second = int(ordered[-1]), int(ordered[-2])
    at_max = torch.nonzero(lengths == longest).flatten()
    if at_max.numel() == 1 and longest > second:
        baselines[int(rows[int(at_max[0])]), second:] = 0.0


@torch.no_grad()
def optimal_token_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl `optimal_token_baseline`: per-column baseline within each prompt group."""
    _check_shapes(token_level_rewards, response_mask)
    _check(token_level_rewards, old_log_probs, sum_pi_squared, rollout_is_weights)
    mask = response_mask.to(token_level_rewards.dtype)
    returns = _reward_to_go(token_level_rewards, mask)
    weights = _path_weights(old_log_probs, sum_pi_squared, mask, rollout_is_weights)
    index, num_groups = group_index(group_ids, returns.shape[0])
    baselines = torch.zeros_like(returns)
    for g in range(num_groups):
        rows = torch.nonzero(index == g).flatten().to(returns.device)
        if rows.numel() < 2:
            continue
        wm = weights[rows] * mask[rows]
        baseline = (returns[rows] * wm).sum(dim=0) / (wm.sum(dim=0) + epsilon)
        baselines[rows] = baseline.unsqueeze(0).expand(rows.numel(), -1)
        if handle_zero_tail:
            _zero_tail(baselines, rows, mask[rows].sum(dim=-1))
    return (returns - baselines) * mask, returns


@torch.no_grad()
def tir_optimal_token_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl `tir_optimal_token_baseline`: as above over policy tokens only (observation gaps
    squeezed out); rows with no policy token get 0 and belong to no group."""
    _check_shapes(token_level_rewards, response_mask)
    _check(token_level_rewards, old_log_probs, sum_pi_squared, rollout_is_weights)
    mask = response_mask.to(token_level_rewards.dtype)
    returns = _reward_to_go(token_level_rewards, mask)
    weights = _path_weights(old_log_probs, sum_pi_squared, mask, rollout_is_weights)
    lengths = mask.sum(dim=-1).long()
    width = int(lengths.max()) if lengths.numel() else 0
    packed_w = weights.new_zeros(returns.shape[0], width)
    packed_g = weights.new_zeros(returns.shape[0], width)
    keep = mask > 0
    for i in range(returns.shape[0]):
        n = int(lengths[i])
        if n:
            packed_w[i, :n] = weights[i, keep[i]]
            packed_g[i, :n] = returns[i, keep[i]]
    index, num_groups = group_index(group_ids, returns.shape[0])
    index = index.to(returns.device)
    baselines = torch.zeros_like(packed_g)
    for g in range(num_groups):
        rows = torch.nonzero((index == g) & (lengths > 0)).flatten()
        if rows.numel() < 2:
            continue
        w = packed_w[rows]
        baselines[rows] = ((packed_g[rows] * w).sum(dim=0) / (w.sum(dim=0) + epsilon)).to(
            baselines.dtype)
        if handle_zero_tail:
            _zero_tail(baselines, rows, lengths[rows])
    packed_adv = packed_g - baselines
    adv = torch.zeros_like(returns)
    for i in range(returns.shape[0]):
        n = int(lengths[i])
        if n:
            adv[i, keep[i]] = packed_adv[i, :n]
    return adv * mask, returns
