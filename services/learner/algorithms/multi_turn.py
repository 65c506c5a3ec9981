"""Multi-turn credit assignment: trajectory-level, stepwise broadcast, stepwise per-step (rllm).

Our trajectories keep all turns in one row (policy tokens + observation tokens), with each turn's
policy tokens at response positions [start, end) (`Trajectory.turns`). rllm makes one row per
step instead; here step k of a row is the region [start_k, start_{k+1}) (the last step runs to
the end of the row, the first from 0), i.e. a turn's tokens plus the observation that follows it.
The stepwise modes build one virtual row per step (the row's mask restricted to the region),
run an ordinary estimator over those, and write the results back into the original rows, so
any group-based estimator works per step without a second code path.

- trajectory (default): the estimator on whole rows.
- broadcast: the estimator on each trajectory's LAST step (reward = the row's total reward);
  its mean advantage over that step's tokens, a, goes to every earlier step's tokens
  (advantages = returns = a * mask). `normalize_by_steps` divides a by the number of steps and
  sets the last step to a too (rllm's option). Groups: the prompt uid (`group_by="prompt"`,
  rllm legacy) or uid and step count (`"prompt_and_steps"`, rllm's workflow trainer, where only
  trajectories of equal length share a group).
- per_step: step rewards r_k (the row's token rewards summed over the region; an outcome reward
  lands in the last step) become discounted Monte-Carlo returns G_k = r_k + gamma G_{k+1}; step
  k of every sample of a prompt forms one group (uid, k), as rllm's step ids do. The default
  gamma is 0.2, the discount rllm's AgentExecutionEngine computes its per-step MC returns with
  (rllm/engine/agent_execution_engine.py, `gamma=0.2`, before commit 6d5c2c59 removed that
  stack); `gamma=0` uses the raw step rewards (rllm's workflow default).

Loss rows. rllm trains each step as its own row (prompt = the context so far, response = that
step's tokens), so the seq-mean aggregation modes weight every step equally; here a
trajectory is one row. `step_index_row` labels each response position with its step and
`step_rows` expands (batch, T) loss matrices to one row per step, so the trainer can aggregate
exactly as rllm does (`learner.algorithm.loss_rows`). token-mean is the same either way.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Literal

import torch

from services.learner.algorithms.advantages import GroupIds
from services.learner.algorithms.masked import masked_mean
from services.learner.algorithms.registry import NEEDS_ROW_INPUTS, Estimator, get_adv_estimator_fn

TurnSpans = Sequence[Sequence[Any]]
MULTI_TURN_MODES: tuple[str, ...] = ("trajectory", "broadcast", "per_step")


def _span(turn: Any) -> tuple[int, int]:
    """(start, end) from a tuple, a `Turn`, or a decoded turn dict."""
    if isinstance(turn, dict):
        return int(turn["start"]), int(turn["end"])
    if hasattr(turn, "start") and hasattr(turn, "end"):
        return int(turn.start), int(turn.end)
    start, end = turn
    return int(start), int(end)


def step_regions(turns: Sequence[Any], length: int) -> list[tuple[int, int]]:
    """Disjoint regions [start_k, start_{k+1}) covering [0, length); one region if no turns."""
    starts = sorted({min(max(_span(t)[0], 0), length) for t in turns})
    if not starts:
        return [(0, length)]
    starts[0] = 0
    bounds = starts + [length]
    return [(bounds[k], bounds[k + 1]) for k in range(len(starts)) if bounds[k] < bounds[k + 1]]


def step_index_row(turns: Sequence[Any], length: int) -> list[int]:
    """The step k of every response position (the regions of `step_regions`)."""
    out = [0] * length
    for k, (start, stop) in enumerate(step_regions(turns, length)):
        out[start:stop] = [k] * (stop - start)
    return out


def step_rows(step_index: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rllm's one-row-per-step layout of (batch, T) loss matrices.

    Returns (rows, step_mask): step row s comes from row `rows[s]` and keeps only the tokens of
    its step (`step_mask[s]`). Steps with no loss token are left out, as rllm drops pad steps.
    Use as `agg_loss(loss_mat[rows], step_mask, mode)`.
    """
    rows: list[int] = []
    masks: list[torch.Tensor] = []
    for i in range(mask.shape[0]):
        active = mask[i] > 0
        for k in torch.unique(step_index[i][active]).tolist():
            rows.append(i)
            masks.append(mask[i] * (step_index[i] == k).to(mask.dtype))
    index = torch.tensor(rows, dtype=torch.long, device=mask.device)
    if not masks:
        return index, mask.new_zeros((0, mask.shape[1]))
    return index, torch.stack(masks)


def count_step_rows(step_index: Sequence[float], loss_mask: Sequence[float]) -> int:
    """Number of steps with at least one loss token (the sequence count of step rows)."""
    return len({int(k) for k, m in zip(step_index, loss_mask, strict=True) if m > 0})


def _group_keys(group_ids: GroupIds, batch: int) -> list[Hashable]:
    keys = (
        group_ids.reshape(-1).tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    )
    if len(keys) != batch:
        raise ValueError(f"group_ids has {len(keys)} entries for a batch of {batch} rows")
    return keys


def _check_turns(turn_spans: TurnSpans, batch: int) -> None:
    if len(turn_spans) != batch:
        raise ValueError(f"turn_spans has {len(turn_spans)} rows for a batch of {batch}")


def _resolve(estimator: str | Estimator) -> Estimator:
    if isinstance(estimator, str) and estimator in NEEDS_ROW_INPUTS:
        raise ValueError(
            f"estimator {estimator!r} needs per-row inputs; stepwise modes cannot use it"
        )
    return get_adv_estimator_fn(estimator)


def _virtual_row(
    mask_row: torch.Tensor, region: tuple[int, int], reward: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards, mask) of one step as a full-length row; the reward sits on its last mask token."""
    start, stop = region
    vmask = torch.zeros_like(mask_row)
    vmask[start:stop] = mask_row[start:stop]
    nonzero = torch.nonzero(vmask > 0).reshape(-1)
    where = int(nonzero[-1]) if nonzero.numel() else stop - 1
    vrew = torch.zeros(mask_row.shape[0], dtype=dtype, device=mask_row.device)
    vrew[where] = reward
    return vrew, vmask


@torch.no_grad()
def stepwise_per_step(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    turn_spans: TurnSpans,
    *,
    gamma: float = 0.2,
    estimator: str | Estimator = "grpo",
    **estimator_options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step MC returns, estimator over groups (uid, step k); see the module doc."""
    batch, length = token_level_rewards.shape
    _check_turns(turn_spans, batch)
    keys = _group_keys(group_ids, batch)
    fn = _resolve(estimator)
    rows, rewards, masks, groups = [], [], [], []
    for i in range(batch):
        regions = step_regions(turn_spans[i], length)
        step_rewards = [float(token_level_rewards[i, a:b].sum()) for a, b in regions]
        running = 0.0
        returns = [0.0] * len(regions)
        for k in reversed(range(len(regions))):
            running = step_rewards[k] + gamma * running
            returns[k] = running
        for k, region in enumerate(regions):
            vrew, vmask = _virtual_row(
                response_mask[i], region, returns[k], token_level_rewards.dtype
            )
            rows.append(i)
            rewards.append(vrew)
            masks.append(vmask)
            groups.append((keys[i], k))
    vmask_all = torch.stack(masks)
    vadv, vret = fn(torch.stack(rewards), vmask_all, groups, **estimator_options)
    adv = torch.zeros_like(token_level_rewards)
    ret = torch.zeros_like(token_level_rewards)
    index = torch.tensor(rows, dtype=torch.long, device=adv.device)
    fmask = vmask_all.to(adv.dtype)
    adv.index_add_(0, index, vadv * fmask)
    ret.index_add_(0, index, vret * fmask)
    return adv, ret


@torch.no_grad()
def stepwise_broadcast(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    turn_spans: TurnSpans,
    *,
    estimator: str | Estimator = "grpo",
    normalize_by_steps: bool = False,
    group_by: Literal["prompt", "prompt_and_steps"] = "prompt",
    **estimator_options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last step's advantage broadcast to every step; see the module doc."""
    if group_by not in ("prompt", "prompt_and_steps"):
        raise ValueError(f"group_by must be 'prompt' or 'prompt_and_steps', got {group_by!r}")
    batch, length = token_level_rewards.shape
    _check_turns(turn_spans, batch)
    keys = _group_keys(group_ids, batch)
    fn = _resolve(estimator)
    all_regions = [step_regions(turn_spans[i], length) for i in range(batch)]
    rewards, masks, groups = [], [], []
    for i, regions in enumerate(all_regions):
        total = float(token_level_rewards[i].sum())
        vrew, vmask = _virtual_row(response_mask[i], regions[-1], total, token_level_rewards.dtype)
        rewards.append(vrew)
        masks.append(vmask)
        groups.append(keys[i] if group_by == "prompt" else (keys[i], len(regions)))
    last_mask = torch.stack(masks)
    fmask_last = last_mask.to(token_level_rewards.dtype)
    vadv, vret = fn(torch.stack(rewards), last_mask, groups, **estimator_options)
    scalar = masked_mean(vadv, fmask_last, dim=-1)
    steps = torch.tensor([len(r) for r in all_regions], dtype=scalar.dtype, device=scalar.device)
    if normalize_by_steps:
        scalar = scalar / steps
    fmask = response_mask.to(token_level_rewards.dtype)
    earlier = fmask - fmask_last  # the mask outside the last step
    broadcast = scalar.unsqueeze(-1) * earlier
    if normalize_by_steps:
        adv = broadcast + scalar.unsqueeze(-1) * fmask_last
        ret = adv.clone()
    else:
        adv = broadcast + vadv * fmask_last
        ret = broadcast + vret * fmask_last
    return adv, ret


def compute_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    estimator: str | Estimator = "grpo",
    mode: str = "trajectory",
    turn_spans: TurnSpans | None = None,
    step_gamma: float = 0.2,
    normalize_by_steps: bool = False,
    broadcast_group_by: Literal["prompt", "prompt_and_steps"] = "prompt",
    **estimator_options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One entry point for the trainer: estimator + multi-turn mode (learner.algorithm.*)."""
    if mode == "trajectory":
        fn = get_adv_estimator_fn(estimator)
        return fn(token_level_rewards, response_mask, group_ids, **estimator_options)
    if turn_spans is None:
        raise ValueError(f"multi-turn mode {mode!r} needs turn_spans")
    if mode == "broadcast":
        return stepwise_broadcast(
            token_level_rewards,
            response_mask,
            group_ids,
            turn_spans,
            estimator=estimator,
            normalize_by_steps=normalize_by_steps,
            group_by=broadcast_group_by,
            **estimator_options,
        )
    if mode == "per_step":
        return stepwise_per_step(
            token_level_rewards,
            response_mask,
            group_ids,
            turn_spans,
            gamma=step_gamma,
            estimator=estimator,
            **estimator_options,
        )
    raise ValueError(
        f"unknown multi-turn mode {mode!r}; choose one of {', '.join(MULTI_TURN_MODES)}"
    )
