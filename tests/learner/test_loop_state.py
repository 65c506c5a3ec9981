"""Hand-built scenarios for the loop's bookkeeping (services/learner/loop_state.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

from services.common.trajectory import ScoredTrajectory, Trajectory
from services.learner.loop_state import (
    GroupLedger,
    admissible,
    admission_capacity,
    sample_index,
)


@dataclass
class T:
    """The minimal trajectory the ledger needs."""

    uid: str
    sample_id: str
    policy_version: int


def traj(uid: str, index: int, version: int = 0, attempt: int = 0) -> T:
    return T(uid, f"{uid}:{attempt}:{index}", version)


def fill(ledger: GroupLedger, uid: str, n: int, version: int = 0, attempt: int = 0) -> None:
    for i in range(n):
        assert ledger.add(traj(uid, i, version, attempt)) == "accepted"


def test_capacity_rule() -> None:
    assert admission_capacity(0, 4) == 4
    assert admission_capacity(1, 4) == 8
    assert admission_capacity(3, 2) == 8
    assert admissible(3, 0, 4) == 1
    assert admissible(9, 1, 4) == 0  # over capacity never goes negative
    with pytest.raises(ValueError):
        admission_capacity(-1, 4)
    with pytest.raises(ValueError):
        admission_capacity(0, 0)


def test_sample_index_is_last_field() -> None:
    assert sample_index("a:b:0:3") == 3  # uids may contain ':'
    assert sample_index("u:1:12") == 12
    assert sample_index("u:1:x") is None
    assert sample_index("u:1:-1") is None


def test_synchronous_admission() -> None:
    """max_staleness=0: one batch in flight; the next is admitted only after training."""
    ledger = GroupLedger(max_staleness=0, train_batch_size=2)
    assert ledger.admissible() == 2
    ledger.issue("a", 2, now=0.0)
    ledger.issue("b", 2, now=0.0)
    assert ledger.admissible() == 0
    with pytest.raises(RuntimeError):
        ledger.issue("c", 2, now=0.0)
    fill(ledger, "a", 2)
    assert ledger.take_batch() == []  # one complete group is not a batch
    assert ledger.admissible() == 0  # complete but untrained still counts as in flight
    fill(ledger, "b", 2)
    batch = ledger.take_batch()
    assert [g.uid for g in batch] == ["a", "b"]
    ledger.advance(1)
    assert ledger.admissible() == 2
    assert ledger.accounting()["balanced"] == 1


def test_async_admission_overlaps_one_batch() -> None:
    """max_staleness=1: the next batch is generated while the current one trains."""
    ledger = GroupLedger(max_staleness=1, train_batch_size=2)
    for uid in "abcd":
        ledger.issue(uid, 1, now=0.0)
    assert ledger.admissible() == 0
    # Completion order, not issue order, decides the batch.
    fill(ledger, "c", 1)
    fill(ledger, "a", 1)
    fill(ledger, "d", 1)
    assert ledger.ready_uids() == ["c", "a", "d"]
    assert [g.uid for g in ledger.take_batch()] == ["c", "a"]
    ledger.advance(1)
    assert ledger.admissible() == 2  # 'b' and 'd' still in flight of capacity 4
    ledger.issue("e", 1, now=1.0)
    ledger.issue("f", 1, now=1.0)
    assert ledger.groups["e"].issued_version == 1
    assert ledger.admissible() == 0


def test_samples_in_index_order_and_scored_wrapper() -> None:
    ledger = GroupLedger(max_staleness=0, train_batch_size=1)
    ledger.issue("g", 3, now=0.0)
    items = []
    for i in (2, 0, 1):
        t = Trajectory(
            uid="g", sample_id=f"g:0:{i}", data_source="nq", policy_version=0,
            prompt_ids=np.arange(3), response_ids=np.arange(2), loss_mask=np.ones(2),
            rollout_logprobs=np.zeros(2),
        )
        items.append(ScoredTrajectory(trajectory=t, reward=float(i)))
        assert ledger.add(items[-1]) == "accepted"
    (group,) = ledger.take_batch()
    assert [s.reward for s in group.samples] == [0.0, 1.0, 2.0]
    assert group.samples[0] is items[1]  # stored as given


def test_dedupe_across_attempts() -> None:
    ledger = GroupLedger(max_staleness=0, train_batch_size=1, timeout_s=10.0)
    ledger.issue("u", 3, now=0.0)
    ledger.taken("u", now=0.0)
    assert ledger.add(traj("u", 0)) == "accepted"
    assert ledger.add(traj("u", 0)) == "duplicates"  # redelivery of the same message
    result = ledger.poll(now=11.0)
    assert [(r.uid, r.attempt, r.reason) for r in result.reissue] == [("u", 1, "timeout")]
    # Attempt 1 regenerates all three: index 0 is a duplicate of attempt 0's.
    assert ledger.add(traj("u", 0, attempt=1)) == "duplicates"
    assert ledger.add(traj("u", 1, attempt=1)) == "accepted"
    # A late sample of attempt 0 fills index 2; attempt 1's index 2 then is the duplicate.
    assert ledger.add(traj("u", 2, attempt=0)) == "accepted"
    assert ledger.add(traj("u", 2, attempt=1)) == "duplicates"
    (group,) = ledger.take_batch()
    assert [s.sample_id for s in group.samples] == ["u:0:0", "u:1:1", "u:0:2"]
    acc = ledger.accounting()
    assert (acc["duplicates"], acc["accepted"], acc["trained"]) == (3, 3, 1)
    assert (acc["reissued"], acc["reissued_timeout"], acc["balanced"]) == (1, 1, 1)


def test_staleness_drop_on_arrival_reissues_group() -> None:
    ledger = GroupLedger(max_staleness=1, train_batch_size=1)
    ledger.issue("u", 2, now=0.0)
    ledger.advance(3)  # bound: policy_version >= 2
    assert ledger.add(traj("u", 0, version=1)) == "dropped_stale"
    assert ledger.add(traj("u", 1, version=2)) == "accepted"  # exactly at the bound is fine
    result = ledger.poll(now=0.0)
    assert [(r.uid, r.attempt, r.reason) for r in result.reissue] == [("u", 1, "stale")]
    assert ledger.groups["u"].issued_version == 3
    assert ledger.poll(now=0.0).reissue == []  # flag cleared by the re-issue
    assert ledger.add(traj("u", 0, version=3, attempt=1)) == "accepted"
    assert [g.uid for g in ledger.take_batch()] == ["u"]
    acc = ledger.accounting()
    assert (acc["dropped_stale"], acc["reissued_stale"], acc["balanced"]) == (1, 1, 1)


def test_advance_purges_held_samples_beyond_bound() -> None:
    """A group completed at version 0 must not be trained at version 2 with max_staleness 1."""
    ledger = GroupLedger(max_staleness=1, train_batch_size=1)
    ledger.issue("old", 2, now=0.0)
    ledger.issue("new", 1, now=0.0)
    ledger.add(traj("old", 0, version=0))
    ledger.add(traj("old", 1, version=1))
    assert ledger.ready_uids() == ["old"]
    assert ledger.advance(1) == 0
    assert ledger.advance(2) == 1  # index 0 (version 0) is now stale
    assert ledger.ready_uids() == []
    assert ledger.take_batch() == []
    result = ledger.poll(now=5.0)
    assert [(r.uid, r.reason) for r in result.reissue] == [("old", "stale")]
    assert sorted(ledger.groups["old"].samples) == [1]  # the fresh sample is kept
    with pytest.raises(ValueError):
        ledger.advance(1)


def test_timeout_reissue_and_attempt_limit() -> None:
    ledger = GroupLedger(max_staleness=0, train_batch_size=2, timeout_s=30.0, max_attempts=2)
    ledger.issue("slow", 1, now=0.0)
    ledger.issue("fast", 1, now=0.0)
    ledger.taken("slow", now=0.0)
    ledger.taken("fast", now=0.0)
    fill(ledger, "fast", 1)
    assert ledger.overdue(now=30.0) == []  # strictly past the timeout
    assert ledger.overdue(now=30.5) == ["slow"]  # complete groups are never overdue
    result = ledger.poll(now=31.0)
    assert [(r.uid, r.attempt) for r in result.reissue] == [("slow", 1)]
    assert ledger.overdue(now=1e9) == []  # the re-issue's clock waits for a replica
    assert ledger.taken("slow", now=31.0)
    assert ledger.overdue(now=60.0) == []
    result = ledger.poll(now=62.0)
    assert result.reissue == [] and result.dropped == ["slow"]  # second try exhausted
    assert "slow" not in ledger.groups
    assert ledger.add(traj("slow", 0, attempt=1)) == "unknown"
    assert ledger.admissible() == 1  # the dropped group frees its slot
    acc = ledger.accounting()
    assert (acc["issued"], acc["reissued"], acc["dropped_groups"]) == (2, 1, 1)
    assert (acc["in_flight"], acc["balanced"]) == (1, 1)


def test_the_clock_starts_when_a_replica_takes_the_group() -> None:
    """A group still queued in the prompts stream (replicas loading, or busy with an
    evaluation) has not been slow: only the time since a replica took it counts."""
    ledger = GroupLedger(max_staleness=0, train_batch_size=2, timeout_s=10.0)
    ledger.issue("queued", 1, now=0.0)
    ledger.issue("playing", 1, now=0.0)
    assert ledger.overdue(now=1e6) == [] and ledger.poll(now=1e6).reissue == []
    assert ledger.taken("playing", now=100.0)
    assert not ledger.taken("playing", now=105.0)  # the first take starts the clock
    assert not ledger.taken("nobody", now=105.0)
    assert ledger.overdue(now=110.0) == [] and ledger.overdue(now=110.5) == ["playing"]
    result = ledger.poll(now=111.0)
    assert [(r.uid, r.reason) for r in result.reissue] == [("playing", "timeout")]
    assert ledger.groups["queued"].taken_time is None
    assert ledger.accounting()["reissued_timeout"] == 1


def test_no_timeout_means_never_overdue() -> None:
    ledger = GroupLedger(max_staleness=0, train_batch_size=1)
    ledger.issue("u", 1, now=0.0)
    ledger.taken("u", now=0.0)
    assert ledger.overdue(now=1e9) == []
    assert ledger.poll(now=1e9).reissue == []


def test_unknown_trained_and_malformed() -> None:
    ledger = GroupLedger(max_staleness=0, train_batch_size=1)
    ledger.issue("u", 2, now=0.0)
    assert ledger.add(traj("nobody", 0)) == "unknown"
    assert ledger.add(T("u", "u:0:7", 0)) == "malformed"  # index >= n
    assert ledger.add(T("u", "u:0:x", 0)) == "malformed"
    fill(ledger, "u", 2)
    assert len(ledger.take_batch()) == 1
    assert ledger.add(traj("u", 0, attempt=1)) == "unknown"  # already trained: ignored
    acc = ledger.accounting()
    assert (acc["unknown"], acc["malformed"], acc["trained"]) == (2, 2, 1)
    with pytest.raises(ValueError):
        ledger.issue("v", 0, now=0.0)


def test_explicit_drop_counts() -> None:
    ledger = GroupLedger(max_staleness=0, train_batch_size=1)
    ledger.issue("flat", 1, now=0.0)
    fill(ledger, "flat", 1)
    ledger.drop("flat")  # e.g. the group filter: all rewards equal
    assert ledger.ready == 0 and ledger.take_batch() == []
    assert ledger.accounting()["dropped_groups"] == 1
    assert ledger.accounting()["balanced"] == 1
    with pytest.raises(KeyError):
        ledger.drop("flat")


def test_checkpoint_round_trip() -> None:
    ledger = GroupLedger(max_staleness=1, train_batch_size=2, timeout_s=5.0, max_attempts=4)
    for uid in ("a", "b", "c"):
        ledger.issue(uid, 2, now=1.0, meta={"row": ord(uid)})
    fill(ledger, "a", 2)
    ledger.add(traj("b", 0))
    ledger.add(traj("b", 0))
    ledger.advance(1)
    data = json.loads(json.dumps(ledger.to_dict()))  # plain JSON types only
    restored = GroupLedger.from_dict(data)
    assert restored.current_version == 1
    assert (restored.max_staleness, restored.train_batch_size) == (1, 2)
    assert (restored.timeout_s, restored.max_attempts) == (5.0, 4)
    assert restored.in_flight == 3 and restored.admissible() == 1
    acc = restored.accounting()
    assert (acc["issued"], acc["duplicates"], acc["accepted"]) == (3, 1, 3)
    assert acc["discarded_on_resume"] == 3 and acc["ready"] == 0
    # Every in-flight group is re-issued once, attempt+1, with its meta.
    result = restored.poll(now=0.0)
    assert [(r.uid, r.attempt, r.reason, r.meta) for r in result.reissue] == [
        ("a", 1, "resume", {"row": 97}), ("b", 1, "resume", {"row": 98}),
        ("c", 1, "resume", {"row": 99}),
    ]
    assert restored.accounting()["reissued_resume"] == 3
    # The resumed ledger trains as before, and a second round trip keeps the counters.
    fill(restored, "a", 2, version=1, attempt=1)
    fill(restored, "c", 2, version=1, attempt=1)
    assert [g.uid for g in restored.take_batch()] == ["a", "c"]
    again = GroupLedger.from_dict(restored.to_dict())
    assert again.counters == restored.counters
    assert again.accounting()["balanced"] == 1
