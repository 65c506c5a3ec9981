"""The learner trains only on what it issued: a hostile writer on a real Redis.

The loop's stream side runs for real (`LearnerLoop._start_driver`, `_issue`, `_receive`),
without the trainer, which refusing records does not touch. A learner issues groups and is
restarted from its cursor and ledger as `--resume` restores them; then a writer with the run's
credentials XADDs forged scored trajectories (a group never issued, another run's namespace, a
policy version from the future, an evaluation question never asked) ahead of the legitimate
answers, in the same reads. The batch holds the legitimate answers only, each forged record
is in the dead-letter stream with its reason, and the counters count them.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import redis
from prometheus_client import REGISTRY

from services.common.codec import decode_as, encode
from services.common.config import load_config
from services.common.trajectory import PromptGroup, ScoredTrajectory, Trajectory, Turn
from services.learner.loop import LearnerLoop
from services.learner.prompts import PromptSource, eval_uid_issued

ROWS = [{"data_source": "synth_single", "prompt": [{"role": "user", "content": f"question {i}"}],
         "reward_model": {"style": "rule", "ground_truth": {"target": [f"a{i}"]}},
         "extra_info": {"index": i}} for i in range(6)]


@pytest.fixture()
def make_loop(tmp_path, redis_url, namespace, tiny_policy):
    """make(data_cursor) -> a LearnerLoop whose driver side is running; with `data_cursor`
    (a checkpoint's: prompt cursor and ledger) it starts as `--resume` restores one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    train = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), train)
    overrides = [f"run_dir={tmp_path / 'run'}", f"redis.url={redis_url}",
                 f"redis.namespace={namespace}", f"model.path={tiny_policy}",
                 f"data.train_files=[{train}]", "data.n_samples=2",
                 "learner.weight_sync_port=0", "learner.logger=[jsonl]",
                 "learner.log_samples_n=0", "learner.max_staleness=0",
                 "learner.train_batch_size=2"]
    running: list[LearnerLoop] = []

    def make(data_cursor: dict | None = None) -> LearnerLoop:
        loop = LearnerLoop(load_config(None, overrides))
        loop.state.data_cursor = dict(data_cursor or {})
        loop._start_driver()
        running.append(loop)
        return loop

    yield make
    for loop in running:
        loop._shutdown()


def _answer(group: PromptGroup, index: int, version: int, **changes) -> ScoredTrajectory:
    response = [7 + index, 8, 9]
    traj = Trajectory(
        uid=group.uid, sample_id=f"{group.uid}:{group.attempt}:{index}",
        data_source=group.data_source, policy_version=version, prompt_ids=[1, 2, 3],
        response_ids=response, loss_mask=[1, 1, 1], rollout_logprobs=[-1.0] * 3,
        turns=[Turn(0, 3, "answer", policy_version=version)], ground_truth=group.ground_truth,
        kind=group.kind, namespace=group.namespace,
    )
    return ScoredTrajectory(dataclasses.replace(traj, **changes), reward=float(index))


def _refused(outcome: str) -> float:
    return REGISTRY.get_sample_value("forage_learner_trajectories_total",
                                     {"outcome": outcome}) or 0.0


def test_forged_scored_trajectories_are_refused_dead_lettered_and_counted(
        make_loop, redis_url, namespace):
    first = make_loop()
    first._issue()
    groups = [decode_as(fields[b"payload"], PromptGroup)
              for _, fields in first.streams.client.xrange(first.streams.key("prompts"))]
    assert len(groups) == 2 and {g.namespace for g in groups} == {namespace}
    cursor = {"prompts": first.source.cursor(), "ledger": first.ledger.to_dict()}
    first._shutdown()
    # --resume: the groups issued before the restart are still this run's.
    loop = make_loop(cursor)
    version = loop.version
    never = next(f"e0-r{row}" for row in range(len(ROWS))
                 if f"e0-r{row}" not in {g.uid for g in groups})
    a, b = groups
    forged = {  # the same uids and sample indices as real answers, written first
        "namespace": _answer(a, 0, version, namespace="another-run"),
        "future_version": _answer(a, 1, version, policy_version=version + 1),
        "not_issued": _answer(dataclasses.replace(a, uid=never), 0, version),
        "eval": _answer(dataclasses.replace(b, uid="eval-v99-0", kind="eval"), 0, version),
    }
    turn_ahead = _answer(b, 0, version)  # only a turn claims the future version
    turn_ahead.trajectory.turns[0].policy_version = version + 1
    forged["future_turn"] = turn_ahead
    legit = [_answer(g, i, version) for g in groups for i in range(2)]
    before = {r: _refused(f"refused_{r}") for r in ("namespace", "future_version", "not_issued")}
    writer = redis.Redis.from_url(redis_url)  # the hostile writer: plain XADD, same keys
    key = loop.streams.key("scored")
    forged_ids = {name: writer.xadd(key, {"payload": encode(s)}).decode()
                  for name, s in forged.items()}
    for item in legit:
        writer.xadd(key, {"payload": encode(item)})
    writer.close()

    deadline = time.monotonic() + 30
    while loop.ledger.ready < 2 and time.monotonic() < deadline:
        loop._receive(50)
    batch = loop.ledger.take_batch(2)
    trained = sorted((s.trajectory.sample_id, s.reward, s.trajectory.policy_version,
                      s.trajectory.namespace) for g in batch for s in g.samples)
    assert trained == sorted((s.trajectory.sample_id, s.reward, version, namespace)
                             for s in legit)

    dead = {d["id"]: d for d in loop.streams.dead_letters()}
    assert set(dead) == set(forged_ids.values())
    reasons = {name: dead[entry]["reason"] for name, entry in forged_ids.items()}
    assert reasons["namespace"].startswith("refused (namespace)")
    assert "'another-run'" in reasons["namespace"] and repr(namespace) in reasons["namespace"]
    for name in ("future_version", "future_turn"):
        assert reasons[name] == (f"refused (future_version): policy version {version + 1} is "
                                 f"newer than the learner's current version {version}")
    assert reasons["not_issued"] == (f"refused (not_issued): train group '{never}' was not "
                                     "issued by this learner in this run")
    assert reasons["eval"].startswith("refused (not_issued): eval group 'eval-v99-0'")
    assert all(dead[forged_ids[n]]["payload"] == encode(forged[n]) for n in forged)
    accounting = loop.ledger.accounting()
    assert (accounting["refused_namespace"], accounting["refused_future_version"],
            accounting["refused_not_issued"], accounting["accepted"]) == (1, 2, 2, 4)
    assert {r: _refused(f"refused_{r}") - before[r] for r in before} == {
        "namespace": 1, "future_version": 2, "not_issued": 2}
    assert loop.streams.pending("scored") == 0  # every record acked or dead-lettered


def test_issued_follows_the_prompt_cursor_across_a_restore():
    source = PromptSource(ROWS, seed=3)
    taken = [uid for uid, _ in source.take(len(ROWS) + 2)]  # into epoch 1
    restored = PromptSource(ROWS, seed=3)
    restored.restore(source.cursor())
    assert all(restored.issued(uid) for uid in taken)
    later = [uid for uid, _ in PromptSource(ROWS, seed=3).take(2 * len(ROWS))[len(taken):]]
    assert later and not any(restored.issued(uid) for uid in later)
    assert not any(restored.issued(uid) for uid in
                   ("e2-r0", "e0-r6", "e00-r1", "e0-r1@greedy", "eval-v1-0", "e0-r-1"))
    assert eval_uid_issued("eval-v3-5", 3, 6) and not eval_uid_issued("eval-v4-5", 3, 6)
    assert not eval_uid_issued("eval-v3-6", 3, 6) and not eval_uid_issued("eval-v03-5", 3, 6)
