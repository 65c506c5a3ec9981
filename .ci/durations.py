"""Time by area from a pytest JUnit XML report: seconds summed per top-level folder of tests/
(each test's setup, call and teardown, as the report counts them), with counts.

    python3 .ci/durations.py [.ci/out/junit.xml] [--save tests/file_seconds.json]

`--save` also writes the seconds per test file, which a parallel run uses to start the longest
files first (tests/parallel.py); refresh it from a clean clone's run when files change a lot.

Standard library only. Prints a note and exits 0 when the report is missing or unreadable:
`.ci/run` runs it after `make test` and keeps make's exit status whatever happens here.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / ".ci" / "out" / "junit.xml"
TOP = "(tests/*.py)"


def area(classname: str) -> str:
    """tests.learner.test_trainer[.Class] -> learner; tests.test_docs_run -> (tests/*.py)."""
    parts = classname.split(".")
    if len(parts) < 2 or parts[0] != "tests":
        return "(collection)" if not classname else classname
    return parts[1] if (REPO / "tests" / parts[1]).is_dir() else TOP


def file_of(classname: str) -> str | None:
    """tests.learner.test_trainer[.Class] -> tests/learner/test_trainer.py (the longest prefix
    that names a file here)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        candidate = "/".join(parts[:end]) + ".py"
        if (REPO / candidate).is_file():
            return candidate
    return None


def file_seconds(path: Path) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(path).getroot().iter("testcase"):
        name = file_of(case.get("classname", ""))
        if name:
            seconds[name] += float(case.get("time") or 0.0)
    return {name: round(value, 1) for name, value in sorted(seconds.items())}


def summarize(path: Path) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    rows: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    for case in ET.parse(path).getroot().iter("testcase"):
        row = rows[area(case.get("classname", ""))]
        row["seconds"] += float(case.get("time") or 0.0)
        row["tests"] += 1
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        row[outcome] += 1
        totals[outcome] += 1
    return rows, totals


def main(argv: list[str]) -> int:
    args = list(argv[1:])
    save = None
    if "--save" in args:
        at = args.index("--save")
        save = Path(args[at + 1]) if at + 1 < len(args) else None
        del args[at:at + 2]
    path = Path(args[0]) if args else DEFAULT
    try:
        rows, totals = summarize(path)
    except (OSError, ET.ParseError) as exc:
        print(f"durations: no time by area ({path}: {exc})")
        return 0
    total = sum(row["seconds"] for row in rows.values()) or 1.0
    print(f"\ntime by area ({path.relative_to(REPO) if path.is_relative_to(REPO) else path})")
    print(f"{'area':<16}{'seconds':>10}{'share':>8}{'tests':>8}{'failed':>8}{'skipped':>9}")
    for name, row in sorted(rows.items(), key=lambda item: -item[1]["seconds"]):
        print(f"{name:<16}{row['seconds']:>10.1f}{row['seconds'] / total:>8.0%}"
              f"{int(row['tests']):>8}{int(row['failed']):>8}{int(row['skipped']):>9}")
    print(f"{'all':<16}{sum(r['seconds'] for r in rows.values()):>10.1f}{'':>8}"
          f"{sum(int(r['tests']) for r in rows.values()):>8}")
    print(f"junit: {totals['passed']} passed, {totals['failed']} failed, "
          f"{totals['skipped']} skipped")
    if save is not None:
        save.write_text(json.dumps(file_seconds(path), indent=1) + "\n")
        print(f"seconds per file written to {save}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except Exception as exc:  # noqa: BLE001 - a report, never the run's verdict
        print(f"durations: failed to summarize ({type(exc).__name__}: {exc})")
        sys.exit(0)
