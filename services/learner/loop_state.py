"""Bookkeeping of the learner's RL loop: admission control and the prompt-group ledger.

Pure and side-effect free (no Redis, no torch, no clock): the loop passes the current time and
policy version in, and does the publishing/training itself. Keeping the rules here lets them be
tested exhaustively by hand-built scenarios, and lets the loop prove from the counters that every
issued group was trained exactly once, or re-issued / dropped and counted (docs/architecture.md).

Rules (issue 7, "The loop"):

* Admission (AReaL's capacity rule): groups in flight (issued, not yet trained or dropped) stay
  ≤ (max_staleness + 1) × train_batch_size. With max_staleness = 0 the learner issues one batch,
  trains it, then issues the next (synchronous, on-policy).
* De-duplication is by (uid, sample index); the index is the last ``:`` field of the sample id
  (``uid:attempt:index``), so index k from attempt 0 and index k from a re-issue are the same
  sample: the first to arrive wins, later ones are counted as duplicates. Delivery is at least
  once, so duplicates are expected, not errors.
* Staleness: a trajectory with policy_version < current_version − max_staleness is dropped
  (counted in ``dropped_stale``). Samples already held are re-checked whenever the version
  advances, so a group handed to the trainer never holds a sample beyond the bound.
  CHOICE: a group that lost a sample to staleness is **re-issued** (reason ``stale``, attempt+1)
  rather than dropped; its still-fresh samples are kept and the re-issue only fills the missing
  indices (the rest arrive as counted duplicates). Dropping would silently skew the data towards
  prompts that generate fast. After ``max_attempts`` issues the group is dropped (counted in
  ``dropped_groups``) so a prompt that always fails cannot stall the run.
* Timeout: an incomplete group not heard back within ``timeout_s`` of the moment a rollout
  replica took its latest issue is re-issued (reason ``timeout``), with the same attempt limit.
  The clock starts at ``taken(uid, now)``, which the loop calls when it sees the group's
  prompts-stream entry delivered to a replica, not at the issue: a group still queued (every
  replica loading its engine, or busy with an evaluation) has not been slow, and issuing it
  again would only queue a second copy behind the first.
* Trajectories for uids not in flight (never issued, already trained, or dropped) are ignored and
  counted in ``unknown``; sample ids whose index is not an integer in [0, n) in ``malformed``.
  The loop refuses records it never issued, another run's and ones from a future policy
  version before they reach the ledger (provenance.py); ``refuse`` counts them here
  (``refused_<reason>``), so they appear beside the other outcomes and survive a resume.
* Errors: a trajectory that failed for a reason outside the policy (finish_reason ``error``,
  e.g. the retriever was unreachable) is not trained on; ``reject`` counts it and flags its group
  for re-issue (reason ``error``), within the same attempt limit.
* Batches are formed from complete groups (n distinct samples) in completion order.

* Greedy baselines (ReMax): a group issued with ``baseline=True`` also waits for one greedy
  trajectory published under the uid ``baseline_uid(uid)`` (sample index 0). It is held beside
  the group's samples, never among them: the group is complete only with n samples AND its
  baseline, ``CompleteGroup.baseline`` hands it over for the advantage and nothing trains on
  it. It follows the same rules as a sample (staleness, duplicates, errors, re-issue: a
  ``Reissue`` says whether the baseline is still missing) and is counted apart
  (``baselines`` instead of ``accepted``), so ``accepted`` still counts trained trajectories.

Checkpoint: ``to_dict()`` holds plain JSON types only. Held trajectories are not serialised (they
are large arrays and the ledger must stay codec-free); ``from_dict()`` therefore brings every
in-flight group back empty and flagged for re-issue (reason ``resume``), and counts the samples
it had to forget in ``discarded_on_resume``. Trajectories of those groups that still arrive from
the streams after the restart are accepted as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

COUNTERS: tuple[str, ...] = (
    "issued",  # distinct groups issued (first issue only)
    "reissued",  # re-issues of any reason (sum of the three below)
    "reissued_timeout",
    "reissued_stale",
    "reissued_resume",
    "reissued_error",
    "trained",  # groups handed to the trainer by take_batch
    "dropped_groups",  # groups given up (attempt limit or explicit drop, e.g. group filter)
    "accepted",  # trajectories stored
    "baselines",  # greedy baseline trajectories stored (ReMax; never trained on)
    "dropped_stale",  # trajectories dropped for staleness (on arrival or on version advance)
    "duplicates",  # trajectories whose (uid, sample index) was already held
    "unknown",  # trajectories for uids not in flight
    "malformed",  # trajectories whose sample id has no valid index
    "errors",  # trajectories rejected as failed outside the policy (e.g. retriever down)
    "discarded_on_resume",  # held trajectories forgotten by a checkpoint round trip
    "refused_namespace",  # trajectories naming another run (provenance.py)
    "refused_future_version",  # trajectories claiming a policy version not trained yet
    "refused_not_issued",  # trajectories for groups this run never issued
)


def admission_capacity(max_staleness: int, train_batch_size: int) -> int:
    """Most groups that may be in flight at once: (max_staleness + 1) × train_batch_size."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if train_batch_size < 1:
        raise ValueError(f"train_batch_size must be >= 1, got {train_batch_size}")
    return (max_staleness + 1) * train_batch_size


def admissible(in_flight: int, max_staleness: int, train_batch_size: int) -> int:
    """How many new groups may be issued now (never negative)."""
    if in_flight < 0:
        raise ValueError(f"in_flight must be >= 0, got {in_flight}")
    return max(0, admission_capacity(max_staleness, train_batch_size) - in_flight)


BASELINE_SUFFIX = "@greedy"


def baseline_uid(uid: str) -> str:
    """The uid of a group's greedy baseline (ReMax): its own prompt group of one sample."""
    return f"{uid}{BASELINE_SUFFIX}"


def sample_index(sample_id: str) -> int | None:
    """The sample index of ``uid:attempt:index`` (last ``:`` field), or None when not an int."""
    tail = str(sample_id).rsplit(":", 1)[-1]
    try:
        index = int(tail)
    except ValueError:
        return None
    return index if index >= 0 else None


def _trajectory_of(item: Any) -> Any:
    """The object carrying uid/sample_id/policy_version (a ScoredTrajectory's ``.trajectory``)."""
    if hasattr(item, "uid"):
        return item
    inner = getattr(item, "trajectory", None)
    if inner is not None and hasattr(inner, "uid"):
        return inner
    raise TypeError(f"{type(item).__name__} has no uid/sample_id/policy_version")


@dataclass
class GroupRecord:
    """One issued prompt group and the samples held for it (index → the item as given)."""

    uid: str
    n: int
    issued_version: int
    issue_time: float
    attempt: int = 0
    # When a replica took the latest issue (the timeout clock's start); None: not yet taken.
    taken_time: float | None = None
    # Plain-JSON data the loop needs to re-publish the group (e.g. its dataset row).
    meta: dict[str, Any] = field(default_factory=dict)
    samples: dict[int, Any] = field(default_factory=dict)
    # Why the group must be re-issued at the next poll (None: it need not be).
    reissue_reason: str | None = None
    # ReMax: whether the group waits for a greedy baseline trajectory, and the one held.
    baseline: bool = False
    baseline_item: Any = None

    @property
    def complete(self) -> bool:
        return len(self.samples) >= self.n and (not self.baseline
                                                or self.baseline_item is not None)


@dataclass
class Reissue:
    """A group the loop must publish again with ``attempt`` (its new attempt number)."""

    uid: str
    n: int
    attempt: int
    reason: str
    meta: dict[str, Any]
    baseline_missing: bool = False  # ReMax: publish the greedy baseline group again too


@dataclass
class PollResult:
    reissue: list[Reissue]
    dropped: list[str]  # uids given up after max_attempts


@dataclass
class CompleteGroup:
    """A group ready for training: its samples in index order."""

    uid: str
    samples: list[Any]
    attempt: int
    issued_version: int
    meta: dict[str, Any]
    baseline: Any = None  # ReMax: the greedy baseline trajectory (not to be trained on)


class GroupLedger:
    """Tracks issued groups from issue to training; see the module docstring for the rules."""

    def __init__(
        self,
        *,
        max_staleness: int,
        train_batch_size: int,
        timeout_s: float | None = None,
        max_attempts: int = 3,
        current_version: int = 0,
    ) -> None:
        admission_capacity(max_staleness, train_batch_size)  # validates
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        self.max_staleness = max_staleness
        self.train_batch_size = train_batch_size
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.current_version = current_version
        self.groups: dict[str, GroupRecord] = {}
        # uids of complete groups in the order they completed (a dict keeps insertion order).
        self._ready: dict[str, None] = {}
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    # --- admission -------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self.groups)

    @property
    def capacity(self) -> int:
        return admission_capacity(self.max_staleness, self.train_batch_size)

    def admissible(self) -> int:
        """How many new groups the loop may issue now."""
        return admissible(self.in_flight, self.max_staleness, self.train_batch_size)

    def issue(
        self, uid: str, n: int, *, now: float, meta: dict[str, Any] | None = None,
        baseline: bool = False,
    ) -> GroupRecord:
        """Record a first issue of `uid` (attempt 0) at the current version; with `baseline`
        the group also waits for its greedy baseline (published as `baseline_uid(uid)`)."""
        if uid in self.groups:
            raise ValueError(f"group {uid!r} is already in flight")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if self.admissible() < 1:
            raise RuntimeError(
                f"admission control: {self.in_flight} groups in flight, capacity {self.capacity}"
            )
        record = GroupRecord(
            uid=uid, n=n, issued_version=self.current_version, issue_time=now,
            meta=dict(meta or {}), baseline=baseline,
        )
        self.groups[uid] = record
        self.counters["issued"] += 1
        return record

    # --- trajectories ------------------------------------------------------------------------
    def _stale(self, policy_version: int) -> bool:
        return policy_version < self.current_version - self.max_staleness

    def _baseline_record(self, uid: str) -> GroupRecord | None:
        """The group whose greedy baseline `uid` is, if it waits for one."""
        if not uid.endswith(BASELINE_SUFFIX):
            return None
        record = self.groups.get(uid[: -len(BASELINE_SUFFIX)])
        return record if record is not None and record.baseline else None

    def _triage(self, item: Any) -> tuple[str | None, Any, GroupRecord | None, int]:
        """The outcome that needs no decision (unknown / malformed / duplicates), else None
        with the trajectory, its group and its sample index (-2: the greedy baseline)."""
        traj = _trajectory_of(item)
        uid = str(traj.uid)
        record = self.groups.get(uid)
        if record is None:
            record = self._baseline_record(uid)
            if record is None:
                return "unknown", traj, None, -1
            if sample_index(traj.sample_id) != 0:
                return "malformed", traj, record, -1
            if record.baseline_item is not None:
                return "duplicates", traj, record, -2
            return None, traj, record, -2
        index = sample_index(traj.sample_id)
        if index is None or index >= record.n:
            return "malformed", traj, record, -1
        if index in record.samples:
            return "duplicates", traj, record, index
        return None, traj, record, index

    def add(self, item: Any) -> str:
        """Offer one scored trajectory; returns what happened to it (a counter name).

        `item` is any object with uid / sample_id / policy_version, or one whose
        ``.trajectory`` has them (a ScoredTrajectory); it is stored as given.
        """
        outcome, traj, record, index = self._triage(item)
        if outcome is None:
            assert record is not None
            if self._stale(int(traj.policy_version)):
                # The index is missing, so the group is incomplete: it needs a re-issue.
                outcome = "dropped_stale"
                record.reissue_reason = record.reissue_reason or "stale"
            elif index == -2:
                outcome = "baselines"
                record.baseline_item = item
                if record.complete:
                    record.reissue_reason = None
                    self._ready[record.uid] = None
            else:
                outcome = "accepted"
                record.samples[index] = item
                if record.complete:
                    record.reissue_reason = None
                    self._ready[record.uid] = None
        self.counters[outcome] += 1
        return outcome

    def reject(self, item: Any) -> str:
        """Refuse a failed trajectory (not the policy's doing); its group is re-issued."""
        outcome, _traj, record, _index = self._triage(item)
        if outcome is None:
            assert record is not None
            outcome = "errors"
            record.reissue_reason = record.reissue_reason or "error"
        self.counters[outcome] += 1
        return outcome

    def refuse(self, reason: str) -> str:
        """Count a trajectory the loop refused before offering it (provenance.REFUSALS);
        returns the counter's name."""
        name = f"refused_{reason}"
        if name not in self.counters:
            raise ValueError(f"unknown refusal reason {reason!r}")
        self.counters[name] += 1
        return name

    def advance(self, version: int) -> int:
        """Set the current policy version; drop held samples now beyond the bound.

        Returns how many samples were dropped. Groups that lose samples leave the ready queue
        and are flagged for re-issue (reason ``stale``).
        """
        if version < self.current_version:
            raise ValueError(f"policy version went back: {self.current_version} -> {version}")
        self.current_version = version
        dropped = 0
        for record in self.groups.values():
            stale = [
                index for index, item in record.samples.items()
                if self._stale(int(_trajectory_of(item).policy_version))
            ]
            for index in stale:
                del record.samples[index]
            held = record.baseline_item
            if held is not None and self._stale(int(_trajectory_of(held).policy_version)):
                record.baseline_item = None
                stale.append(-2)
            if stale:
                dropped += len(stale)
                self._ready.pop(record.uid, None)
                record.reissue_reason = record.reissue_reason or "stale"
        self.counters["dropped_stale"] += dropped
        return dropped

    # --- re-issue ----------------------------------------------------------------------------
    def taken(self, uid: str, now: float) -> bool:
        """A replica took the latest issue of `uid`: its timeout clock starts at `now` (once per
        issue). False for a uid not in flight or a clock already running."""
        record = self.groups.get(uid)
        if record is None or record.taken_time is not None:
            return False
        record.taken_time = now
        return True

    def overdue(self, now: float) -> list[str]:
        """uids of incomplete groups not heard back within timeout_s of a replica taking their
        latest issue (a group no replica has taken is never overdue)."""
        if self.timeout_s is None:
            return []
        return [
            r.uid for r in self.groups.values()
            if not r.complete and r.taken_time is not None
            and now - r.taken_time > self.timeout_s
        ]

    def poll(self, now: float) -> PollResult:
        """Re-issue groups that are overdue or flagged (stale, resume); drop those out of tries.

        A re-issue bumps the attempt, stops the timeout clock until a replica takes the new
        issue (`taken`) and moves the group's issued version to the current one; samples
        already held are kept.
        """
        overdue = set(self.overdue(now))
        result = PollResult(reissue=[], dropped=[])
        for uid in list(self.groups):
            record = self.groups[uid]
            if record.complete:
                continue
            reason = record.reissue_reason or ("timeout" if uid in overdue else None)
            if reason is None:
                continue
            if record.attempt + 1 >= self.max_attempts:
                self._finish(uid)
                self.counters["dropped_groups"] += 1
                result.dropped.append(uid)
                continue
            record.attempt += 1
            record.issue_time = now
            record.taken_time = None
            record.issued_version = self.current_version
            record.reissue_reason = None
            self.counters["reissued"] += 1
            self.counters[f"reissued_{reason}"] += 1
            result.reissue.append(
                Reissue(uid=uid, n=record.n, attempt=record.attempt, reason=reason,
                        meta=dict(record.meta),
                        baseline_missing=record.baseline and record.baseline_item is None)
            )
        return result

    # --- batches -----------------------------------------------------------------------------
    @property
    def ready(self) -> int:
        return len(self._ready)

    def ready_uids(self) -> list[str]:
        """Complete groups in completion order."""
        return list(self._ready)

    def take_batch(self, size: int | None = None) -> list[CompleteGroup]:
        """The first `size` (default train_batch_size) complete groups, or [] if fewer are ready.

        Taken groups count as trained and leave the ledger: later samples for them are unknown.
        """
        size = self.train_batch_size if size is None else size
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if len(self._ready) < size:
            return []
        batch = []
        for uid in list(self._ready)[:size]:
            record = self.groups[uid]
            batch.append(
                CompleteGroup(
                    uid=uid, samples=[record.samples[i] for i in sorted(record.samples)],
                    attempt=record.attempt, issued_version=record.issued_version,
                    meta=dict(record.meta), baseline=record.baseline_item,
                )
            )
            self._finish(uid)
        self.counters["trained"] += len(batch)
        return batch

    def drop(self, uid: str) -> None:
        """Give up a group without training it (e.g. the group filter found constant rewards)."""
        if uid not in self.groups:
            raise KeyError(uid)
        self._finish(uid)
        self.counters["dropped_groups"] += 1

    def _finish(self, uid: str) -> None:
        del self.groups[uid]
        self._ready.pop(uid, None)

    # --- accounting --------------------------------------------------------------------------
    def accounting(self) -> dict[str, int]:
        """Counters plus in_flight; ``balanced`` is 1 iff issued = trained + dropped + in flight."""
        out = dict(self.counters)
        out["in_flight"] = self.in_flight
        out["ready"] = self.ready
        out["balanced"] = int(
            self.counters["issued"]
            == self.counters["trained"] + self.counters["dropped_groups"] + self.in_flight
        )
        return out

    # --- checkpoint --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types; held trajectories are counted, not stored (see module docstring)."""
        return {
            "max_staleness": self.max_staleness,
            "train_batch_size": self.train_batch_size,
            "timeout_s": self.timeout_s,
            "max_attempts": self.max_attempts,
            "current_version": self.current_version,
            "counters": dict(self.counters),
            "groups": [
                {
                    "uid": r.uid, "n": r.n, "issued_version": r.issued_version,
                    "issue_time": r.issue_time, "taken_time": r.taken_time,
                    "attempt": r.attempt, "meta": dict(r.meta),
                    "held": len(r.samples) + (r.baseline_item is not None),
                    "reissue_reason": r.reissue_reason, "baseline": r.baseline,
                }
                for r in self.groups.values()
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GroupLedger:
        """Rebuild a ledger; every in-flight group comes back empty, flagged for re-issue."""
        ledger = cls(
            max_staleness=int(data["max_staleness"]),
            train_batch_size=int(data["train_batch_size"]),
            timeout_s=data.get("timeout_s"),
            max_attempts=int(data["max_attempts"]),
            current_version=int(data["current_version"]),
        )
        for name in COUNTERS:
            ledger.counters[name] = int(data.get("counters", {}).get(name, 0))
        for g in data.get("groups", []):
            record = GroupRecord(
                uid=str(g["uid"]), n=int(g["n"]), issued_version=int(g["issued_version"]),
                issue_time=float(g["issue_time"]), attempt=int(g["attempt"]),
                meta=dict(g.get("meta") or {}),
                reissue_reason=g.get("reissue_reason") or "resume",
                baseline=bool(g.get("baseline", False)),
            )
            ledger.groups[record.uid] = record
            ledger.counters["discarded_on_resume"] += int(g.get("held", 0))
        return ledger
