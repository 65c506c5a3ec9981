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
    plan_shared_rows,
    prompt_key,
    prompt_units,
    response_tensors,
    sample_from_trajectory,
    set_response_matrix,
    split_mini_batches,
    spread_units,
    unit_tokens,
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


# ------------------------------------------------------------------------ shared prompts


def test_prompt_units_group_identical_prompts_and_fit_the_budget(group_samples_factory) -> None:
    samples = group_samples_factory(groups=2, per_group=4, lone=2)
    units = prompt_units(samples, list(range(len(samples))), max_tokens=10_000)
    assert units == [[0, 1, 2, 3], [4, 5, 6, 7], [8], [9]]
    prompt = samples[0].prompt_len
    assert unit_tokens(samples, units[0]) == (prompt - 1) + sum(
        len(samples[i]) - prompt + 1 for i in units[0])
    assert unit_tokens(samples, [8]) == len(samples[8])
    # A budget that holds the prompt and two responses cuts the group in pairs.
    two = unit_tokens(samples, [0, 1])
    cut = prompt_units(samples, [0, 1, 2, 3], max_tokens=max(two, unit_tokens(samples, [2, 3])))
    assert cut == [[0, 1], [2, 3]]
    # A prompt of one token, or one that carries loss, is not shared.
    head = samples[0]
    assert prompt_key(type(head)(head.input_ids, head.loss_mask, prompt_len=1)) is None
    lossy = head.loss_mask.copy()
    lossy[3] = 1.0
    assert prompt_key(type(head)(head.input_ids, lossy, prompt_len=head.prompt_len)) is None


def test_shared_pack_lays_out_each_prompt_once(group_samples_factory) -> None:
    samples = group_samples_factory(groups=1, per_group=3, lone=1, with_rl=True)
    mb = pack(samples, [3, 0, 1, 2], share_prompts=True)
    prompt = samples[0].prompt_len
    assert mb.sample_indices == [3, 0, 1, 2]  # groups in order of first appearance
    assert mb.shared_lens == [0, prompt - 1, prompt - 1, prompt - 1]
    assert mb.num_tokens == len(samples[3]) + unit_tokens(samples, [0, 1, 2])
    mask = mb.attention_mask[0, 0]
    for row, index in enumerate(mb.sample_indices):
        # Every sequence reads back exactly its tokens, loss mask and fields.
        assert np.array_equal(mb.sample_values(mb.input_ids, row).numpy(), samples[index].input_ids)
        assert np.array_equal(mb.sample_values(mb.loss_mask, row).numpy(), samples[index].loss_mask)
        assert np.array_equal(mb.sample_values(mb.fields["advantages"], row).numpy(),
                              samples[index].fields["advantages"])
        positions = mb.sample_values(mb.position_ids, row).numpy()
        assert np.array_equal(positions, np.arange(len(samples[index])))
    # Branches see the prompt and themselves, never each other or the lone sample.
    b0, b1 = mb.seq_starts[1], mb.seq_starts[2]
    prefix = mb.prefix_runs[1][0][0]
    assert mask[b0, prefix : prefix + prompt - 1].all()
    assert not mask[b1, b0 : b0 + 2].any()
    assert not mask[b0, : len(samples[3])].any()
    assert mask[b0 + 2, b0 : b0 + 3].all() and not mask[b0 + 2, b0 + 3]
    # The response matrix reads responses from the branches.
    adv = mb.response_matrix(mb.fields["advantages"])
    for row, index in enumerate(mb.sample_indices):
        resp = samples[index].response_field("advantages")
        assert np.array_equal(adv[row, : len(resp)].numpy(), resp)
    # Without share_prompts the same indices pack contiguously, as before.
    plain = pack(samples, [3, 0, 1, 2])
    assert plain.attention_mask is None and not plain.is_shared
    assert plain.num_tokens == sum(len(s) for s in samples)


def test_shared_prompt_logprobs_equal_one_by_one(tiny_policy, group_samples_factory) -> None:
    """The shared layout changes no log-prob of any token that can carry loss."""
    from transformers import AutoModelForCausalLM

    from services.learner.logprobs import forward_logits, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy), attn_implementation="sdpa")
    model.eval()
    samples = group_samples_factory(groups=2, per_group=3, lone=1)
    with torch.no_grad():
        mb = pack(samples, list(range(len(samples))), share_prompts=True)
        assert mb.is_shared
        shared = token_logprobs(forward_logits(model, mb), mb.input_ids)
        for row, index in enumerate(mb.sample_indices):
            one = pack(samples, [index])
            alone = token_logprobs(forward_logits(model, one), one.input_ids)[0]
            got = mb.sample_values(shared, row)
            p = samples[index].prompt_len
            assert torch.allclose(got[p:], alone[p:], atol=1e-5), index


def test_a_common_instruction_and_group_prompts_share_as_a_tree(group_samples_factory) -> None:
    """Prompts that start alike (a task's instruction) share that start across groups, and each
    group shares the rest of its prompt: every sequence still reads back exactly its tokens."""
    samples = group_samples_factory(groups=3, per_group=2, lone=2, with_rl=True)
    instruction = np.arange(100, 112)
    for sample in samples:  # prepend one instruction to every prompt
        sample.input_ids = np.concatenate([instruction, sample.input_ids])
        sample.loss_mask = np.concatenate([np.zeros(12, np.float32), sample.loss_mask])
        sample.fields = {k: np.concatenate([np.zeros(12, np.float32), v])
                         for k, v in sample.fields.items()}
        sample.prompt_len += 12
    indices = list(range(len(samples)))
    mb = pack(samples, indices, share_prompts=True)
    saved = sum(len(s) for s in samples) - mb.num_tokens
    groups = [samples[2 * g] for g in range(3)]
    # The instruction once instead of 8 times; each group's prompt once instead of twice.
    assert saved == 12 * 7 + sum(s.prompt_len - 1 - 12 for s in groups)
    for row, index in enumerate(mb.sample_indices):
        assert np.array_equal(mb.sample_values(mb.input_ids, row).numpy(), samples[index].input_ids)
        assert np.array_equal(mb.sample_values(mb.position_ids, row).numpy(),
                              np.arange(len(samples[index])))
        assert mb.prefix_runs[row][0] == (0, 12)  # the instruction segment
    assert sorted(mb.sample_indices) == indices


def test_one_group_is_split_so_every_rank_has_real_sequences(group_samples_factory) -> None:
    """A batch of one GRPO group on 2 ranks: each rank gets half the group (each half computes
    the prompt once), not one rank the whole group and the other a dummy pass."""
    samples = group_samples_factory(groups=1, per_group=4, lone=0)
    indices = list(range(len(samples)))
    plan = plan_shared_rows(samples, indices, 2, 10_000)
    per_rank = [sorted(i for micro in rank for i in micro) for rank in plan]
    assert per_rank == [[0, 1], [2, 3]] or per_rank == [[2, 3], [0, 1]]
    assert plan_shared_rows(samples, indices, 1, 10_000) == [[indices]]
    assert spread_units([[0, 1, 2], [3]], 3) == [[0, 1], [2], [3]]
    assert spread_units([[0], [1]], 4) == [[0], [1]]  # nothing left to split


@pytest.mark.parametrize("budget", [60, 150, 400])
def test_shared_rows_keep_the_budget_and_every_sequence_once(group_samples_factory,
                                                             budget: int) -> None:
    samples = group_samples_factory(groups=5, per_group=4, lone=3)
    indices = list(range(len(samples)))
    for world in (1, 2):
        plan = plan_shared_rows(samples, indices, world, budget)
        seen = sorted(i for rank in plan for micro in rank for i in micro)
        assert seen == indices
        assert len({len(rank) for rank in plan}) == 1  # ranks stay in step
        for rank in plan:
            for micro in rank:
                if len(prompt_units(samples, micro, budget)) > 1:  # oversize units sit alone
                    assert pack(samples, micro, share_prompts=True).num_tokens <= budget
