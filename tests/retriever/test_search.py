"""Each index type against a brute-force numpy search with the same encoder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.common.formats import corpus_contents
from services.retriever.build import build_index
from services.retriever.manifest import IndexLoadError
from services.retriever.searcher import Searcher

QUERIES = [
    "which place has a telescope for watching stars",
    "where do fishing boats hide from storms",
    "a dragon guarding gold in a cave",
    "fresh bread and cakes",
    "grapes and red wine on sunny hills",
    "copper and iron dug from tunnels",
    "old manuscripts and maps",
    "wolves and owls among oak trees",
    "stone walls and a moat",
    "a river flowing to the sea past mills",
    "New Library 48",
    "Upper Mine 99",
    "North Castle 151",
]


@pytest.fixture(scope="module")
def brute_force(corpus, flat_searcher):
    """Exact top-k by numpy over embeddings computed directly with sentence-transformers."""
    _, rows = corpus
    contents = [
        row["contents"] if "contents" in row else corpus_contents(row["title"], row["text"])
        for row in rows
    ]
    model = flat_searcher.encoder.model
    passages = model.encode(contents, normalize_embeddings=True, convert_to_numpy=True)
    queries = model.encode(QUERIES, normalize_embeddings=True, convert_to_numpy=True)
    scores = queries @ passages.T
    order = np.argsort(-scores, axis=1, kind="stable")
    return scores, order


def _ids(results):
    return [[int(doc["id"]) for doc, _ in per_query] for per_query in results]


def test_flat_equals_brute_force(flat_searcher, brute_force):
    scores, order = brute_force
    results = flat_searcher.search(QUERIES, 5)
    assert _ids(results) == order[:, :5].tolist()
    for q, per_query in enumerate(results):
        for doc, score in per_query:
            assert score == pytest.approx(float(scores[q, int(doc["id"])]), abs=1e-4)
    # scores are cosines, best first
    for per_query in results:
        values = [score for _, score in per_query]
        assert values == sorted(values, reverse=True) and all(-1 <= v <= 1.0001 for v in values)


def test_docs_are_search_r1_rows(flat_searcher, corpus):
    _, rows = corpus
    (odd,) = [row for row in rows if row["id"] == 41]
    doc = flat_searcher.docstore.get(41)
    assert doc == {"id": "41", "contents": corpus_contents(odd["title"], odd["text"])}
    assert flat_searcher.docstore.get(40) == rows[40]  # id+contents rows come back as written


def test_search_many_mixed_topk_matches_single(flat_searcher):
    topks = [1, 3, 2, 5, 3]
    mixed = flat_searcher.search_many(QUERIES[:5], topks)
    for query, k, got in zip(QUERIES[:5], topks, mixed, strict=True):
        alone = flat_searcher.search([query], k)[0]
        # same docs in the same order; scores equal up to float noise from batch padding
        assert [doc for doc, _ in got] == [doc for doc, _ in alone]
        assert [s for _, s in got] == pytest.approx([s for _, s in alone], abs=1e-5)


def test_topk_larger_than_corpus(flat_searcher):
    (results,) = flat_searcher.search(["bread"], 1000)
    assert len(results) == len(flat_searcher) == 200
    assert len({doc["id"] for doc, _ in results}) == 200


@pytest.mark.parametrize("index_type, params", [
    ("hnsw", None),
    ("ivf", {"nlist": 16, "nprobe": 8}),  # not exhaustive: half the lists are searched
    # compressed kinds (test_compressed.py has the rest): 8-bit codes lose little
    ("ivf-sq8", {"nlist": 4, "nprobe": 4}),
    ("hnsw-sq8", None),
    ("IVF4,SQfp16", None),
])
def test_approximate_recall(index_type, params, corpus, brute_force, tmp_path):
    out = build_index(corpus[0], tmp_path / index_type, index_type, show_progress=False,
                      params=params)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["index_type"] == index_type and manifest["count"] == 200
    if index_type not in ("hnsw", "ivf"):
        assert manifest["params"]["train_size"] == 200 and manifest["params"]["train_seed"] == 0
    searcher = Searcher.load(out)
    _, order = brute_force
    got = _ids(searcher.search(QUERIES, 3))
    hits = sum(len(set(g) & set(order[q, :3].tolist())) for q, g in enumerate(got))
    assert hits / (3 * len(QUERIES)) >= 0.95


def test_bm25_ranks_exact_keyword_first(corpus, keyword, tmp_path):
    KEYWORD, KEYWORD_ROW = keyword  # noqa: N806
    out = build_index(corpus[0], tmp_path / "bm25", "bm25", show_progress=False)
    searcher = Searcher.load(out)
    (results,) = searcher.search([f"what does {KEYWORD} mean"], 3)
    assert results[0][0]["id"] == str(KEYWORD_ROW)
    assert results[0][1] > 0
    # a query that shares no term with any passage gets no hits rather than random rows
    assert searcher.search(["qwertyuiop"], 3) == [[]]
    # ranking a title keyword: the exact place number matches
    (results,) = searcher.search(["observatory 96"], 1)
    assert results[0][0]["id"] == "96"


def test_corrupt_faiss_file_is_a_load_error(flat_index, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(flat_index, copy)
    size = (copy / "index.faiss").stat().st_size
    (copy / "index.faiss").write_bytes(b"\0" * size)
    with pytest.raises(IndexLoadError, match="index.faiss is corrupt"):
        Searcher.load(copy)


def test_missing_or_unfinished_index_is_a_load_error(tmp_path):
    with pytest.raises(IndexLoadError, match="does not exist"):
        Searcher.load(tmp_path / "nope")
    (tmp_path / "half").mkdir()
    with pytest.raises(IndexLoadError, match="no manifest.json"):
        Searcher.load(tmp_path / "half")


def test_query_dtype_auto_follows_the_device_and_the_cpu() -> None:
    from services.retriever.encoder import resolve_query_dtype

    assert resolve_query_dtype("auto", "cuda:0", frozenset()) == "float16"  # Search-R1's fp16
    assert resolve_query_dtype("auto", "cpu", frozenset({"avx512f", "avx512_bf16"})) == "bfloat16"
    assert resolve_query_dtype("auto", "cpu", frozenset({"amx_bf16"})) == "bfloat16"
    assert resolve_query_dtype("auto", "cpu", frozenset({"avx2"})) == "float32"
    assert resolve_query_dtype("float32", "cuda", frozenset()) == "float32"  # as written
    with pytest.raises(ValueError, match="query_dtype"):
        resolve_query_dtype("int8", "cpu", frozenset())


def test_bfloat16_queries_find_what_float32_queries_find(flat_index, flat_searcher) -> None:
    """Reduced-precision query encoding (retriever.query_dtype) against the float32 index:
    the same top-1 passage for every query, vectors and scores within rounding of float32."""
    from services.retriever.searcher import Searcher

    half = Searcher.load(flat_index, query_dtype="bfloat16")
    assert half.encoder.dtype == "bfloat16" and flat_searcher.encoder.dtype == "float32"
    assert half.encoder.model is not flat_searcher.encoder.model  # its own copy
    queries = ["castle on a hill", "fresh bread every morning", "wolves in the forest",
               "a telescope to study comets", "the old mine", "harbor at dawn",
               "library of rare books", "dragon over the river"] * 2
    full_vectors = flat_searcher.encoder.encode_queries(queries)
    half_vectors = half.encoder.encode_queries(queries)
    assert half_vectors.dtype == np.float32
    assert (full_vectors * half_vectors).sum(axis=1).min() > 0.999
    want, got = flat_searcher.search(queries, 3), half.search(queries, 3)
    for wanted, found in zip(want, got, strict=True):
        assert found[0][0]["id"] == wanted[0][0]["id"]
        assert found[0][1] == pytest.approx(wanted[0][1], abs=5e-3)
    with pytest.raises(ValueError, match="float32"):
        half.encoder.encode_passages(["a passage"])
