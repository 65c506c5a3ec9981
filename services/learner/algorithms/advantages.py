"""Advantage estimators: `fn(token_level_rewards, response_mask, group_ids, **options)`.

Every estimator takes `(batch, T)` tensors and returns `(advantages, returns)` of the same shape.
Trajectory-level (outcome) rewards arrive as `token_level_rewards` with the scalar on the last
response token and zeros elsewhere (verl's convention); outcome estimators use the row sum, so
where the scalar sits does not matter to them, while the token-level ones (gae,
reinforce_plus_plus, remax) discount from where it sits. `group_ids` is a `(batch,)` int tensor
or any sequence of hashable ids (e.g. the trajectory `uid`s); estimators that need no groups
ignore it.

Defaults reproduce verl (reference/algorithms.md section 1). Where verl, TRL and rllm disagree an
explicit keyword selects the variant, so a config names the behaviour it wants instead of
inheriting whichever library this code happened to mirror.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

import torch

from services.learner.algorithms.masked import group_index, group_stats, masked_whiten

GroupIds = torch.Tensor | Sequence[Hashable]
Singleton = Literal["raw", "zero"]


def _scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    # verl sums over the whole row, unmasked: the scalar may sit on a token the loss ignores.
    return token_level_rewards.sum(dim=-1)


def _check_shapes(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> None:
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            "token_level_rewards and response_mask must be (batch, T) tensors of one shape, got "
            f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}"
        )


def _check_singleton(singleton: str) -> None:
    if singleton not in ("raw", "zero"):
        raise ValueError(f"singleton must be 'raw' (verl) or 'zero', got {singleton!r}")


@torch.no_grad()
def grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
    unbiased_std: bool = True,
    std_scope: Literal["group", "batch"] = "group",
    singleton: Singleton = "raw",
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: A = (r - mean_g) / (std_g + eps); `norm_adv_by_std=False` is Dr. GRPO (A = r - mean_g).

    Variants: verl = defaults; TRL = `epsilon=1e-4` (+ `std_scope="batch"` for
    scale_rewards="batch"); rllm = `unbiased_std=False`. A singleton group gets mean 0 and std 1
    as in verl (`singleton="raw"`: A = r / (1 + eps)), or 0 (`singleton="zero"`, rllm/np.std).
    """
    _check_shapes(token_level_rewards, response_mask)
    _check_singleton(singleton)
    if std_scope not in ("group", "batch"):
        raise ValueError(f"std_scope must be 'group' or 'batch', got {std_scope!r}")
    scores = _scores(token_level_rewards)
    index, num_groups = group_index(group_ids, scores.shape[0])
    index = index.to(scores.device)
    count, mean, std = group_stats(scores, index, num_groups, unbiased=unbiased_std)
    single = count == 1
    std = torch.where(single, torch.ones_like(std), std)
    if singleton == "raw":
        mean = torch.where(single, torch.zeros_like(mean), mean)
    if std_scope == "batch":
        if scores.numel() > 1:
            batch_std = scores.std(correction=1 if unbiased_std else 0)
        else:
            batch_std = scores.new_ones(())
        std = batch_std.expand_as(std)
    adv = scores - mean[index]
    if norm_adv_by_std:
        adv = adv / (std[index] + epsilon)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@torch.no_grad()
def rloo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    singleton: Singleton = "raw",
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: A = r - mean of the others = n/(n-1) (r - mean_g).

    A singleton keeps its raw reward (verl `rloo`, `singleton="raw"`) or gets 0 (verl
    `rloo_vectorized`, `singleton="zero"`).
    """
    _check_shapes(token_level_rewards, response_mask)
    _check_singleton(singleton)
    scores = _scores(token_level_rewards)
    index, num_groups = group_index(group_ids, scores.shape[0])
    index = index.to(scores.device)
    count, mean, _ = group_stats(scores, index, num_groups)
    n = count[index]
    loo = n / (n - 1).clamp(min=1) * (scores - mean[index])
    alone = scores if singleton == "raw" else torch.zeros_like(scores)
    adv = torch.where(n > 1, loo, alone).unsqueeze(-1) * response_mask
    return adv, adv


@torch.no_grad()
def opo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: the baseline is the length-weighted group mean sum(L_j r_j) / sum(L_j), L = mask sum.

    A singleton has baseline 0 (verl). A group whose responses are all empty falls back to the
    plain mean instead of dividing by zero.
    """
    _check_shapes(token_level_rewards, response_mask)
    scores = _scores(token_level_rewards)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)
    index, num_groups = group_index(group_ids, scores.shape[0])
    index = index.to(scores.device)
    count, mean, _ = group_stats(scores, index, num_groups)
    weighted = scores.new_zeros(num_groups).index_add_(0, index, lengths * scores)
    total_len = scores.new_zeros(num_groups).index_add_(0, index, lengths)
    baseline = torch.where(total_len > 0, weighted / total_len.clamp(min=1e-12), mean)
    baseline = torch.where(count == 1, torch.zeros_like(baseline), baseline)
    adv = (scores - baseline[index]).unsqueeze(-1) * response_mask
    return adv, adv


@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    normalize: Literal["token_whiten", "seq_std"] = "token_whiten",
    epsilon: float = 1e-6,
    singleton: Singleton = "raw",
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline, then batch normalisation.

    verl (`normalize="token_whiten"`): s = r - mean_g tiled over the mask, whitened over all
    masked tokens of the batch (token-weighted statistics; `epsilon` unused). rllm
    (`normalize="seq_std"`, usually with `singleton="zero"`): A = s / (std_biased(s over rows)
    + epsilon), no re-centering.
    """
    _check_shapes(token_level_rewards, response_mask)
    _check_singleton(singleton)
    scores = _scores(token_level_rewards)
    index, num_groups = group_index(group_ids, scores.shape[0])
    index = index.to(scores.device)
    count, mean, _ = group_stats(scores, index, num_groups)
    if singleton == "raw":
        mean = torch.where(count == 1, torch.zeros_like(mean), mean)
    centred = scores - mean[index]
    if normalize == "token_whiten":
        tiled = centred.unsqueeze(-1) * response_mask
        adv = masked_whiten(tiled, response_mask) * response_mask
    elif normalize == "seq_std":
        adv = (centred / (centred.std(correction=0) + epsilon)).unsqueeze(-1) * response_mask
    else:
        raise ValueError(f"normalize must be 'token_whiten' or 'seq_std', got {normalize!r}")
    return adv, adv


@torch.no_grad()
def reinforce_plus_plus(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds | None = None,
    *,
    gamma: float = 1.0,
    gap_mode: Literal["carry", "reset"] = "carry",
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted reward-to-go, whitened over all masked tokens of the batch.

    Inside a mask gap (an observation span) verl 0.9.1 carries the running return across the gap
    and writes 0 there (`gap_mode="carry"`); verl 0.8 writes the running value and restarts the
    return at the gap (`gap_mode="reset"`). Returns are the un-whitened reward-to-go.
    """
    _check_shapes(token_level_rewards, response_mask)
    if gap_mode not in ("carry", "reset"):
        raise ValueError(f"gap_mode must be 'carry' or 'reset', got {gap_mode!r}")
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        candidate = token_level_rewards[:, t] + gamma * running
        if gap_mode == "carry":
            returns[:, t] = candidate * mask[:, t]
            running = mask[:, t] * candidate + (1 - mask[:, t]) * running
        else:
            returns[:, t] = candidate
            running = candidate * mask[:, t]
    adv = masked_whiten(returns, response_mask) * response_mask
    return adv, returns


@torch.no_grad()
def remax(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds | None = None,
    *,
    reward_baselines: torch.Tensor | Sequence[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: reward-to-go minus the reward of the greedy response to the same prompt.

    `reward_baselines` (batch,) is the scorer's reward for a greedy (temperature 0) rollout of
    each row's prompt; the learner obtains it by issuing one greedy sample per group.
    """
    _check_shapes(token_level_rewards, response_mask)
    baselines = torch.as_tensor(
        reward_baselines, dtype=token_level_rewards.dtype, device=token_level_rewards.device
    )
    if baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"reward_baselines must have shape ({token_level_rewards.shape[0]},), "
            f"got {tuple(baselines.shape)}"
        )
    masked = token_level_rewards * response_mask
    returns = masked.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    adv = returns - baselines.unsqueeze(-1) * response_mask
    return adv, returns


@torch.no_grad()
def gae(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds | None = None,
    *,
    values: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with a critic (PPO). Mask gaps are skipped: value and GAE carry across them (verl).

    Returns (= A + V) are taken before whitening; the whitened advantages are not re-masked,
    exactly as verl, since the loss masks them anyway.
    """
    _check_shapes(token_level_rewards, response_mask)
    if values.shape != token_level_rewards.shape:
        raise ValueError(f"values must have shape {tuple(token_level_rewards.shape)}")
    mask = response_mask.to(token_level_rewards.dtype)
    next_value = torch.zeros_like(token_level_rewards[:, 0])
    last_gae = torch.zeros_like(next_value)
    reversed_adv = []
    for t in reversed(range(token_level_rewards.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last_gae
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last_gae = candidate * mask[:, t] + (1 - mask[:, t]) * last_gae
        reversed_adv.append(last_gae)
    adv = torch.stack(reversed_adv[::-1], dim=1)
    returns = adv + values
    if whiten:
        adv = masked_whiten(adv, response_mask)
    return adv, returns
