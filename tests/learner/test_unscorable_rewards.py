"""Reward functions returning None, end to end (docs/scorer.md, "None rewards"): TRL's
GRPOTrainer semantics (huggingface/trl trl/trainer/grpo_trainer.py, `_calculate_rewards` and
`_generate_and_score_completions`): None → NaN per function, the row's reward is the weighted
nansum, a row whose functions ALL returned None is unscorable (NaN): it is left out of the
group mean and the (Bessel) std, and its advantage is 0."""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest

from services.common.trajectory import ScoredTrajectory, Trajectory, Turn
from services.learner.algorithms import AlgorithmSettings
from services.learner.algorithms.filters import filter_groups
from services.learner.batch_stats import trajectory_metrics
from services.learner.rl_batch import assign_advantages, samples_of
from services.scorer.rewards import RewardTable, compute_score
from services.scorer.scoring import Scorer, ScoreRequest

NAN = math.nan
# TRL's GRPO: advantages = (r - nanmean_g) / (nanstd_g + 1e-4); a group with one scorable row
# has nanstd NaN, so every advantage of it is NaN → 0 (the estimator's singleton="zero").
TRL = AlgorithmSettings(epsilon=1e-4, singleton="zero")


def scored(uid: str, index: int, reward: float) -> ScoredTrajectory:
    traj = Trajectory(
        uid=uid, sample_id=f"{uid}:0:{index}", data_source="nq", policy_version=1,
        prompt_ids=[1, 2, 3], response_ids=[5, 6, 7, 8], loss_mask=[1, 1, 0, 1],
        rollout_logprobs=[-1.0] * 4, turns=[Turn(0, 2, "search"), Turn(3, 4, "answer")],
        finish_reason="answer", num_searches=1,
    )
    return ScoredTrajectory(traj, reward=reward)


def row_advantages(items, options, estimator="grpo"):
    samples = samples_of(items)
    for sample in samples:
        sample.set_field("old_logprobs", np.zeros(len(sample), dtype=np.float32))
        sample.set_field("values", np.full(len(sample), 0.25, dtype=np.float32))
    metrics = assign_advantages(samples, items, options, estimator)
    advantages = [s.response_field("advantages") for s in samples]
    for adv in advantages if estimator == "grpo" else []:  # one scalar per row on the
        assert adv[2] == 0.0 and adv[0] == adv[1] == adv[3]  # policy tokens (mask 1, 1, 0, 1)
    return [float(adv[0]) for adv in advantages], samples, metrics


ITEMS = ([scored("a", i, r) for i, r in enumerate([1.0, NAN, 0.0, 0.5])]
         + [scored("b", i, r) for i, r in enumerate([NAN, 2.0, NAN, NAN])]
         + [scored("c", i, r) for i, r in enumerate([NAN, NAN])])


def test_grpo_matches_trl_hand_computed():
    """Group a: scorable (1, 0, 0.5): mean 0.5, Bessel std sqrt(0.5/2) = 0.5 → ±0.5/0.5001;
    the NaN row 0. Group b: one scorable row → 0 everywhere. Group c: all NaN → 0."""
    advantages, samples, metrics = row_advantages(ITEMS, TRL)
    expected = [0.5 / 0.5001, 0.0, -0.5 / 0.5001, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert advantages == pytest.approx(expected, abs=1e-6)
    assert metrics["rewards/unscorable_fraction"] == pytest.approx(6 / 10)
    assert np.all(samples[1].response_field("returns") == 0)


def test_excluded_rows_do_not_move_the_others_baseline():
    """Dropping the unscorable rows changes nothing for the scorable ones (old rule: None
    scored 0, which pulled group a's mean from 0.5 to 0.375)."""
    with_nan, _, _ = row_advantages(ITEMS[:4], AlgorithmSettings())
    without, _, _ = row_advantages([ITEMS[0], ITEMS[2], ITEMS[3]], AlgorithmSettings())
    assert [with_nan[0], with_nan[2], with_nan[3]] == pytest.approx(without, abs=1e-7)
    # verl's own singleton rule still applies to the scorable rows: raw reward / (1 + eps)
    verl_b, _, _ = row_advantages(ITEMS[4:8], AlgorithmSettings())
    assert verl_b == pytest.approx([0.0, 2.0 / (1 + 1e-6), 0.0, 0.0])


def test_gae_unscorable_row_gets_zero_advantage_and_its_own_values_as_returns():
    _, samples, _ = row_advantages(ITEMS[:4], AlgorithmSettings(), estimator="gae")
    assert np.all(samples[1].response_field("advantages") == 0)
    assert np.all(samples[1].response_field("returns") == np.float32(0.25))


def test_logged_rewards_and_group_filter_leave_nan_out():
    metrics = trajectory_metrics(ITEMS)
    assert metrics["reward/mean"] == pytest.approx((1.0 + 0.0 + 0.5 + 2.0) / 4)
    assert metrics["reward/nq/mean"] == pytest.approx(3.5 / 4)
    assert filter_groups({"a": [1.0, NAN, 1.0], "b": [NAN, 0.0, 1.0], "c": [NAN, NAN]}) == ["b"]


@pytest.fixture()
def abstaining_module():
    module = types.ModuleType("forage_test_abstain")
    module.maybe = lambda data_source, solution_str, ground_truth, extra_info=None: (
        None if "skip" in solution_str else 1.0)
    module.never = lambda data_source, solution_str, ground_truth, extra_info=None: None
    sys.modules[module.__name__] = module
    yield module.__name__
    del sys.modules[module.__name__]


def test_scorer_gives_nan_for_unscorable_rows_and_nansum_otherwise(abstaining_module):
    table = RewardTable({"t": [{"function": f"{abstaining_module}:maybe", "weight": 2.0},
                               {"function": f"{abstaining_module}:never"}]})
    assert compute_score("t", "fine", None, table=table)["score"] == 2.0
    assert math.isnan(compute_score("t", "skip me", None, table=table)["score"])
    results = Scorer(table).score_many([ScoreRequest("t", "skip", None),
                                        ScoreRequest("t", "ok", None)])
    assert results[0].error is None and math.isnan(results[0].score)
    assert results[1].score == 2.0
