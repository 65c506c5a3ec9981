"""Multi-turn credit: stepwise broadcast / per-step (rllm semantics) on hand-computed rows."""

from __future__ import annotations

import pytest
import torch

from services.common.trajectory import Turn
from services.learner.algorithms import (
    compute_advantage,
    grpo,
    step_regions,
    stepwise_broadcast,
    stepwise_per_step,
)

F64 = torch.float64

# Three samples of prompt "u". Rows 0 and 1: two turns, policy tokens [0,2) and [4,6), observation
# [2,4) (mask 0). Row 2: one turn [0,3). Outcome rewards 1, 0, 1 on the last policy token.
MASK = torch.tensor(
    [
        [1, 1, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
    ],
    dtype=F64,
)
TLR = torch.zeros_like(MASK)
TLR[0, 5] = 1.0
TLR[2, 2] = 1.0
TURNS = [[(0, 2), (4, 6)], [(0, 2), (4, 6)], [(0, 3)]]
UIDS = ["u", "u", "u"]
DR = {"norm_adv_by_std": False}  # Dr. GRPO keeps the hand arithmetic to means


def test_step_regions():
    assert step_regions([(0, 2), (4, 6)], 8) == [(0, 4), (4, 8)]
    assert step_regions([], 5) == [(0, 5)]
    assert step_regions([(1, 2)], 4) == [(0, 4)]  # the first step starts at 0
    assert step_regions([Turn(0, 2, "search"), {"start": 5, "end": 7}], 8) == [(0, 5), (5, 8)]


def test_per_step_mc_returns_grouped_by_step():
    adv, ret = stepwise_per_step(TLR, MASK, UIDS, TURNS, gamma=0.5, **DR)
    # step returns: row0 G = [0.5, 1]; row1 [0, 0]; row2 [1].
    # group (u,0) = [0.5, 0, 1] mean 0.5 -> 0, -0.5, 0.5; group (u,1) = [1, 0] -> +0.5, -0.5
    expected = torch.tensor(
        [
            [0.0, 0.0, 0, 0, 0.5, 0.5, 0, 0],
            [-0.5, -0.5, 0, 0, -0.5, -0.5, 0, 0],
            [0.5, 0.5, 0.5, 0, 0, 0, 0, 0],
        ],
        dtype=F64,
    )
    assert torch.allclose(adv, expected)
    assert torch.allclose(ret, expected)


def test_per_step_gamma_zero_uses_raw_step_rewards():
    adv, _ = stepwise_per_step(TLR, MASK, UIDS, TURNS, gamma=0.0, **DR)
    # group (u,0) = [0, 0, 1] mean 1/3; group (u,1) = [1, 0]
    assert adv[0, 0] == pytest.approx(-1 / 3) and adv[0, 4] == pytest.approx(0.5)
    assert adv[2, 0] == pytest.approx(2 / 3)


def test_per_step_single_turn_rows_equal_trajectory_level():
    mask = MASK[:, :4].clone()
    mask[:, 2] = 1
    tlr = torch.zeros_like(mask)
    tlr[:, 3] = torch.tensor([1.0, 0.0, 0.5], dtype=F64)
    spans = [[(0, 4)], [], [(0, 4)]]
    per_step, _ = stepwise_per_step(tlr, mask, UIDS, spans)
    whole, _ = grpo(tlr, mask, UIDS)
    assert torch.allclose(per_step, whole)


def test_broadcast_last_step_advantage_to_every_step():
    adv, ret = stepwise_broadcast(TLR, MASK, UIDS, TURNS, **DR)
    # last steps grouped by prompt: rewards [1, 0, 1], mean 2/3 -> 1/3, -2/3, 1/3 on every step
    expected = MASK * torch.tensor([[1 / 3], [-2 / 3], [1 / 3]], dtype=F64)
    assert torch.allclose(adv, expected)
    assert torch.allclose(ret, expected)


def test_broadcast_normalize_by_steps_and_group_by_steps():
    adv, _ = stepwise_broadcast(TLR, MASK, UIDS, TURNS, normalize_by_steps=True, **DR)
    expected = MASK * torch.tensor([[1 / 6], [-1 / 3], [1 / 3]], dtype=F64)
    assert torch.allclose(adv, expected)
    # rllm workflow trainer: only trajectories with equal step counts share a group;
    # row 2 is then a singleton (Dr. GRPO singleton: r - 0 = 1).
    adv, _ = stepwise_broadcast(TLR, MASK, UIDS, TURNS, group_by="prompt_and_steps", **DR)
    expected = MASK * torch.tensor([[0.5], [-0.5], [1.0]], dtype=F64)
    assert torch.allclose(adv, expected)


def test_broadcast_last_step_statistics_only_see_the_last_step():
    # opo weighs by length: only the last step's length counts (rows 0,1: 2 tokens, row 2: 3).
    adv, _ = stepwise_broadcast(TLR, MASK, UIDS, TURNS, estimator="opo")
    baseline = (2 * 1.0 + 2 * 0.0 + 3 * 1.0) / 7
    assert adv[0, 0] == pytest.approx(1 - baseline)
    assert adv[1, 4] == pytest.approx(-baseline)


def test_compute_advantage_dispatch_and_errors():
    whole, _ = compute_advantage(TLR, MASK, UIDS, estimator="rloo")
    direct, _ = compute_advantage(TLR, MASK, UIDS, estimator="rloo", mode="trajectory")
    assert torch.equal(whole, direct)
    per_step, _ = compute_advantage(
        TLR, MASK, UIDS, mode="per_step", turn_spans=TURNS, step_gamma=0.5, **DR
    )
    assert per_step[0, 4] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="needs turn_spans"):
        compute_advantage(TLR, MASK, UIDS, mode="broadcast")
    with pytest.raises(ValueError, match="per-row inputs"):
        stepwise_per_step(TLR, MASK, UIDS, TURNS, estimator="gae", values=TLR)
    with pytest.raises(ValueError, match="unknown multi-turn mode"):
        compute_advantage(TLR, MASK, UIDS, mode="tree", turn_spans=TURNS)
