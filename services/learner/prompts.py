"""Where the learner's prompt groups come from: dataset rows in seeded epochs.

The order of epoch e is a permutation seeded by (seed, e), so the data cursor in a checkpoint is
just (epoch, position): a resumed run issues exactly the rows an uninterrupted one would. A group's
uid names its row and epoch (`e{epoch}-r{row}`), which keeps uids unique across epochs and lets
a log line be traced back to the dataset.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from services.common.trajectory import PromptGroup


def epoch_order(n_rows: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """Row order of one epoch: a permutation seeded by (seed, epoch), or 0..n-1."""
    if not shuffle:
        return list(range(n_rows))
    return np.random.default_rng([seed, epoch]).permutation(n_rows).tolist()


def eval_subset(rows: Sequence[dict[str, Any]], cap: int) -> list[int]:
    """Indices (in file order) of the rows an evaluation asks: all of them when `cap` is 0 or
    covers the test set, else `cap` rows.

    Search-R1's test file is seven datasets one after another (~51k questions); its first
    `cap` rows would all be NQ. So the cap is split over `data_source` in proportion to each
    source's rows (largest remainders; ties go to the smaller source, then by name), and within a source the rows kept are
    those whose hash of (source, place in the source) is smallest: a spread over the whole
    source, the same for every evaluation of every run on the same test files, whatever the
    run's seeds, so evaluations stay comparable across steps and runs.
    """
    if cap <= 0 or cap >= len(rows):
        return list(range(len(rows)))
    by_source: dict[str, list[int]] = {}
    for index, row in enumerate(rows):
        by_source.setdefault(str(row["data_source"]), []).append(index)
    exact = {source: cap * len(members) / len(rows) for source, members in by_source.items()}
    quota = {source: int(share) for source, share in exact.items()}
    rest = cap - sum(quota.values())
    for source in sorted(exact, key=lambda s: (quota[s] - exact[s], len(by_source[s]), s))[:rest]:
        quota[source] += 1
    chosen: list[int] = []
    for source, members in by_source.items():
        ranked = sorted(range(len(members)), key=lambda place: hashlib.blake2b(
            f"{source}:{place}".encode(), digest_size=8).digest())
        chosen.extend(members[place] for place in ranked[: quota[source]])
    return sorted(chosen)


_TRAIN_UID = re.compile(r"e(\d+)-r(\d+)")
_EVAL_UID = re.compile(r"eval-v(\d+)-(\d+)")


def eval_uid(version: int, row: int) -> str:
    """The uid of test row `row` in the evaluation of policy version `version`."""
    return f"eval-v{version}-{row}"


def eval_uid_issued(uid: str, current_version: int, n_rows: int) -> bool:
    """Whether `uid` can be a question of one of this run's evaluations so far: an eval uid
    of a version not newer than the current one and a row of the test set. Evaluations are
    not checkpointed, so the test is the uid's form, not a record of each one."""
    match = _EVAL_UID.fullmatch(uid)
    return (match is not None and uid == eval_uid(int(match[1]), int(match[2]))
            and int(match[1]) <= current_version and int(match[2]) < n_rows)


def ground_truth_of(row: dict[str, Any]) -> Any:
    """verl's `reward_model.ground_truth` (the whole reward_model when it has none)."""
    reward_model = row.get("reward_model") or {}
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        return reward_model["ground_truth"]
    return reward_model


def group_from_row(
    row: dict[str, Any],
    uid: str,
    n: int,
    *,
    kind: str = "train",
    policy_version_min: int = 0,
    attempt: int = 0,
    sampling: dict[str, float] | None = None,
    namespace: str = "",
) -> PromptGroup:
    extra = dict(row.get("extra_info") or {})
    return PromptGroup(
        uid=uid,
        data_source=str(row["data_source"]),
        prompt=row["prompt"],
        ground_truth=ground_truth_of(row),
        n=n,
        extra=extra,
        policy_version_min=policy_version_min,
        kind=kind,  # type: ignore[arg-type]
        sampling=dict(sampling or {}),
        attempt=attempt,
        namespace=namespace,
    )


class PromptSource:
    """Endless stream of (uid, row index) over `rows` in seeded epochs, with a resumable cursor."""

    def __init__(self, rows: Sequence[dict[str, Any]], seed: int, shuffle: bool = True) -> None:
        if not rows:
            raise ValueError("the training set has no rows (data.train_files)")
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = epoch_order(len(rows), seed, 0, shuffle)
        self._places: dict[int, int] | None = None  # row -> place in this epoch's order

    def next(self) -> tuple[str, int]:
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = epoch_order(len(self.rows), self.seed, self.epoch, self.shuffle)
            self._places = None
        index = self._order[self.position]
        self.position += 1
        return f"e{self.epoch}-r{index}", index

    def take(self, count: int) -> list[tuple[str, int]]:
        return [self.next() for _ in range(count)]

    def cursor(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def restore(self, cursor: dict[str, Any]) -> None:
        self.epoch = int(cursor.get("epoch", 0))
        self.position = int(cursor.get("position", 0))
        self._order = epoch_order(len(self.rows), self.seed, self.epoch, self.shuffle)
        self._places = None

    def issued(self, uid: str) -> bool:
        """Whether `next` has handed out `uid` since the run began: a row of an earlier epoch,
        or one before the cursor in this epoch. The cursor is checkpointed, so after a resume
        this still holds for the groups issued up to the checkpoint."""
        match = _TRAIN_UID.fullmatch(uid)
        if match is None:
            return False
        epoch, row = int(match[1]), int(match[2])
        if uid != f"e{epoch}-r{row}" or row >= len(self.rows) or epoch > self.epoch:
            return False
        if epoch < self.epoch:
            return True
        if self._places is None:
            self._places = {r: place for place, r in enumerate(self._order)}
        return self._places[row] < self.position


def check_dataset_sources(cfg: Any) -> set[str]:
    """Fail at start-up when a train or test file holds a `data_source` that no reward function
    handles (built in, or added by `scorer.rewards`): the scorer would dead-letter every such
    trajectory and the run would only time out. Reads just that column of each file; the list
    of known sources comes from services.common, never from the scorer."""
    from services.tasks.datasets import check_file_sources

    return check_file_sources([*cfg.data.train_files, *cfg.data.test_files], cfg.scorer.rewards)


def load_dataset(files: Iterable[str], limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of every RL parquet in `files`, checked (DatasetError names file, row and column)."""
    from services.tasks.datasets import load_rows

    rows: list[dict[str, Any]] = []
    for path in files:
        rows.extend(load_rows(path, kind="rl"))
    return rows[:limit] if limit is not None else rows
