"""Search-R1's request shapes against a real server process with the shipped defaults:
one POST with 2560 queries (its GRPO trainer: 512 prompts × 5 samples), empty queries
(`<search> </search>`), the limits' 413s, and small requests interleaving with a large one."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from services.common.config.retriever import RetrieverSection

pytestmark = pytest.mark.slow

DEFAULTS = RetrieverSection()
WORDS = ["dragon", "bread", "telescope", "ships", "oak", "castle", "river", "wine", "books", "ore"]


@pytest.fixture(scope="module")
def default_server(flat_index, tools):
    """`forage retriever serve` with no config: every limit at its shipped default."""
    port = tools.free_port()
    # query_dtype float32: the answers are compared with the in-process float32 searcher
    process = tools.start_server(["--index", str(flat_index), "--topk", "3",
                                  "--set", "retriever.query_dtype=float32"], port)
    yield f"http://127.0.0.1:{port}"
    tools.stop_server(process)


def metric(server: str, name: str) -> float:
    text = httpx.get(f"{server}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def test_defaults_accept_search_r1_batch_sizes():
    assert DEFAULTS.max_queries_per_request >= 4096
    assert DEFAULTS.max_results_per_request >= 4096 * 3  # Search-R1 retrieves topk 3
    assert DEFAULTS.max_body_bytes >= 4096 * (DEFAULTS.max_query_chars + 4)


def test_2560_queries_in_one_post_answered_in_bounded_chunks(default_server, flat_searcher):
    queries = [f"{WORDS[i % 10]} {i}" for i in range(2560)]
    batches_before = metric(default_server, "forage_retriever_batch_queries_count")
    response = httpx.post(f"{default_server}/retrieve", timeout=300,
                          json={"queries": queries, "topk": 3, "return_scores": True})
    assert response.status_code == 200, response.text[:300]
    result = response.json()["result"]
    assert len(result) == 2560 and all(len(per_query) == 3 for per_query in result)
    for position in (0, 1, 777, 2559):  # in query order, each as if asked alone
        alone = flat_searcher.search([queries[position]], 3)[0]
        assert [item["document"] for item in result[position]] == [doc for doc, _ in alone]
    batches = metric(default_server, "forage_retriever_batch_queries_count") - batches_before
    assert batches >= 2560 / DEFAULTS.max_batch  # never one 2560-query encoder call


def test_over_the_limits_is_413_naming_the_limit(default_server):
    limit = DEFAULTS.max_queries_per_request
    over = httpx.post(f"{default_server}/retrieve", timeout=60,
                      json={"queries": ["x"] * (limit + 1), "topk": 3})
    assert over.status_code == 413
    assert over.json()["detail"] == f"queries: at most {limit} per request (got {limit + 1})"
    many = httpx.post(f"{default_server}/retrieve", timeout=60,
                      json={"queries": ["x"] * 1000, "topk": 100})
    assert many.status_code == 413
    assert "1000 queries × topk 100" in many.json()["detail"]
    assert str(DEFAULTS.max_results_per_request) in many.json()["detail"]


def test_empty_and_blank_queries_are_answered_like_search_r1(default_server, flat_searcher):
    """Search-R1's agent sends "" for `<search> </search>`; its server retrieves for it."""
    response = httpx.post(f"{default_server}/retrieve", timeout=60,
                          json={"queries": ["", "   ", "dragon"], "topk": 2,
                                "return_scores": True})
    assert response.status_code == 200, response.text
    result = response.json()["result"]
    for position, query in enumerate(["", "   ", "dragon"]):
        alone = flat_searcher.search([query], 2)[0]
        assert [item["document"] for item in result[position]] == [doc for doc, _ in alone]
        assert len(result[position]) == 2


def test_bm25_empty_query_has_no_hits(corpus, tmp_path):
    """Lucene (Search-R1's BM25) finds nothing for a query without terms: an empty list."""
    from services.retriever.build import build_index
    from services.retriever.searcher import Searcher

    searcher = Searcher.load(build_index(corpus[0], tmp_path / "bm25", "bm25",
                                         show_progress=False))
    empty, blank, word = searcher.search(["", "  ", "dragon"], 3)
    assert empty == [] and blank == [] and len(word) == 3


def test_small_request_runs_between_chunks_of_a_large_one(default_server):
    """A 2-query request sent while a 2560-query one is being answered returns first."""
    big = [f"{WORDS[i % 10]} castle river {i}" for i in range(2560)]
    finished: dict[str, float] = {}

    def large() -> None:
        response = httpx.post(f"{default_server}/retrieve", json={"queries": big, "topk": 3},
                              timeout=300)
        assert response.status_code == 200
        finished["large"] = time.monotonic()

    before = metric(default_server, "forage_retriever_batch_queries_count")
    thread = threading.Thread(target=large)
    thread.start()
    deadline = time.monotonic() + 60
    while metric(default_server, "forage_retriever_batch_queries_count") < before + 2:
        assert time.monotonic() < deadline, "the large request never started"
        time.sleep(0.05)
    small = httpx.post(f"{default_server}/retrieve", json={"queries": ["bread", "oak"]},
                       timeout=300)
    finished["small"] = time.monotonic()
    thread.join()
    assert small.status_code == 200 and len(small.json()["result"]) == 2
    assert finished["small"] < finished["large"]
