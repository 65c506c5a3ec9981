"""Whether a scored trajectory is this learner's to use: the run it names, the policy version
it claims and the group it answers.

Whoever can write to the run's scored stream can put any record there: a process with the
run's Redis credentials, a scorer of another run configured with this run's namespace, a
replay of an old stream. The codec only checks that a record is well formed. This check comes
next and refuses a trajectory that
- names another run (its `namespace`, copied by rollout from the prompt group the learner
  issued, is not the learner's own; records without one, from producers that predate the
  field, pass this check);
- claims a policy version newer than the learner's current one (a version it has not trained
  yet cannot have produced any token: the trajectory's own version and every turn's count);
- answers a group this learner did not issue in this run (`issued(uid, kind)`: the loop asks
  its prompt cursor for training groups and the evaluation uid form for evaluation questions).

The loop dead-letters a refused record with the reason and counts it, and the record's
neighbours in the same read go on (loop.py, `_receive`). A trajectory that passes still goes
through the ledger's own rules (duplicates, staleness, groups no longer in flight). Pure: no
Redis, no clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Why a trajectory was refused; the ledger counts each as `refused_<reason>`.
REFUSALS: tuple[str, ...] = ("namespace", "future_version", "not_issued")


@dataclass(frozen=True)
class Refusal:
    reason: str  # one of REFUSALS
    detail: str  # for people: what the record claimed and what the learner expected

    def __str__(self) -> str:
        return f"refused ({self.reason}): {self.detail}"


def _short(value: str, limit: int = 80) -> str:
    """A claimed name, quoted and cut: a forged record may carry a megabyte of it."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def claimed_version(traj: Any) -> int:
    """The newest policy version the trajectory says produced any of its tokens."""
    return max([int(traj.policy_version), *(int(t.policy_version) for t in traj.turns)])


def refusal(traj: Any, *, namespace: str, current_version: int,
            issued: Callable[[str, str], bool]) -> Refusal | None:
    """Why the learner must not use `traj` (a Trajectory), or None when it may."""
    if traj.namespace and traj.namespace != namespace:
        return Refusal("namespace", f"the trajectory names run namespace "
                                    f"{_short(traj.namespace)}, this learner's is "
                                    f"{_short(namespace)}")
    version = claimed_version(traj)
    if version > current_version:
        return Refusal("future_version", f"policy version {version} is newer than the "
                                         f"learner's current version {current_version}")
    if not issued(str(traj.uid), str(traj.kind)):
        return Refusal("not_issued", f"{traj.kind} group {_short(str(traj.uid))} was not "
                                     "issued by this learner in this run")
    return None
