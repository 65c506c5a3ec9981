"""GRPO variants of verl 0.9.1: Pass@k credit (`grpo_passk`), GPG's rescaled baseline (`gpg`)
and GDPO's per-reward normalisation (`gdpo`). Same calling convention as advantages.py.

Definitions follow verl 0.9.1's `core_algos.py` (read from the PyPI wheel) and the trainer's
`compute_advantage`, which decides what each receives (reference/algorithms.md section 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.learner.algorithms.advantages import GroupIds, _check_shapes, _scores, grpo
from services.learner.algorithms.masked import group_index, group_stats, masked_whiten


@torch.no_grad()
def grpo_passk(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (arXiv 2503.19595): only each group's best response gets credit,
    r_max - r_second, divided by (unbiased std + eps) when `norm_adv_by_std`; every other row
    gets 0. A group of one raises, as in verl (Pass@k needs a runner-up). Ties: the advantage
    is 0 whichever row is called best."""
    _check_shapes(token_level_rewards, response_mask)
    scores = _scores(token_level_rewards)
    index, num_groups = group_index(group_ids, scores.shape[0])
    index = index.to(scores.device)
    count, _, std = group_stats(scores, index, num_groups)
    adv = torch.zeros_like(scores)
    for g in range(num_groups):
        rows = torch.nonzero(index == g).flatten()
        if int(count[g]) < 2:
            raise ValueError(f"grpo_passk needs at least 2 samples per group; group {g} has "
                             f"{int(count[g])} (data.n_samples)")
        group = scores[rows]
        top = torch.topk(group, 2)
        value = top.values[0] - top.values[1]
        if norm_adv_by_std:
            value = value / (std[g] + epsilon)
        adv[rows[int(torch.argmax(group))]] = value
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@torch.no_grad()
def gpg(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    f_norm: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (arXiv 2504.02546): A = alpha (r - mean_g) / f_norm with alpha = B / #{r != 0} (the
    batch size over the number of nonzero rewards, at least 1): the gradient of a batch where
    few rows score is scaled back up. A singleton's mean is 0 (verl)."""
    _check_shapes(token_level_rewards, response_mask)
    scores = _scores(token_level_rewards)
    index, num_groups = group_index(group_ids, scores.shape[0])
    index = index.to(scores.device)
    count, mean, _ = group_stats(scores, index, num_groups)
    mean = torch.where(count == 1, torch.zeros_like(mean), mean)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    adv = (alpha * (scores - mean[index]) / f_norm).unsqueeze(-1) * response_mask
    return adv, adv


@torch.no_grad()
def gdpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    component_scores: torch.Tensor | Sequence[Sequence[float]] | None = None,
    weights: Sequence[float] | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (arXiv 2601.05242): GRPO on each reward component separately, a weighted sum of the
    component advantages, then whitening over all masked tokens of the batch (·mask).

    `component_scores` (K, batch) are the per-component rewards (the scorer's
    `reward_components` named by `learner.algorithm.gdpo_reward_keys`); without them the row
    reward is the one component, as verl falls back to. Note verl's trainer never passes its
    `norm_adv_by_std_in_grpo` to gdpo (so it is always True there); here the flag is honoured.
    """
    _check_shapes(token_level_rewards, response_mask)
    if component_scores is None:
        components = [_scores(token_level_rewards)]
    else:
        stacked = torch.as_tensor(component_scores, dtype=token_level_rewards.dtype,
                                  device=token_level_rewards.device)
        if stacked.dim() != 2 or stacked.shape[1] != token_level_rewards.shape[0]:
            raise ValueError(f"component_scores must be (K, {token_level_rewards.shape[0]}), "
                             f"got {tuple(stacked.shape)}")
        components = list(stacked)
    if weights is None:
        weights = [1.0] * len(components)
    if len(weights) != len(components):
        raise ValueError(f"gdpo has {len(weights)} weights for {len(components)} reward "
                         "components")
    total = torch.zeros_like(token_level_rewards)
    for weight, score in zip(weights, components, strict=True):
        rewards = torch.zeros_like(token_level_rewards)
        rewards[:, -1] = score  # outcome estimators read the row sum only
        adv, _ = grpo(rewards, response_mask, group_ids, epsilon=epsilon,
                      norm_adv_by_std=norm_adv_by_std)
        total = total + float(weight) * adv
    adv = masked_whiten(total, response_mask) * response_mask
    return adv, adv
