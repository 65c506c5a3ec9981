"""The loop's pure parts: prompt epochs, batch metrics, advantages of a scored batch, reject."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.trajectory import Probe, ScoredTrajectory, Trajectory, Turn
from services.learner.algorithms import AlgorithmSettings
from services.learner.batch_stats import overconfidence_per_row, probe_metrics, trajectory_metrics
from services.learner.loop_state import GroupLedger
from services.learner.prompts import PromptSource, epoch_order, group_from_row
from services.learner.rl_batch import assign_advantages, check_estimator, samples_of


def scored(uid: str, index: int, reward: float, *, version: int = 1, searches: int = 1,
           source: str = "nq", probe: list[float] | None = None, length: int = 4,
           finish: str = "answer") -> ScoredTrajectory:
    traj = Trajectory(
        uid=uid, sample_id=f"{uid}:0:{index}", data_source=source, policy_version=version,
        prompt_ids=[1, 2, 3], response_ids=list(range(5, 5 + length)),
        loss_mask=[1, 1, 0, 1][:length] + [1] * max(0, length - 4),
        rollout_logprobs=[-1.0] * length, turns=[Turn(0, 2, "search"), Turn(3, length, "answer")],
        finish_reason=finish, num_searches=searches,
        probe=Probe([0.0, 0.5, 1.0], [[], [], []]) if probe is not None else None,
    )
    return ScoredTrajectory(traj, reward=reward, probe_scores=probe)


def test_epochs_are_seeded_permutations_and_the_cursor_resumes():
    assert sorted(epoch_order(10, 3, 0)) == list(range(10))
    assert epoch_order(10, 3, 0) == epoch_order(10, 3, 0) != epoch_order(10, 3, 1)
    assert epoch_order(4, 3, 0, shuffle=False) == [0, 1, 2, 3]
    rows = [{"data_source": "nq", "prompt": "q", "reward_model": {"ground_truth": i}}
            for i in range(5)]
    first = PromptSource(rows, seed=1)
    taken = first.take(7)  # crosses into epoch 1
    assert [uid.split("-")[0] for uid, _ in taken] == ["e0"] * 5 + ["e1"] * 2
    resumed = PromptSource(rows, seed=1)
    resumed.restore(first.cursor())
    uninterrupted = PromptSource(rows, seed=1)
    uninterrupted.take(7)
    assert resumed.take(6) == uninterrupted.take(6)
    with pytest.raises(ValueError, match="no rows"):
        PromptSource([], seed=0)


def test_group_from_row_takes_ground_truth_and_extra():
    row = {"data_source": "nq", "prompt": [{"role": "user", "content": "q"}],
           "reward_model": {"style": "rule", "ground_truth": {"target": ["x"]}},
           "extra_info": {"index": 4}}
    group = group_from_row(row, "e0-r4", 5, kind="eval", policy_version_min=3, attempt=1)
    assert (group.uid, group.n, group.kind, group.policy_version_min, group.attempt) == (
        "e0-r4", 5, "eval", 3, 1)
    assert group.ground_truth == {"target": ["x"]} and group.extra == {"index": 4}


def test_trajectory_metrics_by_source_and_staleness():
    items = [scored("a", 0, 1.0, version=3, searches=2), scored("a", 1, 0.0, version=2),
             scored("b", 0, 0.5, version=3, source="hotpotqa", searches=0, finish="length")]
    m = trajectory_metrics(items, current_version=3)
    assert m["reward/mean"] == pytest.approx(0.5)
    assert m["em/mean"] == pytest.approx(1 / 3)  # only reward >= 1 counts as correct
    assert m["reward/nq/mean"] == pytest.approx(0.5) and m["em/hotpotqa"] == 0.0
    assert m["searches/mean"] == pytest.approx(1.0) and m["turns/mean"] == 2.0
    assert m["staleness/mean"] == pytest.approx(1 / 3) and m["staleness/max"] == 1.0
    assert m["finish/length"] == pytest.approx(1 / 3)
    assert trajectory_metrics([]) == {}
    assert "eval/em/mean" in trajectory_metrics(items, prefix="eval/")


def test_probe_metrics_split_correct_and_incorrect():
    items = [scored("a", 0, 1.0, probe=[0.0, 0.5, 1.0]), scored("a", 1, 0.0, probe=[1.0, 1.0, 1.0]),
             scored("a", 2, 1.0, probe=[0.0, 1.0, 1.0]), scored("a", 3, 0.0)]  # last unprobed
    m = probe_metrics(items)
    assert m["probe_correct/score_at_0.00"] == 0.0 and m["probe_correct/score_at_0.50"] == 0.75
    assert m["probe_incorrect/score_at_1.00"] == 1.0
    assert m["probe_all/n_correct"] == 2 and m["probe_all/n_incorrect"] == 1
    assert m["probe_all/mean_score"] == pytest.approx(np.mean([0.0, 0.5, 1.0, 1.0, 1.0, 1.0,
                                                               0.0, 1.0, 1.0]))
    # overconfidence: weights linspace(0.5, -0.5, 3) = [0.5, 0, -0.5]
    assert m["probe_incorrect/overconf"] == pytest.approx(0.0)
    assert m["probe_correct/overconf"] == pytest.approx(0.5 * 0 - 0.5 * 1.0)
    assert overconfidence_per_row(items) == [pytest.approx(-0.5), pytest.approx(0.0),
                                             pytest.approx(-0.5), None]
    assert probe_metrics([scored("a", 0, 1.0)]) == {}


def test_assign_advantages_grpo_on_a_scored_batch():
    items = [scored("a", 0, 1.0), scored("a", 1, 0.0), scored("b", 0, 1.0), scored("b", 1, 1.0)]
    samples = samples_of(items)
    for sample in samples:
        sample.set_field("old_logprobs", np.zeros(len(sample), dtype=np.float32))
    metrics = assign_advantages(samples, items, AlgorithmSettings(), "grpo")
    adv = [s.response_field("advantages") for s in samples]
    # group a: rewards (1, 0) -> mean 0.5, unbiased std 0.7071 -> +-0.7071 on the policy
    # tokens (the observation token, loss_mask 0, gets 0); group b: constant -> 0
    assert adv[0] == pytest.approx([0.70710, 0.70710, 0.0, 0.70710], abs=1e-4)
    assert adv[1] == pytest.approx([-0.70710, -0.70710, 0.0, -0.70710], abs=1e-4)
    assert np.all(adv[2] == 0) and np.all(adv[3] == 0)
    assert np.all(samples[0].fields["advantages"][:3] == 0)  # prompt tokens carry nothing
    assert "advantages/mean" in metrics


def test_probe_shaping_moves_only_probed_rows():
    items = [scored("a", 0, 1.0, probe=[1.0, 1.0, 0.0]), scored("a", 1, 0.0)]
    samples = samples_of(items)
    base = samples_of(items)
    assign_advantages(base, items, AlgorithmSettings(), "grpo")
    metrics = assign_advantages(samples, items, AlgorithmSettings(), "grpo", overconf_coeff=0.5)
    # overconfidence of row 0 = 0.5*1 + 0*1 - 0.5*0 = 0.5 -> penalty 0.25 on loss-mask tokens
    delta = base[0].response_field("advantages") - samples[0].response_field("advantages")
    assert delta == pytest.approx([0.25, 0.25, 0.0, 0.25], abs=1e-6)
    assert np.array_equal(base[1].response_field("advantages"),
                          samples[1].response_field("advantages"))
    assert metrics["probe_all/overconf_penalty_mean"] == pytest.approx(0.25)


def test_kl_in_reward_needs_reference_log_probs_and_lowers_rewards():
    items = [scored("a", 0, 1.0), scored("a", 1, 0.0)]
    options = AlgorithmSettings(use_kl_in_reward=True, kl_coef=0.5)
    samples = samples_of(items)
    for sample in samples:
        sample.set_field("old_logprobs", np.full(len(sample), -1.0, dtype=np.float32))
        sample.set_field("ref_logprobs", np.full(len(sample), -2.0, dtype=np.float32))
    controller = options.make_kl_controller()
    metrics = assign_advantages(samples, items, options, "grpo", kl_controller=controller)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(1.0)  # k1 = old - ref = 1
    with pytest.raises(ValueError, match="KL controller"):
        assign_advantages(samples, items, options, "grpo")


def test_estimators_the_loop_cannot_run_fail_at_start():
    from services.learner.algorithms import AlgorithmSettings

    check_estimator("grpo")
    check_estimator("remax")  # the loop issues a greedy baseline per group (issue 18)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        check_estimator("nope")
    stepwise = AlgorithmSettings(multi_turn="per_step")
    with pytest.raises(ValueError, match="remax needs per-row inputs"):
        check_estimator("remax", stepwise)
    with pytest.raises(ValueError, match="n_samples >= 2"):
        check_estimator("grpo_passk", AlgorithmSettings(), n_samples=1)
    with pytest.raises(ValueError, match="gdpo_reward_keys"):
        check_estimator("gdpo", AlgorithmSettings())


def test_ledger_reject_flags_the_group_for_reissue():
    ledger = GroupLedger(max_staleness=0, train_batch_size=1, max_attempts=2)
    ledger.issue("g", 2, now=0.0, meta={"row": 3})
    assert ledger.reject(scored("g", 0, 0.0).trajectory) == "errors"
    assert ledger.add(scored("g", 1, 1.0)) == "accepted"
    poll = ledger.poll(1.0)
    assert [(r.uid, r.reason, r.attempt, r.meta) for r in poll.reissue] == [
        ("g", "error", 1, {"row": 3})]
    assert ledger.add(scored("g", 1, 1.0)) == "duplicates"  # the good sample is kept
    assert ledger.reject(scored("g", 0, 0.0)) == "errors"
    assert ledger.poll(2.0).dropped == ["g"]  # out of attempts: given up, counted
    acc = ledger.accounting()
    assert (acc["errors"], acc["reissued_error"], acc["dropped_groups"], acc["balanced"]) == (
        2, 1, 1, 1)
    assert ledger.reject(scored("zzz", 0, 0.0)) == "unknown"
    torch.manual_seed(0)


def with_evidence(item: ScoredTrajectory, scores: dict[str, float] | None) -> ScoredTrajectory:
    item.evidence_scores = scores
    return item


def test_evidence_metrics_and_memory_answers():
    from services.learner.batch_stats import evidence_metrics, memory_answers

    items = [with_evidence(scored("a", 0, 1.0), {"real": 1.0, "none": 0.0, "swapped": 0.0,
                                                 "gap": 1.0}),
             with_evidence(scored("a", 1, 1.0), {"real": 1.0, "none": 1.0, "swapped": 1.0,
                                                 "gap": 0.0}),
             with_evidence(scored("b", 0, 0.0), {"real": 0.0, "none": 0.5}),  # no donor
             scored("b", 1, 0.0)]
    m = evidence_metrics(items)
    assert m["probe/evidence_count"] == 3 and m["probe/evidence_swapped_count"] == 2
    assert m["probe/evidence_real_em"] == pytest.approx(2 / 3)
    assert m["probe/evidence_none_em"] == pytest.approx(0.5)
    assert m["probe/evidence_swapped_em"] == pytest.approx(0.5)
    assert m["probe/evidence_gap"] == pytest.approx(0.5)
    assert probe_metrics(items) == m  # the step's probe metrics carry them
    assert evidence_metrics([scored("a", 0, 1.0)]) == {}
    assert memory_answers(items) == [0.0, 1.0, None, None]


def test_evidence_shaping_lowers_only_memory_answers():
    from services.learner.rl_batch import evidence_shaping

    items = [with_evidence(scored("a", 0, 1.0), {"real": 1.0, "swapped": 1.0, "gap": 0.0}),
             with_evidence(scored("a", 1, 1.0), {"real": 1.0, "swapped": 0.0, "gap": 1.0}),
             scored("a", 2, 0.0)]
    samples, base = samples_of(items), samples_of(items)
    assign_advantages(base, items, AlgorithmSettings(), "grpo")
    metrics = assign_advantages(samples, items, AlgorithmSettings(), "grpo",
                                evidence_coeff=0.5)
    delta = base[0].response_field("advantages") - samples[0].response_field("advantages")
    assert delta == pytest.approx([0.5, 0.5, 0.0, 0.5], abs=1e-6)  # loss-mask tokens only
    for row in (1, 2):
        assert np.array_equal(base[row].response_field("advantages"),
                              samples[row].response_field("advantages"))
    assert metrics["probe/evidence_penalty_mean"] == pytest.approx(0.25)
    adv = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    shaped = evidence_shaping(adv, mask, [None, 1.0], 0.1)
    assert torch.allclose(shaped, torch.tensor([[0.0, 0.0, 0.0], [-0.1, -0.1, -0.1]]))
    with pytest.raises(ValueError, match="rows of evidence"):
        evidence_shaping(adv, mask, [None], 0.1)
