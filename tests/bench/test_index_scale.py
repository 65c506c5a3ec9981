"""bench/index_scale.py runs as documented, at toy size: a compressed kind, the same kind with
exact re-ranking (`+refine`), recall against the flat index and the wiki-18 projection."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_index_scale_with_refine(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "index_scale.py"), "--n", "4000", "--queries",
         "100", "--dim", "64", "--centres", "50", "--qps-seconds", "0.2", "--budget-gb", "8",
         "--kinds", "flat;IVF*,PQ8;IVF*,PQ8+refine", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["kind"]: row for row in json.loads(out.read_text())}
    assert rows["flat"]["recall10"] == 1.0
    plain, refined = rows["IVF*,PQ8"], rows["IVF*,PQ8+refine"]
    assert plain["recall10"] < 0.9 <= 0.95 <= refined["recall10"]  # 8-byte codes alone miss
    assert refined["recall10_codes"] == plain["recall10"]  # same build, same codes
    assert refined["projected_bytes"] == plain["projected_bytes"]  # the vectors stay on disk
    assert refined["refine_disk_bytes"] == 21_015_324 * 768 * 4 and plain["refine_disk_bytes"] == 0
    assert "IVF*,PQ8+refine" in result.stdout.splitlines()[-1]  # within 8 GB, best recall
