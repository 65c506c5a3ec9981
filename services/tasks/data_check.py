"""`forage data check`: every problem of a dataset file in one pass, not only the first.

The learner's loader (`datasets.load_rows`) stops at the first bad row, which is right for a
service starting up but makes fixing a dataset a loop of one error per run. This check reads the
whole file and reports, grouped by problem, every bad row (with the same per-row rules as the
loader), every row whose ground truth has an empty target (it can never be matched, so its
reward is always 0: `empty_target`), and every data source no reward function scores (with its
row count), so one run lists everything to fix.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.tasks.datasets import (
    _check_rl_row,
    _check_sft_row,
    read_table,
)


@dataclass
class CheckReport:
    path: str
    kind: str
    rows: int = 0
    # problem text -> row indices (0-based, as the loader's messages count them)
    problems: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    sources: Counter[str] = field(default_factory=Counter)
    unknown_sources: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    known_sources: list[str] = field(default_factory=list)

    @property
    def bad_rows(self) -> int:
        rows: set[int] = set()
        for indices in (*self.problems.values(), *self.unknown_sources.values()):
            rows.update(indices)
        return len(rows)

    @property
    def rows_with_problems(self) -> int:
        """Rows with a problem other than an unknown data source (those are counted apart)."""
        return len({index for indices in self.problems.values() for index in indices})

    @property
    def ok(self) -> bool:
        return not self.problems and not self.unknown_sources

    def lines(self, max_rows: int = 20) -> list[str]:
        """The bad rows: one line per problem with its row count and rows."""
        return [f"{_rows(indices, max_rows)}: {problem}"
                for problem, indices in self.problems.items()]

    def unknown_sources_line(self, max_rows: int = 20) -> str | None:
        """One line naming every data source nothing scores, the known ones, and the rows."""
        from services.common.data_sources import UnknownDataSourceError, check_data_sources

        try:
            check_data_sources(self.unknown_sources, dict.fromkeys(self.known_sources),
                               where=self.path)
        except UnknownDataSourceError as exc:
            rows = "; ".join(f"{source!r}: {_rows(indices, max_rows)}"
                             for source, indices in sorted(self.unknown_sources.items()))
            return f"{exc}; {rows}"
        return None


def empty_target(ground_truth: Any) -> bool:
    """True when a ground truth cannot be matched by any answer: a blank string, a list of
    blank strings, or a map whose `target` (Search-R1's key) is null, blank or such a list.
    Numbers (countdown's target) and maps without `target` (users' rewards) are not empty."""
    if isinstance(ground_truth, Mapping):
        if "target" not in ground_truth:
            return False
        return ground_truth["target"] is None or empty_target(ground_truth["target"])
    if isinstance(ground_truth, str):
        return not ground_truth.strip()
    if isinstance(ground_truth, list | tuple):
        return not any(not empty_target(item) for item in ground_truth)
    if hasattr(ground_truth, "tolist"):  # numpy arrays from parquet readers
        return empty_target(ground_truth.tolist())
    return False


def check_dataset(path: str | os.PathLike[str], kind: str = "rl",
                  rewards: Mapping[str, Any] | None = None) -> CheckReport:
    """Check every row of a parquet the learner will read. A file that cannot be read at all
    (missing, not parquet, missing columns) raises DatasetError, as the loader does."""
    from services.common.data_sources import known_data_sources

    source = Path(path)
    table = read_table(source, kind)
    report = CheckReport(str(source), kind, known_sources=known_data_sources(rewards))
    known = set(report.known_sources)
    check = _check_rl_row if kind == "rl" else _check_sft_row
    for index, row in enumerate(table.to_pylist()):
        report.rows += 1
        problem = check(row)
        if problem:
            report.problems[problem].append(index)
            continue
        if kind != "rl":
            continue
        data_source = str(row["data_source"])
        report.sources[data_source] += 1
        if data_source not in known:
            report.unknown_sources[data_source].append(index)
        truth = row["reward_model"]["ground_truth"]
        if empty_target(truth):
            report.problems["empty target in reward_model.ground_truth: no answer can match "
                            "it (reward always 0)"].append(index)
    if report.rows == 0:
        report.problems["the file has no rows"] = []
    return report


def _rows(indices: list[int], max_rows: int) -> str:
    if not indices:
        return "file"
    shown = indices if max_rows <= 0 else indices[:max_rows]
    listed = ", ".join(str(i) for i in shown)
    more = f", ... ({len(indices) - len(shown)} more)" if len(shown) < len(indices) else ""
    noun = "row" if len(indices) == 1 else f"{len(indices)} rows"
    return f"{noun} {listed}{more}"
