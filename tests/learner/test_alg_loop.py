"""Issue 18 in the loop. ReMax: one greedy sample per group is the baseline; it is counted and
never trained on (ledger rules by hand-built scenarios, then `forage learner train` as a real
process on a real Redis with a scripted rollout + scorer, tests/learner/test_loop.py's style).
And a run with an optimal token baseline, rollout correction and a new loss end to end."""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common.codec import encode
from services.common.trajectory import PromptGroup, ScoredTrajectory
from services.learner.loop_state import BASELINE_SUFFIX, GroupLedger, baseline_uid

_SPEC = importlib.util.spec_from_file_location("learner_loop_helpers",
                                               Path(__file__).with_name("test_loop.py"))
H = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(H)


@dataclass
class T:
    uid: str
    sample_id: str
    policy_version: int


def traj(uid: str, index: int, version: int = 0, attempt: int = 0) -> T:
    return T(uid, f"{uid}:{attempt}:{index}", version)


def test_ledger_holds_the_baseline_beside_the_group():
    ledger = GroupLedger(max_staleness=0, train_batch_size=1)
    ledger.issue("g", 2, now=0.0, meta={"row": 4}, baseline=True)
    greedy = baseline_uid("g")
    assert greedy == "g" + BASELINE_SUFFIX
    assert ledger.add(traj("g", 0)) == "accepted"
    assert ledger.add(traj("g", 1)) == "accepted"
    assert ledger.ready == 0  # n samples, but no baseline yet
    assert ledger.add(traj(greedy, 1)) == "malformed"  # a baseline group has one sample
    assert ledger.add(traj(greedy, 0)) == "baselines"
    assert ledger.add(traj(greedy, 0)) == "duplicates"
    assert ledger.add(traj("other" + BASELINE_SUFFIX, 0)) == "unknown"
    [group] = ledger.take_batch(1)
    assert [t.sample_id for t in group.samples] == ["g:0:0", "g:0:1"]  # never the greedy one
    assert group.baseline.sample_id == f"{greedy}:0:0"
    acc = ledger.accounting()
    assert (acc["accepted"], acc["baselines"], acc["trained"], acc["balanced"]) == (2, 1, 1, 1)
    assert ledger.add(traj(greedy, 0)) == "unknown"  # trained: late arrivals are unknown


def test_stale_or_failed_baseline_is_reissued_alone():
    ledger = GroupLedger(max_staleness=0, train_batch_size=1, timeout_s=5.0)
    ledger.issue("g", 1, now=0.0, meta={"row": 1}, baseline=True)
    greedy = baseline_uid("g")
    ledger.add(traj("g", 0, version=0))
    ledger.add(traj(greedy, 0, version=0))
    assert ledger.ready == 1
    ledger.advance(1)  # both are stale now
    assert ledger.ready == 0 and ledger.counters["dropped_stale"] == 2
    [again] = ledger.poll(1.0).reissue
    assert (again.reason, again.baseline_missing) == ("stale", True)
    ledger.add(traj("g", 0, version=1, attempt=1))
    assert ledger.reject(traj(greedy, 0, version=1, attempt=1)) == "errors"
    [third] = ledger.poll(2.0).reissue
    assert (third.reason, third.baseline_missing, third.attempt) == ("error", True, 2)
    # a group without a baseline never asks for one
    plain = GroupLedger(max_staleness=0, train_batch_size=1, timeout_s=1.0)
    plain.issue("p", 2, now=0.0)
    plain.taken("p", 0.0)  # a replica took it: its timeout runs from here
    assert plain.add(traj(baseline_uid("p"), 0)) == "unknown"
    [late] = plain.poll(5.0).reissue
    assert not late.baseline_missing


def test_ledger_checkpoint_keeps_the_baseline_flag():
    ledger = GroupLedger(max_staleness=1, train_batch_size=2)
    ledger.issue("g", 2, now=0.0, baseline=True)
    ledger.add(traj(baseline_uid("g"), 0))
    data = json.loads(json.dumps(ledger.to_dict()))
    restored = GroupLedger.from_dict(data)
    assert restored.counters["discarded_on_resume"] == 1
    [again] = restored.poll(0.0).reissue
    assert (again.reason, again.baseline_missing) == ("resume", True)


def _scored(uid: str, index: int, reward: float) -> ScoredTrajectory:
    from services.common.trajectory import Trajectory, Turn

    response = [5, 6, 7][: 2 + index % 2]
    traj = Trajectory(uid=uid, sample_id=f"{uid}:0:{index}", data_source="synth",
                      policy_version=1, prompt_ids=[1, 2], response_ids=response,
                      loss_mask=[1] * len(response), rollout_logprobs=[-1.0] * len(response),
                      turns=[Turn(0, len(response), "answer")])
    return ScoredTrajectory(traj, reward=reward)


def test_remax_advantages_use_the_group_baseline():
    from services.learner.algorithms import AlgorithmSettings
    from services.learner.rl_batch import assign_advantages, samples_of

    items = [_scored("a", 0, 1.0), _scored("a", 1, 0.0), _scored("b", 0, 1.0)]
    samples = samples_of(items)
    assign_advantages(samples, items, AlgorithmSettings(), "remax",
                      reward_baselines={"a": 0.25, "b": float("nan")})
    adv = [s.response_field("advantages").tolist() for s in samples]
    assert adv[0] == pytest.approx([0.75, 0.75])  # reward-to-go 1 - greedy 0.25 per token
    assert adv[1] == pytest.approx([-0.25] * 3)
    assert adv[2] == [0.0, 0.0]  # the greedy sample was unscorable: no baseline, no advantage
    with pytest.raises(ValueError, match="no greedy baseline reward for groups"):
        assign_advantages(samples, items, AlgorithmSettings(), "remax", reward_baselines={})


class RemaxScript(H.Script):
    """Main groups answered as test_loop's scripted replicas do (sample i gets reward i % 2);
    greedy groups get reward 0.75; the very first greedy group is left unanswered once."""

    def __init__(self, redis_url: str, namespace: str) -> None:
        super().__init__(redis_url, namespace)
        self.greedy: list[PromptGroup] = []
        self.main: list[PromptGroup] = []

    def answer(self, group: PromptGroup, behaviour: str) -> None:
        if not group.uid.endswith(BASELINE_SUFFIX):
            self.main.append(group)
            return super().answer(group, behaviour)
        self.greedy.append(group)
        if len(self.greedy) == 1:
            return  # ignored: the group times out and only its baseline is missing
        item = H.trajectory(group, 0, self.version())
        self.streams.publish_many("scored", [encode(ScoredTrajectory(item, reward=0.75))])


@pytest.mark.slow
def test_remax_trains_in_the_loop_with_greedy_baselines(tmp_path, redis_url, namespace,
                                                        tiny_policy):
    config = H.write_run(tmp_path, redis_url, namespace, tiny_policy, adv_estimator="remax",
                         total_steps=2, save_every=2)
    log = tmp_path / "learner.log"
    script = RemaxScript(redis_url, namespace)
    proc = H.start_learner(config, log)
    try:
        script.serve(proc, lambda group, nth: "normal", until=time.time() + 240)
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = H.read_metrics(tmp_path / "run")
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["throughput/trajectories"] == 4  # 2 groups x 2 samples: no greedy row trained
        assert m["throughput/baseline_trajectories"] == 2
        assert m["remax/baseline_reward_mean"] == pytest.approx(0.75)
        # A = reward-to-go - greedy reward on every policy token: sample 0 (3 tokens, reward 0)
        # gets -0.75, sample 1 (4 tokens, reward 1) +0.25; GRPO would give +-0.707 instead.
        assert m["advantages/mean"] == pytest.approx((3 * -0.75 + 4 * 0.25) / 7, abs=1e-6)
        assert m["reward/mean"] == pytest.approx(0.5)  # the trained rows' rewards only
    last = lines[-1]
    assert last["groups/baselines"] == 4 and last["groups/accepted"] == 8
    assert last["groups/trained"] == 4 and last["groups/balanced"] == 1
    assert last["groups/reissued_timeout"] >= 1
    # greedy groups: one sample at temperature 0, re-issued (attempt 1) when missing
    assert all(g.n == 1 and g.sampling == {"temperature": 0.0} and g.kind == "train"
               for g in script.greedy)
    assert all(g.n == 2 and "temperature" not in g.sampling for g in script.main)
    first = script.greedy[0].uid
    assert [g.attempt for g in script.greedy if g.uid == first] == [0, 1]


DECOUPLED = ("tir_optimal_token_baseline",
             {"policy_loss": "cispo", "rollout_is": "token", "rollout_is_threshold": 2.0,
              "rollout_rs": "token_k3", "rollout_rs_threshold": 50.0,
              "mask_truncated_completions": True})
BYPASS = ("grpo", {"bypass_mode": True, "bypass_loss_type": "reinforce", "rollout_is": "token",
                   "rollout_rs": "token_k3", "rollout_rs_threshold": 50.0})
IN_LOSS = ("grpo", {"tis_cap": 2.0})  # the demo's: token IS from the current log-probs


@pytest.mark.slow
@pytest.mark.parametrize("estimator, algorithm", [DECOUPLED, BYPASS, IN_LOSS],
                         ids=["decoupled", "bypass", "tis_cap"])
def test_rollout_correction_in_the_loop(tmp_path, redis_url, namespace, tiny_policy, estimator,
                                        algorithm):
    """The pieces that need the old-log-prob pass (sum of p^2, decoupled IS/rejection) or skip
    it (bypass mode) wired through the loop: two steps train, with the corrections' metrics
    under rollout_corr/ in metrics.jsonl."""
    config = H.write_run(tmp_path, redis_url, namespace, tiny_policy, total_steps=2,
                         adv_estimator=estimator, algorithm=algorithm)
    log = tmp_path / "learner.log"
    script = H.Script(redis_url, namespace)
    proc = H.start_learner(config, log)
    try:
        script.serve(proc, lambda group, nth: "normal", until=time.time() + 240)
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = H.read_metrics(tmp_path / "run")
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert 0 < m["rollout_corr/rollout_is_eff_sample_size"] <= 1
        if "rollout_rs" in algorithm:
            assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0  # a loose bound
        assert m["actor/grad_norm"] > 0 and m["advantages/abs_mean"] > 0
        assert "actor/ppo_kl" in m
        assert not any(k.startswith("actor/rollout_corr/") for k in m)
        assert "rollout_corr/rollout_is_seq_std" in m
        assert "rollout_corr/rollout_is_seq_max_deviation" in m
        # verl's off-policy metrics on every path: bypass, decoupled, in-loss TIS
        assert all(f"rollout_corr/{k}" in m for k in (
            "kl", "k3_kl", "training_ppl", "rollout_ppl", "log_ppl_diff", "ppl_ratio",
            "chi2_token", "chi2_seq"))
        if "rollout_rs" in algorithm:
            assert "rollout_corr/rollout_rs_token_k3_std" in m
            assert "rollout_corr/rollout_rs_token_k3_seq_max_deviation" in m
    if estimator == "tir_optimal_token_baseline":
        # the scripted rollout log-probs are -1 everywhere: the tiny policy is far from that
        assert all(m["rollout_corr/kl"] != 0.0 and "actor/pg_clipfrac" in m for m in lines)
