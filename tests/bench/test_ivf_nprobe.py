"""bench/ivf_nprobe.py runs as documented at toy size: recall of ivf-pq + exact re-ranking rises
to flat's as nprobe reaches every list, and the cold-cache read count sees the pages the
re-ranking reads (none cached before a query, at least its candidates' pages read)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ivf_nprobe_synthetic(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "ivf_nprobe.py"), "synthetic", "--n", "4000",
         "--dim", "128", "--centres", "40", "--queries", "100", "--nlist", "100",
         "--nprobe", "1,100", "--reads", "5", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    one, every = data["sweep"]
    assert (one["nprobe"], every["nprobe"]) == (1, 100) and every["share"] == 1.0
    assert every["wiki_nprobe_same_share"] == 18_336  # all lists here = all of wiki-18's
    assert every["recall10_refine"] >= 0.99 > one["recall10_refine"]
    assert every["recall10_refine"] >= every["recall10_codes"]
    reads = {row["advice"]: row for row in data["reads"]}
    for row in reads.values():
        assert row["cache_before"] == 0  # the file's pages were dropped
        assert row["candidates_per_query"] == 100
        assert row["pages_read_per_query"] >= row["pages_touched_per_query"]  # each query cold
