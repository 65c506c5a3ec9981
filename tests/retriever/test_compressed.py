"""Compressed FAISS kinds (presets and factory strings), query-time nprobe / efSearch, mmap,
exact re-ranking (`--refine`).

Tiny corpora: IVF kinds use 4 lists, PQ 4-bit codes (16 centroids per sub-quantizer), so that
training works on 200 vectors; FAISS warns below 39 points per centroid, which is expected.
"""

from __future__ import annotations

import subprocess

import httpx
import numpy as np
import pytest

from services.retriever.build import BuildError, build_index
from services.retriever.manifest import IndexLoadError
from services.retriever.searcher import Searcher

QUERIES = ["which place has a telescope for watching stars", "fresh bread and cakes",
           "copper and iron dug from tunnels", "stone walls and a moat", "Upper Mine 99"]


@pytest.fixture(scope="module")
def built(corpus, tmp_path_factory) -> dict[str, object]:
    """One index per kind over the 200-passage corpus, built once for the module."""
    root = tmp_path_factory.mktemp("compressed")
    kinds = {
        "ivf-pq": {"nlist": 4},
        "PCA64,IVF4,SQ8": None,  # a pre-transform (OPQ needs 256 centroids: too few rows)
        "ivf-sqfp16": {"nlist": 4},
    }
    out = {kind: build_index(corpus[0], root / kind.replace(",", "_"), kind,
                             show_progress=False, params=params)
           for kind, params in kinds.items()}
    out["ivf-pq refine"] = build_index(corpus[0], root / "ivf-pq-refine", "ivf-pq",
                                       show_progress=False, params={"nlist": 4}, refine=True,
                                       k_factor=20)
    return out


@pytest.mark.parametrize("kind, recall", [("ivf-pq", 0.6), ("PCA64,IVF4,SQ8", 0.5),
                                          ("ivf-sqfp16", 0.95)])
def test_compressed_kind_keeps_the_contract(kind, recall, built, flat_searcher):
    """topk passages per query, best first, scores near the exact cosines, docs as the flat
    index returns them, and recall@3 against the exact index above the kind's floor."""
    searcher = Searcher.load(built[kind])
    exact = flat_searcher.search(QUERIES, 3)
    got = searcher.search(QUERIES, 3)
    hits = 0
    for want, have in zip(exact, got, strict=True):
        assert len(have) == 3
        scores = [score for _, score in have]
        assert scores == sorted(scores, reverse=True)
        assert all(-1.01 <= score <= 1.01 for score in scores)
        assert set(have[0][0]) >= {"id", "contents"}
        hits += len({d["id"] for d, _ in have} & {d["id"] for d, _ in want})
        if not kind.startswith("PCA"):  # PCA drops dimensions: its scores are lower
            assert have[0][1] == pytest.approx(want[0][1], abs=0.15)
    assert hits / (3 * len(QUERIES)) >= recall


def test_refine_returns_the_flat_index_s_results(built, flat_searcher):
    """IVF-PQ with exact re-ranking: the flat index's passages, order and scores (the codes
    alone give neither), from vectors memory-mapped off disk; the build moved its embeddings
    into the index rather than copying them, and checksummed them."""
    import json

    refined = Searcher.load(built["ivf-pq refine"])
    plain = Searcher.load(built["ivf-pq"])
    assert isinstance(refined.refine, np.memmap) and refined.k_factor == 20
    exact = flat_searcher.search(QUERIES, 3)
    got = refined.search(QUERIES, 3)
    assert [[d["id"] for d, _ in r] for r in got] == [[d["id"] for d, _ in r] for r in exact]
    for want, have in zip(exact, got, strict=True):
        assert [s for _, s in have] == pytest.approx([s for _, s in want], abs=1e-5)
    approximate = plain.search(QUERIES, 3)
    assert any(abs(a[0][1] - b[0][1]) > 1e-3 for a, b in zip(approximate, exact, strict=True))
    # fewer candidates than k_factor * k (k beyond the corpus): every row, re-ranked
    assert [len(r) for r in refined.search(QUERIES[:1], 500)] == [200]
    manifest = json.loads((built["ivf-pq refine"] / "manifest.json").read_text())
    assert manifest["params"]["refine"] == "flat" and manifest["params"]["k_factor"] == 20
    assert manifest["files"]["refine.npy"] == (built["ivf-pq refine"] / "refine.npy").stat(
        ).st_size
    assert "refine.npy" in manifest["checksums"]
    assert not list(built["ivf-pq refine"].glob("embeddings*"))
    # retriever.k_factor overrides the build's depth; k_factor 1 re-ranks only k candidates
    assert Searcher.load(built["ivf-pq refine"], search_params={"k_factor": 1}).k_factor == 1


def test_refine_errors_name_the_problem(built, corpus, tmp_path):
    with pytest.raises(BuildError, match="already stores the exact vectors"):
        build_index(corpus[0], tmp_path / "f", "flat", show_progress=False, refine=True)
    with pytest.raises(BuildError, match="add --refine"):
        build_index(corpus[0], tmp_path / "f", "ivf-pq", show_progress=False, k_factor=5)
    with pytest.raises(BuildError, match="bm25"):
        build_index(corpus[0], tmp_path / "f", "bm25", show_progress=False, refine=True)
    with pytest.raises(IndexLoadError, match="built without --refine"):
        Searcher.load(built["ivf-pq"], search_params={"k_factor": 5})
    from services.retriever.indexes import open_refine

    bad = tmp_path / "refine.npy"
    np.save(bad, np.zeros((3, 2), dtype=np.float16))
    with pytest.raises(ValueError, match=r"float32 \(200, 384\)"):
        open_refine(bad, 200, 384)


def test_manifest_records_factory_and_training_sample(built):
    import json

    manifest = json.loads((built["ivf-pq"] / "manifest.json").read_text())
    assert manifest["index_type"] == "ivf-pq"
    params = manifest["params"]
    assert params["factory"] == "IVF4,PQ64x4"  # 384-d MiniLM: 64 sub-quantizers, 4-bit
    assert params["nlist"] == 4 and params["nprobe"] == 4
    assert params["train_size"] == 200 and params["train_seed"] == 0
    assert manifest["build_key"]["params"] == params


def test_per_search_nprobe_and_ef_search(built, corpus, tmp_path):
    """nprobe=1 searches one list of four (fewer candidates), nprobe=4 all of them; the index's
    own default is untouched by a per-search value."""
    searcher = Searcher.load(built["ivf-sqfp16"])
    assert searcher.knobs == {"nprobe"}
    full = searcher.search_many(QUERIES, [5] * len(QUERIES), [(4, None)] * len(QUERIES))
    assert full == searcher.search(QUERIES, 5)  # default nprobe is 4 = every list
    narrow = searcher.search_many(QUERIES, [50] * len(QUERIES), [(1, None)] * len(QUERIES))
    assert any(len(r) < 50 for r in narrow)  # one list of 4 holds fewer than 50 passages
    assert searcher.search(QUERIES, 5) == full
    opq = Searcher.load(built["PCA64,IVF4,SQ8"])  # through the PCA pre-transform
    assert opq.knobs == {"nprobe"}
    one = opq.search_many(QUERIES, [50] * len(QUERIES), [(1, None)] * len(QUERIES))
    assert any(len(r) < 50 for r in one)
    hnsw = build_index(corpus[0], tmp_path / "hnsw", "HNSW8,SQ8", show_progress=False)
    graph = Searcher.load(hnsw)
    assert graph.knobs == {"ef_search"}
    wide = graph.search_many(QUERIES, [3] * len(QUERIES), [(None, 400)] * len(QUERIES))
    assert [len(r) for r in wide] == [3] * len(QUERIES)


def test_config_knob_the_index_lacks_is_a_load_error(built):
    with pytest.raises(IndexLoadError, match="retriever.ef_search"):
        Searcher.load(built["ivf-sqfp16"], search_params={"ef_search": 64})
    searcher = Searcher.load(built["ivf-sqfp16"], search_params={"nprobe": 1, "ef_search": None})
    assert searcher.index.nprobe == 1


def test_mmap_load_matches_a_normal_load(built, flat_index):
    for directory in (built["ivf-pq"], built["ivf-sqfp16"], flat_index):
        mapped, read = Searcher.load(directory, mmap=True), Searcher.load(directory)
        assert mapped.search(QUERIES, 5) == read.search(QUERIES, 5)
    from services.retriever.indexes import mmap_flag

    with pytest.raises(ValueError, match="cannot be memory-mapped"):
        mmap_flag("PQ16x4", "PQ16x4")  # no IVF lists, no flat code array
    with pytest.raises(ValueError, match="cannot be memory-mapped"):
        mmap_flag("ivf-pq", "LSH")


@pytest.mark.slow  # a CLI process that loads the encoder (~10 s on a busy box)
def test_bad_factory_string_is_a_one_line_error(corpus, tmp_path, tools):
    result = subprocess.run(
        [tools.forage, "retriever", "build-index", "--corpus", str(corpus[0]), "--out",
         str(tmp_path / "bad"), "--index", "IVF4,PQ7", "--log-level", "WARNING"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines()
              if line.startswith("forage retriever build-index: error:")]
    assert len(errors) == 1 and "'IVF4,PQ7'" in errors[0] and "factory" in errors[0], \
        result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "bad").exists()
    with pytest.raises(BuildError, match="index type"):
        build_index(corpus[0], tmp_path / "bad", "IVF4,Bogus", show_progress=False)


def test_too_few_training_vectors_is_a_build_error_and_the_rerun_resumes(tmp_path, tools):
    path = tmp_path / "c.jsonl"
    tools.make_corpus(path, rows=20)
    with pytest.raises(BuildError, match="cannot be built over 20 vectors"):
        build_index(path, tmp_path / "x", "IVF64,Flat", show_progress=False)
    # the encoded rows are kept, as for any build that fails after its first checkpoint, and
    # a rerun with a kind that fits uses them
    stage = tmp_path / ".x.partial"
    assert (stage / "embeddings.npy").exists()
    out = build_index(path, tmp_path / "x", "IVF2,Flat", show_progress=False)
    assert Searcher.load(out).search(["bread"], 2)[0]
    assert not stage.exists()


@pytest.mark.slow  # a server process (~15 s on a busy box)
def test_served_compressed_index_speaks_search_r1(built, tools):
    """A server over an IVF-PQ index with exact re-ranking, memory-mapped, with a config nprobe
    and k_factor: Search-R1's wire format, per-request nprobe, and 422s for bad or absent
    knobs."""
    port = tools.free_port()
    process = tools.start_server(
        ["--index", str(built["ivf-pq refine"]), "--set", "retriever.mmap=true",
         "--set", "retriever.nprobe=2", "--set", "retriever.k_factor=5",
         "--set", "retriever.query_dtype=float32"], port)
    url = f"http://127.0.0.1:{port}/retrieve"
    try:
        body = httpx.post(url, json={"queries": QUERIES[:2], "topk": 3}, timeout=30).json()
        assert [len(r) for r in body["result"]] == [3, 3]
        assert set(body["result"][0][0]) >= {"id", "contents"}
        scored = httpx.post(url, json={"queries": QUERIES[:2], "topk": 3, "return_scores": True,
                                       "nprobe": 4}, timeout=30).json()
        first = scored["result"][0]
        assert set(first[0]) == {"document", "score"}
        assert [d["score"] for d in first] == sorted((d["score"] for d in first), reverse=True)
        local = Searcher.load(built["ivf-pq refine"], search_params={"k_factor": 5})
        want = local.search_many(QUERIES[:2], [3, 3], [(4, None), (4, None)])
        assert [[d["document"]["id"] for d in r] for r in scored["result"]] == \
            [[doc["id"] for doc, _ in r] for r in want]
        spec = httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=30).json()
        fields = spec["paths"]["/retrieve"]["post"]["requestBody"]["content"][
            "application/json"]["schema"]["properties"]
        assert "nprobe" in fields and "efSearch" not in fields
        for bad in ({"nprobe": 0}, {"nprobe": 1.5}, {"efSearch": 32}):
            response = httpx.post(url, json={"queries": ["x"], **bad}, timeout=30)
            assert response.status_code == 422, response.text
            assert response.json()["detail"].startswith(next(iter(bad)))
    finally:
        tools.stop_server(process)
    assert np.isfinite(first[0]["score"])


def test_refine_reads_only_the_pages_it_needs_from_a_cold_file(tmp_path):
    """The re-ranking vectors are mapped for random reads: one row read from a file whose pages
    are not in memory reads that row's pages, not the read-around window of a mapping's page
    fault (8 MiB on this machine: without the advice this test read 8,388,608 bytes for the
    row, and a cold wiki-scale query 681 MiB). Counted in /proc/self/io's read_bytes."""
    import os
    from pathlib import Path

    from services.retriever.indexes import open_refine

    path = tmp_path / "refine.npy"
    np.save(path, np.random.default_rng(0).standard_normal((4096, 768), dtype=np.float32))

    def read_bytes() -> int:
        line = next(x for x in Path("/proc/self/io").read_text().splitlines()
                    if x.startswith("read_bytes:"))
        return int(line.split()[1])

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # as if the file were cold
    finally:
        os.close(fd)
    matrix = open_refine(path, 4096, 768)
    before = read_bytes()
    assert np.isfinite(float(matrix[2000].sum()))  # one 3 KiB row, on at most 2 pages
    moved = read_bytes() - before
    assert 0 < moved <= 4 * 4096, f"{moved} bytes read for one row"
