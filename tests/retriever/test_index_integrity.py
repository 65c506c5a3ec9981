"""Index integrity and build leftovers (issue 14, item 10): checksums verified at load, a
corpus path that is a directory named as such, no `.partial` / `.lock` left by a failed
build (a resumable one keeps its stage), real `forage retriever` processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import httpx
import numpy as np
import pytest

from services.retriever.build import build_index
from services.retriever.corpus import CorpusError
from services.retriever.manifest import IndexLoadError, check_index_dir, file_checksum
from services.retriever.searcher import Searcher


@pytest.fixture()
def bm25_index(tmp_path, tools):
    corpus = tmp_path / "small.jsonl"
    tools.make_corpus(corpus, rows=24, seed=3)
    return build_index(corpus, tmp_path / "idx", "bm25", show_progress=False)


def _corrupt_offsets(index_dir) -> None:
    """Same size, different bytes: offsets of row 3 onwards point into the middle of rows."""
    path = index_dir / "docs.offsets.npy"
    size = path.stat().st_size
    offsets = np.load(path)
    offsets[3:] += 7
    np.save(path, offsets)
    assert path.stat().st_size == size


def test_manifest_records_a_checksum_per_file(bm25_index):
    manifest = json.loads((bm25_index / "manifest.json").read_text())
    assert set(manifest["checksums"]) == set(manifest["files"])
    for name, checksum in manifest["checksums"].items():
        assert checksum == file_checksum(bm25_index / name)
        assert checksum.startswith("xxh3_64:")


def test_a_same_size_corrupt_offsets_file_is_refused_at_load(bm25_index, tmp_path, tools):
    copy = tmp_path / "copy"
    shutil.copytree(bm25_index, copy)
    _corrupt_offsets(copy)
    with pytest.raises(IndexLoadError, match=r"docs\.offsets\.npy is corrupt: its checksum"):
        check_index_dir(copy)
    with pytest.raises(IndexLoadError, match="checksum"):
        Searcher.load(copy)
    result = subprocess.run([tools.forage, "retriever", "serve", "--index", str(copy),
                             "--port", str(tools.free_port())],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines()
             if line.startswith("forage retriever serve: error:")]
    assert len(lines) == 1 and "docs.offsets.npy" in lines[0] and "checksum" in lines[0]
    assert "Traceback" not in result.stderr


def test_the_intact_index_serves(bm25_index, tools):
    port = tools.free_port()
    process = tools.start_server(["--index", str(bm25_index)], port)
    try:
        reply = httpx.post(f"http://127.0.0.1:{port}/retrieve",
                           json={"queries": ["castle walls"], "topk": 3}, timeout=30)
        assert reply.status_code == 200 and len(reply.json()["result"][0]) == 3
    finally:
        tools.stop_server(process)


def test_an_index_without_checksums_still_loads_by_size(bm25_index):
    manifest = json.loads((bm25_index / "manifest.json").read_text())
    del manifest["checksums"]
    (bm25_index / "manifest.json").write_text(json.dumps(manifest))
    assert check_index_dir(bm25_index)["count"] == 24


def test_a_corpus_that_is_a_directory_is_named_as_one(tmp_path, tools):
    with pytest.raises(CorpusError, match="is a directory; give the JSONL file"):
        build_index(tmp_path, tmp_path / "out", "bm25", show_progress=False)
    result = subprocess.run([tools.forage, "retriever", "build-index", "--corpus",
                             str(tmp_path), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "is a directory" in result.stderr and "does not exist" not in result.stderr


def _leftovers(parent) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_failed_and_finished_builds_leave_no_partial_or_lock(tmp_path, tools):
    corpus = tmp_path / "bad.jsonl"
    tools.make_corpus(corpus, rows=40, seed=1)
    corpus.write_text(corpus.read_text() + '{"id": "x"}\n')  # the last row has no contents
    out_parent = tmp_path / "indexes"
    with pytest.raises(CorpusError, match="row 41"):
        build_index(corpus, out_parent / "idx", "bm25", show_progress=False,
                    checkpoint_rows=8)
    assert _leftovers(out_parent) == []
    result = subprocess.run([tools.forage, "retriever", "build-index", "--corpus", str(corpus),
                             "--out", str(out_parent / "idx"), "--index", "bm25"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "row 41" in result.stderr
    assert _leftovers(out_parent) == []
    good = tmp_path / "good.jsonl"
    tools.make_corpus(good, rows=12, seed=2)
    build_index(good, out_parent / "idx", "bm25", show_progress=False)
    assert _leftovers(out_parent) == []
    assert not (out_parent / "idx" / ".lock").exists()


@pytest.mark.slow
def test_an_interrupted_build_keeps_its_stage_and_drops_its_lock(tmp_path, tools):
    """Ctrl-C after some rows are encoded: the stage stays for the rerun, the lock goes."""
    corpus = tmp_path / "big.jsonl"
    # Large enough that the build cannot finish between its first checkpoint (128 rows) and the
    # signal on a quiet machine (with 320 rows it sometimes did, and left no stage to check).
    tools.make_corpus(corpus, rows=4000, seed=5)
    stage = tmp_path / ".idx.partial"
    process = subprocess.Popen(
        [tools.forage, "retriever", "build-index", "--corpus", str(corpus), "--out",
         str(tmp_path / "idx"), "--batch-size", "8", "--no-progress"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
        # As in a terminal: a suite started in the background by a non-interactive shell (CI)
        # passes SIGINT down as ignored, and the build would then never see the Ctrl-C.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and process.poll() is None:
            progress = stage / "progress.json"
            if progress.exists() and json.loads(progress.read_text())["rows"] >= 64:
                break
            time.sleep(0.05)
        assert process.poll() is None, "the build ended before it could be interrupted"
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    done = json.loads((stage / "progress.json").read_text())["rows"]
    assert 0 < done < 4000, "the build finished before it could be interrupted"
    assert process.returncode != 0
    assert not (tmp_path / ".idx.lock").exists()
    assert not (tmp_path / "idx").exists()
