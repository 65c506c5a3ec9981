"""The server as a real process over HTTP: Search-R1 protocol, concurrency, bad inputs."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from services.common.formats import information_block, passages_to_string

pytestmark = pytest.mark.slow

QUERIES = ["a dragon guarding gold", "fresh bread and cakes", "telescope and comets",
           "ships sheltering from storms", "oak trees and owls"]


def post(server: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{server}/retrieve", content=body, timeout=30, **kwargs)
    return httpx.post(f"{server}/retrieve", json=body, timeout=30, **kwargs)


def test_both_shapes_in_query_order(server, flat_searcher):
    expected = flat_searcher.search(QUERIES, 4)
    scored = post(server, {"queries": QUERIES, "topk": 4, "return_scores": True})
    assert scored.status_code == 200
    result = scored.json()["result"]
    assert len(result) == len(QUERIES)
    for per_query, want in zip(result, expected, strict=True):
        assert [item["document"] for item in per_query] == [doc for doc, _ in want]
        assert [item["score"] for item in per_query] == pytest.approx(
            [score for _, score in want], abs=1e-5)
        assert set(per_query[0]) == {"document", "score"}
        assert set(per_query[0]["document"]) == {"id", "contents"}
    plain = post(server, {"queries": QUERIES, "topk": 4, "return_scores": False}).json()
    assert plain["result"] == [[item["document"] for item in q] for q in result]
    reversed_result = post(server, {"queries": QUERIES[::-1], "topk": 4}).json()["result"]
    assert reversed_result == plain["result"][::-1]


@pytest.mark.parametrize("topk", [None, 0, "absent"])
def test_topk_default(server, topk):
    body = {"queries": ["bread"], "return_scores": True}
    if topk != "absent":
        body["topk"] = topk
    response = post(server, body)
    assert response.status_code == 200
    assert len(response.json()["result"][0]) == 3  # --topk 3 wins over the config's 2


def test_search_r1_client_formatting(server):
    """Search-R1's generation.py: POST with return_scores=true, `_passages2string` per query."""
    payload = {"queries": ["a dragon guarding gold", "fresh bread"], "topk": 3,
               "return_scores": True}
    results = post(server, payload).json()["result"]
    text = passages_to_string(results[0])
    lines = text.splitlines()
    assert len(lines) == 3
    first = results[0][0]["document"]["contents"]
    title, body = first.split("\n", 1)
    assert lines[0] == f"Doc 1(Title: {title}) {body}"
    assert title.startswith('"') and title.endswith('"')  # Search-R1 keeps the quotes
    assert all(line.startswith(f"Doc {i}(Title: ") for i, line in enumerate(lines, 1))
    block = information_block(results[1])
    assert block.startswith("\n\n<information>Doc 1(Title: ")
    assert block.endswith("</information>\n\n")
    # the plain shape formats identically
    plain = post(server, {**payload, "return_scores": False}).json()["result"]
    assert passages_to_string(plain[0]) == text


def test_concurrent_clients_match_sequential(server):
    requests = [{"queries": [QUERIES[i % 5], QUERIES[(i * 3) % 5]], "topk": 1 + i % 4,
                 "return_scores": True} for i in range(48)]
    with httpx.Client(timeout=60) as client:
        sequential = [client.post(f"{server}/retrieve", json=r).json()["result"]
                      for r in requests]

    def call(request):
        with httpx.Client(timeout=60) as client:
            return client.post(f"{server}/retrieve", json=request).json()["result"]

    with ThreadPoolExecutor(max_workers=16) as pool:
        parallel = list(pool.map(call, requests))
    for got, want in zip(parallel, sequential, strict=True):
        assert [[i["document"] for i in q] for q in got] == [[i["document"] for i in q]
                                                             for q in want]
        for got_q, want_q in zip(got, want, strict=True):
            assert [i["score"] for i in got_q] == pytest.approx(
                [i["score"] for i in want_q], abs=1e-5)
    metrics = httpx.get(f"{server}/metrics", timeout=10).text
    # concurrency produced at least one batch with more than one request's queries
    batches = [line for line in metrics.splitlines()
               if line.startswith("forage_retriever_batch_queries_bucket")]
    le2 = next(float(line.rsplit(" ", 1)[1]) for line in batches if 'le="2.0"' in line)
    count = next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith("forage_retriever_batch_queries_count"))
    assert count > le2, "no micro-batch ever held more than one request"


BAD_INPUTS = [
    ({"queries": []}, 422, "queries"),
    ({"topk": 3}, 422, "queries"),
    ({"queries": "just a string"}, 422, "queries"),
    ({"queries": {"a": 1}}, 422, "queries"),
    ({"queries": ["ok", 5]}, 422, "queries[1]"),
    ({"queries": ["ok", None]}, 422, "queries[1]"),
    ({"queries": ["x" * 201]}, 422, "queries[0]"),
    ({"queries": ["ok"] * 65}, 413, "queries"),
    ({"queries": ["ok"], "topk": -1}, 422, "topk"),
    ({"queries": ["ok"], "topk": 21}, 422, "topk"),
    ({"queries": ["ok"], "topk": "3"}, 422, "topk"),
    ({"queries": ["ok"], "topk": 2.5}, 422, "topk"),
    ({"queries": ["ok"], "topk": True}, 422, "topk"),
    ({"queries": ["ok"], "return_scores": "yes"}, 422, "return_scores"),
    # per-request search knobs: bad values, and knobs the (flat) index does not have
    ({"queries": ["ok"], "nprobe": 0}, 422, "nprobe"),
    ({"queries": ["ok"], "nprobe": "8"}, 422, "nprobe"),
    ({"queries": ["ok"], "nprobe": 8}, 422, "nprobe"),
    ({"queries": ["ok"], "efSearch": 10**6}, 422, "efSearch"),
    ({"queries": ["ok"], "efSearch": True}, 422, "efSearch"),
    ({"queries": ["ok"], "efSearch": 64}, 422, "efSearch"),
    ([["a list", "not an object"]], 422, "body"),
    (b"this is not json", 400, "body"),
    (b'{"queries": ["unterminated', 400, "body"),
    (b"", 400, "body"),
    ('{"queries": ["\\ud800"]}', 422, "queries[0]"),
    (b"[" * 100000, 413, "body"),
    (json.dumps({"queries": ["y" * 100] * 60, "pad": "z" * 70000}), 413, "body"),
]


@pytest.mark.parametrize("body, status, field", BAD_INPUTS,
                         ids=[f"{i}-{case[2]}" for i, case in enumerate(BAD_INPUTS)])
def test_bad_input_is_4xx_naming_the_field(server, body, status, field):
    if isinstance(body, list):
        body = body[0]
    response = post(server, body)
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert detail.startswith(field), detail


def test_deep_json_under_the_size_limit_is_400(server):
    response = post(server, b"[" * 60000)
    assert response.status_code == 400 and response.json()["detail"].startswith("body")


def test_server_survives_bad_input_and_exposes_endpoints(server):
    post(server, b"garbage")
    health = httpx.get(f"{server}/healthz", timeout=10).json()
    assert health["status"] == "ok"
    assert health["query_dtype"] == "float32"  # the config's retriever.query_dtype
    metrics = httpx.get(f"{server}/metrics", timeout=10)
    assert metrics.status_code == 200
    assert 'forage_retriever_requests_total{status="400"}' in metrics.text
    assert "forage_retriever_request_seconds_bucket" in metrics.text
    assert "forage_retriever_index_docs 200.0" in metrics.text
    assert httpx.get(f"{server}/docs", timeout=10).status_code == 200
    spec = httpx.get(f"{server}/openapi.json", timeout=10).json()
    body_schema = spec["paths"]["/retrieve"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    assert {"queries", "topk", "return_scores"} <= set(body_schema["properties"])
    assert not {"nprobe", "efSearch"} & set(body_schema["properties"])  # a flat index has neither
    assert httpx.get(f"{server}/retrieve", timeout=10).status_code == 405
