"""Per-request work bound of /retrieve (issue 14 items 7, 10): the characters of one request's
queries are capped (`retriever.max_request_chars`, 413 beyond), so the largest legal request
ends within a budget while small requests keep being answered between its chunks; and the
OpenAPI schema states the limits (`minItems`, `maxItems`, `maxLength`, `maximum`)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from services.common.config import ConfigError, load_config

pytestmark = pytest.mark.slow

MAX_QUERY_CHARS = 1000
MAX_REQUEST_CHARS = 48_000  # 48 queries of 1000 characters: the largest legal request
WORDS = ["dragon", "bread", "telescope", "ships", "oak", "castle", "river", "wine", "books", "ore"]


@pytest.fixture(scope="module")
def bounded_server(flat_index, tools, tmp_path_factory):
    config = tmp_path_factory.mktemp("hostile") / "run.yaml"
    config.write_text(
        "retriever:\n"
        "  max_batch: 4\n"
        "  max_topk: 20\n"
        "  max_queries_per_request: 64\n"
        f"  max_query_chars: {MAX_QUERY_CHARS}\n"
        f"  max_request_chars: {MAX_REQUEST_CHARS}\n"
    )
    port = tools.free_port()
    process = tools.start_server(["--config", str(config), "--index", str(flat_index)], port)
    yield f"http://127.0.0.1:{port}"
    tools.stop_server(process)


def long_query(seed: int, length: int = MAX_QUERY_CHARS) -> str:
    words = " ".join(WORDS[(seed + i) % len(WORDS)] for i in range(length // 4))
    return words[:length]


def test_more_characters_than_the_limit_is_413_naming_it(bounded_server):
    queries = [long_query(i) for i in range(MAX_REQUEST_CHARS // MAX_QUERY_CHARS)] + ["x"]
    reply = httpx.post(f"{bounded_server}/retrieve", json={"queries": queries}, timeout=60)
    assert reply.status_code == 413
    assert reply.json()["detail"] == (
        f"queries: {MAX_REQUEST_CHARS + 1} characters in all, at most {MAX_REQUEST_CHARS} per "
        "request (send fewer queries per request)"
    )


def test_a_small_request_is_answered_promptly_while_the_largest_legal_one_runs(bounded_server):
    largest = [long_query(i) for i in range(MAX_REQUEST_CHARS // MAX_QUERY_CHARS)]
    assert sum(map(len, largest)) == MAX_REQUEST_CHARS
    timings: dict[str, float] = {}

    def send_largest() -> None:
        started = time.monotonic()
        reply = httpx.post(f"{bounded_server}/retrieve", timeout=300,
                           json={"queries": largest, "topk": 20})
        assert reply.status_code == 200 and len(reply.json()["result"]) == len(largest)
        timings["largest"] = time.monotonic() - started
        timings["largest_done"] = time.monotonic()

    thread = threading.Thread(target=send_largest)
    thread.start()
    time.sleep(0.3)  # its first chunks are being encoded
    started = time.monotonic()
    small = httpx.post(f"{bounded_server}/retrieve", json={"queries": ["oak"], "topk": 2},
                       timeout=60)
    timings["small"] = time.monotonic() - started
    timings["small_done"] = time.monotonic()
    thread.join()
    assert small.status_code == 200 and len(small.json()["result"][0]) == 2
    assert timings["small_done"] < timings["largest_done"], timings
    assert timings["small"] < timings["largest"] / 2, timings  # waited a chunk, not the request
    assert timings["largest"] < 120, timings  # the budget the limits buy, with a wide margin


def test_the_schema_states_the_limits(bounded_server):
    schema = httpx.get(f"{bounded_server}/openapi.json", timeout=30).json()
    body = schema["paths"]["/retrieve"]["post"]["requestBody"]["content"]["application/json"]
    properties = body["schema"]["properties"]
    assert properties["queries"]["minItems"] == 1  # `queries: []` is a 422, as the schema says
    assert properties["queries"]["maxItems"] == 64
    assert properties["queries"]["items"]["maxLength"] == MAX_QUERY_CHARS
    assert str(MAX_REQUEST_CHARS) in properties["queries"]["description"]
    topk = next(option for option in properties["topk"]["anyOf"] if option["type"] == "integer")
    assert topk["minimum"] == 0 and topk["maximum"] == 20
    empty = httpx.post(f"{bounded_server}/retrieve", json={"queries": []}, timeout=30)
    assert empty.status_code == 422 and empty.json()["detail"] == "queries: must not be empty"


def test_the_request_limit_must_hold_one_query():
    with pytest.raises(ConfigError, match="max_request_chars .* at least max_query_chars"):
        load_config(None, ["retriever.max_query_chars=2048", "retriever.max_request_chars=100"])


def test_an_integral_float_topk_is_an_integer(bounded_server):
    """JSON Schema's `integer` (and pydantic's, so Search-R1's server) takes 2.0; the fuzz
    suite found /retrieve refusing it although its schema allowed it."""
    reply = httpx.post(f"{bounded_server}/retrieve", json={"queries": ["oak"], "topk": 2.0},
                       timeout=30)
    assert reply.status_code == 200 and len(reply.json()["result"][0]) == 2
    for bad in ("2.5", "Infinity", "1e400"):  # Python's json reads Infinity; 1e400 is inf
        reply = httpx.post(f"{bounded_server}/retrieve", timeout=30,
                           content=f'{{"queries": ["oak"], "topk": {bad}}}',
                           headers={"content-type": "application/json"})
        assert reply.status_code == 422 and reply.json()["detail"] == (
            "topk: must be an integer or null")
