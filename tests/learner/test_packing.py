"""Packing: every sequence exactly once, budgets kept, ranks in step, masks right."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.trajectory import ScoredTrajectory, Trajectory
from services.learner.packing import (
    pack,
    padding_fraction_padded,
    plan_micro_batches,
    response_tensors,
    sample_from_trajectory,
    set_response_matrix,
    split_mini_batches,
)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_plan_covers_each_sequence_once_within_budget(world: int) -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(5, 300, 37).tolist() + [700]  # one longer than the budget
    plan = plan_micro_batches(lengths, world, 512)
    assert len(plan) == world
    assert len({len(per_rank) for per_rank in plan}) == 1  # same micro count on every rank
    flat = sorted(i for per_rank in plan for micro in per_rank for i in micro)
    assert flat == list(range(len(lengths)))
    for per_rank in plan:
        for micro in per_rank:
            total = sum(lengths[i] for i in micro)
            assert total <= 512 or (len(micro) == 1 and lengths[micro[0]] > 512)


def test_plan_with_fewer_sequences_than_ranks_has_empty_bins(samples_factory) -> None:
    make_samples = samples_factory
    plan = plan_micro_batches([10], 2, 100)
    assert plan == [[[0]], [[]]]
    dummy = pack(make_samples(1), [])
    assert dummy.num_tokens == 1 and dummy.num_padding == 1 and float(dummy.loss_mask.sum()) == 0


def test_pack_restarts_positions_and_keeps_fields(samples_factory) -> None:
    make_samples = samples_factory
    samples = make_samples(3, with_rl=True)
    mb = pack(samples, [2, 0])
    n2, n0 = len(samples[2]), len(samples[0])
    assert mb.num_tokens == n2 + n0 and mb.num_padding == 0
    assert mb.position_ids[0, 0] == 0 and mb.position_ids[0, n2] == 0
    assert mb.position_ids[0, n2 - 1] == n2 - 1
    assert torch.equal(mb.input_ids[0, n2:], torch.from_numpy(samples[0].input_ids))
    rows = mb.response_matrix(mb.fields["advantages"])
    assert rows.shape == (2, max(n2, n0) - 8)
    assert torch.allclose(rows[1, : n0 - 8], torch.from_numpy(samples[0].response_field("advantages")))


def test_sample_from_trajectory_masks_prompt_and_observations() -> None:
    traj = Trajectory(
        uid="u", sample_id="s", data_source="d", policy_version=3,
        prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7, 8],
        loss_mask=[1, 1, 0, 0, 1], rollout_logprobs=[-0.1, -0.2, 0, 0, -0.5],
    )
    sample = sample_from_trajectory(traj)
    assert sample.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert sample.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    assert np.allclose(sample.fields["rollout_logprobs"], [0, 0, 0, -0.1, -0.2, 0, 0, -0.5])
    tensors = response_tensors([sample], rewards=[2.5])
    assert tensors["token_level_rewards"].tolist() == [[0, 0, 0, 0, 2.5]]  # last policy token
    assert tensors["response_mask"].tolist() == [[1, 1, 0, 0, 1]]
    set_response_matrix([sample], "advantages", torch.arange(5.0).unsqueeze(0))
    assert sample.fields["advantages"].tolist() == [0, 0, 0, 0, 1, 2, 3, 4]
    ScoredTrajectory(traj, 1.0)  # the record the learner receives wraps the same trajectory


def test_response_tensors_groups_by_uid(samples_factory) -> None:
    make_samples = samples_factory
    samples = make_samples(6)
    assert response_tensors(samples)["group_ids"].tolist() == [0, 0, 1, 1, 2, 2]


def test_split_mini_batches_and_padding_fraction() -> None:
    assert split_mini_batches(5, 0) == [[0, 1, 2, 3, 4]]
    assert split_mini_batches(5, 2) == [[0, 1], [2, 3], [4]]
    assert padding_fraction_padded([10, 30], 2) == pytest.approx(1 - 40 / 60)


def test_packed_logprobs_equal_one_by_one(tiny_policy, samples_factory) -> None:
    """The block-diagonal mask from restarted position ids: packing changes no log-prob."""
    from transformers import AutoModelForCausalLM

    from services.learner.logprobs import forward_logits, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy), attn_implementation="sdpa")
    model.eval()
    samples = samples_factory(3)
    with torch.no_grad():
        mb = pack(samples, [0, 1, 2])
        packed = token_logprobs(forward_logits(model, mb), mb.input_ids)
        for index, (sample, start) in enumerate(zip(samples, mb.seq_starts, strict=True)):
            one = pack(samples, [index])
            alone = token_logprobs(forward_logits(model, one), one.input_ids)
            n = len(sample)
            assert torch.allclose(packed[0, start + 1 : start + n], alone[0, 1:], atol=1e-5)
