"""A bad or empty search query affects only its own trajectory (docs/rollout.md, "Bad
queries"): real retriever processes over HTTP, the real agent loop, a tiny policy forced to emit
the searches."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from services.common.formats import information_block
from services.common.ports import free_port as _free_port
from services.common.trajectory import PromptGroup
from services.rollout.agent import AgentLoop, LoopSettings
from services.rollout.retrieval import QueryRejected, RetrieverClient, RetrieverError

from .test_agent import scripted

# The same corpus as tests/rollout/conftest.py's retriever (importlib mode: no shared imports).
CORPUS = [
    {"id": "0", "contents": '"Brixol"\nBrixol was born in Corvale. Brixol founded a company.'},
    {"id": "1", "contents": '"Tamra"\nTamra was born in Dunmore. Tamra founded a company.'},
    {"id": "2", "contents": '"Velden"\nVelden was born in Ashby. Velden founded a company.'},
    {"id": "3", "contents": '"Osric"\nOsric was born in Pellam. Osric founded a company.'},
]
TURN_SEARCH = "<think> I need Brixol </think>\n<search> Brixol </search>"
TURN_ANSWER = "<think> Brixol was born in Corvale </think>\n<answer> Corvale </answer>"
EMPTY_SEARCH = "<think> I will search </think>\n<search> </search>"
LONG_QUERY = " ".join(["Brixol"] * 7)  # 48 characters, over the strict server's 40
LONG_SEARCH = f"<think> I will search </think>\n<search> {LONG_QUERY} </search>"


def group(n: int) -> PromptGroup:
    return PromptGroup(uid="g1", data_source="nq", ground_truth={"target": ["Corvale"]}, n=n,
                       prompt=[{"role": "user", "content": "Where was Brixol born?"}])


def loop(engine, url: str, **settings) -> AgentLoop:
    retriever = RetrieverClient(url, topk=2, timeout_s=10, retries=1, backoff_s=0.01)
    return AgentLoop(engine, LoopSettings(**settings), retriever)


def spans(mask, value) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate(list(mask) + [255]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.fixture(scope="module")
def strict_url(tmp_path_factory):
    """A BM25 retriever that takes at most 2 queries per request, of at most 40 characters."""
    work = tmp_path_factory.mktemp("strict")
    (work / "corpus.jsonl").write_text("".join(json.dumps(row) + "\n" for row in CORPUS))
    forage = [sys.executable, "-m", "services.cli", "retriever"]
    subprocess.run(forage + ["build-index", "--corpus", str(work / "corpus.jsonl"), "--out",
                             str(work / "index"), "--index", "bm25"],
                   check=True, capture_output=True, timeout=300)
    port = _free_port()
    proc = subprocess.Popen(
        forage + ["serve", "--index", str(work / "index"), "--port", str(port),
                  "--set", "retriever.max_queries_per_request=2",
                  "--set", "retriever.max_query_chars=40"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"retriever exited with {proc.returncode}"
            assert time.monotonic() < deadline, "retriever did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/retrieve"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def observations(engine, trajectory) -> list[str]:
    decode = engine.tokenizer.decode
    return [decode(trajectory.response_ids[a:b].tolist()) for a, b in spans(trajectory.loss_mask, 0)]


def docs_for(url: str, query: str) -> list:
    return httpx.post(url, json={"queries": [query], "topk": 2, "return_scores": True},
                      timeout=30).json()["result"][0]


def same_answer(got, want) -> bool:
    """Same passages in order; scores equal up to batch-size float noise of the encoder."""
    return [i["document"] for i in got] == [i["document"] for i in want] and all(
        abs(a["score"] - b["score"]) < 1e-5 for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("scheduling", ["lockstep", "continuous"])
def test_empty_search_is_retrieved_like_search_r1_and_the_batch_is_unharmed(
        engine, retriever_url, scheduling):
    scripted(engine, [[EMPTY_SEARCH, TURN_ANSWER], [TURN_SEARCH, TURN_ANSWER], [TURN_ANSWER]])
    trajs = loop(engine, retriever_url, scheduling=scheduling).run([group(n=3)])
    assert [t.finish_reason for t in trajs] == ["answer", "answer", "answer"]
    assert [t.turns[0].query for t in trajs] == ["", "Brixol", "Corvale"]
    assert [t.num_searches for t in trajs] == [1, 1, 0]
    empty_docs = docs_for(retriever_url, "")
    assert len(empty_docs) == 2  # the dense index answers the empty query, as Search-R1's does
    assert observations(engine, trajs[0]) == [information_block(empty_docs)]
    assert observations(engine, trajs[1]) == [information_block(docs_for(retriever_url,
                                                                         "Brixol"))]


def test_a_refused_query_gets_an_observation_and_only_its_trajectory_sees_it(engine, strict_url):
    """3 searches in one call to a server that takes 2 per request (413: split) and refuses
    the long query (422: that query alone gets `Search failed`)."""
    scripted(engine, [[LONG_SEARCH, TURN_ANSWER], [TURN_SEARCH, TURN_ANSWER],
                      [TURN_SEARCH, TURN_ANSWER]])
    trajs = loop(engine, strict_url, scheduling="lockstep").run([group(n=3)])
    assert [t.finish_reason for t in trajs] == ["answer", "answer", "answer"]
    assert observations(engine, trajs[0]) == [
        "\n\n<information>Search failed: the retriever refused the query (queries[0]: longer "
        "than 40 characters (48))</information>\n\n"]
    assert trajs[0].num_searches == 0 and trajs[0].turns[0].action == "search"
    answered = information_block(docs_for(strict_url, "Brixol"))
    assert observations(engine, trajs[1]) == observations(engine, trajs[2]) == [answered]
    assert [t.num_searches for t in trajs[1:]] == [1, 1]


def test_client_checks_each_query_and_splits_refused_requests(retriever_url, strict_url):
    client = RetrieverClient(retriever_url, topk=2, max_query_chars=10, retries=0)
    out = client.retrieve(["Brixol", "x" * 11, "Tamra \ud800", "", "Osric"])
    assert out[1] == QueryRejected("the query is longer than 10 characters (11)")
    assert out[2] == QueryRejected("the query is not valid Unicode")
    for position, query in ((0, "Brixol"), (3, ""), (4, "Osric")):
        assert same_answer(out[position], docs_for(retriever_url, query))
    strict = RetrieverClient(strict_url, topk=2, retries=0)
    queries = ["Brixol", "Tamra", LONG_QUERY, "Velden", "Osric"]
    out = strict.retrieve(queries)
    assert isinstance(out[2], QueryRejected) and "longer than 40" in out[2].reason
    for position in (0, 1, 3, 4):
        assert same_answer(out[position], docs_for(strict_url, queries[position]))
    assert strict.retrieve([""]) == [[]]  # BM25: no hits for a query without terms


def test_refusals_not_about_the_queries_are_errors_at_once(retriever_url):
    started = time.perf_counter()
    wrong_path = RetrieverClient(retriever_url.replace("/retrieve", "/nope"), retries=3,
                                 backoff_s=1.0)
    with pytest.raises(RetrieverError, match="HTTP 404"):
        wrong_path.retrieve(["Brixol", "Tamra"])
    bad_topk = RetrieverClient(retriever_url, topk=10_000, retries=3, backoff_s=1.0)
    with pytest.raises(RetrieverError, match="topk: at most"):
        bad_topk.retrieve(["Brixol", "Tamra"])
    assert time.perf_counter() - started < 5  # neither retried nor split
