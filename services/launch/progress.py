"""One console line per learner step (and per evaluation), read from RUN_DIR/metrics.jsonl.

The learner runs in its own process; following its metrics file is how `forage up` and
`forage demo` show progress without a second channel between them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def format_line(record: dict[str, Any], total_steps: int | None = None) -> str:
    if record.get("kind") == "eval":
        k = record.get("eval/samples_per_question")
        sampled = (f" (mean@{k}, pass@{k} {record.get(f'eval/pass@{k}') or 0:.3f})"
                   if k and k > 1 else "")
        return (f"eval  @ step {record.get('step', 0):>3}: EM {record.get('eval/em') or 0:.3f}"
                f"{sampled} over {record.get('eval/n', 0)} questions, searches "
                f"{record.get('eval/searches/mean', 0):.2f}  ({record.get('eval/seconds', 0):.0f}s)")
    total = f"/{total_steps}" if total_steps else ""
    return (f"step {record.get('step', 0):>3}{total}  reward {record.get('reward/mean', 0):.3f}  "
            f"EM {record.get('em/mean', 0):.3f}  searches {record.get('searches/mean', 0):.2f}  "
            f"staleness {record.get('staleness/mean', 0):.2f}  "
            f"step {record.get('timing/step_s', 0):.1f}s  elapsed "
            f"{record.get('elapsed_s', 0):.0f}s")


def _print(line: str) -> None:
    print(line, flush=True)  # flushed: the console may be a pipe or a file (docker logs)


class MetricsFollower:
    """Calls `emit` with each complete new line of a metrics JSONL file."""

    def __init__(self, path: str | Path, emit: Callable[[str], None] = _print,
                 total_steps: int | None = None) -> None:
        self.path = Path(path)
        self.emit = emit
        self.total_steps = total_steps
        self.offset = 0
        self.records: list[dict[str, Any]] = []

    def poll(self) -> int:
        if not self.path.exists():
            return 0
        with self.path.open("rb") as fh:
            if self.path.stat().st_size < self.offset:  # rewritten (a resumed learner trims)
                self.offset = 0
            fh.seek(self.offset)
            data = fh.read()
        end = data.rfind(b"\n")
        if end < 0:
            return 0
        self.offset += end + 1
        count = 0
        for line in data[: end + 1].decode(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.records.append(record)
            self.emit(format_line(record, self.total_steps))
            count += 1
        return count
