"""rllm's multi-turn defaults: the per-step MC discount 0.2 and one loss row per step, checked
on hand-computed examples (pure functions and the DeepSpeed trainer's loss)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.trajectory import ScoredTrajectory, Trajectory, Turn
from services.learner.algorithms import (
    AlgorithmSettings,
    agg_loss,
    compute_advantage,
    count_step_rows,
    step_index_row,
    step_rows,
)
from services.learner.rl_batch import samples_of


def test_per_step_discount_defaults_to_rllms_0_2():
    assert AlgorithmSettings().step_gamma == 0.2
    assert AlgorithmSettings(multi_turn="per_step").advantage_options("grpo")["step_gamma"] == 0.2
    # Two samples of one prompt, two steps each (tokens 0-1 and 2-3), outcome rewards 1 and 0.
    # MC returns: step 1 = r, step 0 = 0.2 r. Dr. GRPO (no std) per step group (uid, k):
    # step 1: (1, 0) - 0.5 = +-0.5; step 0: (0.2, 0) - 0.1 = +-0.1.
    mask = torch.ones(2, 4, dtype=torch.float64)
    rewards = torch.zeros(2, 4, dtype=torch.float64)
    rewards[0, 3] = 1.0
    turns = [[(0, 2), (2, 4)], [(0, 2), (2, 4)]]
    adv, _ = compute_advantage(rewards, mask, ["u", "u"], estimator="grpo", mode="per_step",
                               turn_spans=turns, norm_adv_by_std=False)
    expected = torch.tensor([[0.1, 0.1, 0.5, 0.5], [-0.1, -0.1, -0.5, -0.5]],
                            dtype=torch.float64)
    assert torch.allclose(adv, expected)


def test_loss_rows_default_follows_the_multi_turn_mode():
    assert not AlgorithmSettings().step_rows
    assert AlgorithmSettings(multi_turn="per_step").step_rows
    assert AlgorithmSettings(multi_turn="broadcast").step_rows
    assert not AlgorithmSettings(multi_turn="per_step", loss_rows="trajectory").step_rows
    assert AlgorithmSettings(loss_rows="step").step_rows


def test_step_rows_weight_each_step_as_its_own_sequence():
    # Row A: step 0 = tokens 0-1 (loss 1, 3), an observation (mask 0), step 1 = token 3 (5).
    # Row B: one step, tokens 0-2 (2, 2, 8).
    loss = torch.tensor([[1.0, 3.0, 99.0, 5.0], [2.0, 2.0, 8.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    steps = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    rows, smask = step_rows(steps, mask)
    assert rows.tolist() == [0, 0, 1]
    assert smask.tolist() == [[1, 1, 0, 0], [0, 0, 0, 1], [1, 1, 1, 0]]
    per_step = loss[rows]
    # seq-mean-token-mean: trajectories (9/3 + 12/3) / 2 = 3.5; steps (4/2 + 5 + 12/3) / 3.
    assert float(agg_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx(3.5)
    assert float(agg_loss(per_step, smask, "seq-mean-token-mean")) == pytest.approx(11 / 3)
    # seq-mean-token-sum: (9 + 12) / 2 = 10.5 vs (4 + 5 + 12) / 3 = 7.
    assert float(agg_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx(10.5)
    assert float(agg_loss(per_step, smask, "seq-mean-token-sum")) == pytest.approx(7.0)
    # token-mean does not depend on the rows: 21 / 6.
    assert float(agg_loss(per_step, smask, "token-mean")) == pytest.approx(3.5)
    assert float(agg_loss(loss, mask, "token-mean")) == pytest.approx(3.5)
    assert count_step_rows(steps[0].tolist(), mask[0].tolist()) == 2


def test_samples_carry_the_step_of_each_response_token():
    traj = Trajectory(uid="u", sample_id="u:0:0", data_source="nq", policy_version=1,
                      prompt_ids=[1, 2, 3], response_ids=[5, 6, 7, 8, 9],
                      loss_mask=[1, 1, 0, 1, 1], rollout_logprobs=[-1.0] * 5,
                      turns=[Turn(0, 2, "search"), Turn(3, 5, "answer")],
                      finish_reason="answer", num_searches=1)
    assert step_index_row(traj.turns, 5) == [0, 0, 0, 1, 1]
    [sample] = samples_of([ScoredTrajectory(traj, reward=1.0)], step_rows=True)
    assert sample.response_field("step_index").tolist() == [0, 0, 0, 1, 1]
    [plain] = samples_of([ScoredTrajectory(traj, reward=1.0)])
    assert "step_index" not in plain.fields


def two_samples():
    """A: prompt 3, step 0 (2 policy tokens, advantage 1), an observation of 2 tokens, step 1
    (4 policy tokens, advantage 3). B: prompt 3, one step of 3 tokens, advantage 2."""
    from services.learner.packing import Sample

    a_ids = np.arange(10, 21)
    a_mask = np.array([0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1], dtype=np.float32)
    a = Sample(a_ids, a_mask, prompt_len=3, uid="a")
    a.set_response_field("advantages", np.array([1, 1, 0, 0, 3, 3, 3, 3], dtype=np.float32))
    a.set_response_field("step_index", np.array([0, 0, 0, 0, 1, 1, 1, 1], dtype=np.float32))
    b = Sample(np.arange(30, 36), np.array([0, 0, 0, 1, 1, 1], dtype=np.float32),
               prompt_len=3, uid="b")
    b.set_response_field("advantages", np.full(3, 2.0, dtype=np.float32))
    b.set_response_field("step_index", np.zeros(3, dtype=np.float32))
    return [a, b]


@pytest.mark.slow
def test_the_trainers_loss_uses_one_row_per_step(tiny_policy):
    """The ratio is 1 (no old log-probs), so each token's policy loss is -A: with
    seq-mean-token-mean, trajectory rows give -((2*1 + 4*3)/6 + 2)/2 and step rows
    -(1 + 3 + 2)/3."""
    from services.common.config.learner import LearnerSection
    from services.learner.packing import pack
    from services.learner.trainer import PolicyTrainer

    algorithm = {"loss_agg_mode": "seq-mean-token-mean", "loss_rows": "step"}
    cfg = LearnerSection(lr=1e-3, micro_batch_tokens=160, total_steps=5, algorithm=algorithm)
    trainer = PolicyTrainer(str(tiny_policy), cfg)
    samples = two_samples()

    def pg_loss(step: bool) -> float:
        trainer.options = AlgorithmSettings(**dict(algorithm, loss_rows="step" if step
                                                   else "trajectory"))
        tokens, seqs = trainer._counts(samples, [0, 1], step_rows=step)
        assert (tokens, seqs) == (9.0, 3.0 if step else 2.0)
        mb = pack(samples, [0, 1])
        with torch.no_grad():
            _, metrics = trainer.rl_loss(mb, trainer._policy_out(mb), tokens, seqs)
        return metrics["pg_loss"]

    assert pg_loss(step=False) == pytest.approx(-(14 / 6 + 2) / 2, abs=1e-5)
    assert pg_loss(step=True) == pytest.approx(-2.0, abs=1e-5)
    metrics = trainer.rl_step(samples)  # the whole update path runs with step rows
    assert np.isfinite(metrics["loss"])
    for sample in samples:
        del sample.fields["step_index"]
    with pytest.raises(ValueError, match="step_index"):
        trainer.rl_step(samples)
