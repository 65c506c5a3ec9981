"""The retrieval store's key holds everything that can change a result, and a recorded result is
never silently replaced (docs/eval.md, "Reproducible retrieval"). The server cases run against
one real retriever process on loopback that applies its own search setting (HNSW ef_search 16,
not the build's 128) and query precision (bfloat16, not the in-process float32)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time

import httpx
import pytest

from services.common.retrieval_store import (
    QueryFailed,
    Recording,
    Store,
    StoreError,
    settings_key,
)
from services.eval.evaluate import EvalRequest, run
from services.eval.retrieval import read_identity
from services.eval.runner import EvalSettings

from .conftest import FORAGE, PEOPLE, REPO


@pytest.fixture(scope="module")
def served(eval_world):
    """An HNSW index of the evaluation world, served with its own ef_search and precision."""
    from services.common.ports import free_port
    from services.retriever.build import build_index

    corpus = eval_world["work"] / "index.jsonl"  # written by the eval_world fixture
    index = eval_world["work"] / "hnsw"
    if not index.exists():
        build_index(corpus, index, "hnsw", show_progress=False)
    port = free_port()
    proc = subprocess.Popen([*FORAGE, "retriever", "serve", "--index", str(index), "--port",
                             str(port), "--set", "retriever.ef_search=16", "--set",
                             "retriever.query_dtype=bfloat16"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "the retriever exited"
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                if reply.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the retriever did not come up"
            time.sleep(0.2)
        yield {"url": f"http://127.0.0.1:{port}/retrieve", "index": index,
               "health": reply.json()}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def request(world, out, modes=("rag",), **kwargs) -> EvalRequest:
    return EvalRequest(models=[str(world["policy"])], data=[str(world["flashrag"])],
                       modes=list(modes), out=str(out), limit=2,
                       settings=EvalSettings(topk=2, max_tokens_per_turn=2), **kwargs)


def lines(out) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").open()]


def test_results_are_keyed_by_what_answers_them(eval_world, served, tmp_path):
    """--index with --retriever-url keys by the server's own settings and precision, not the
    manifest's; in-process float32 results of the same index and settings are keyed apart; a
    live run against the server names the index it reports, not "unknown"."""
    health, store_path = served["health"], tmp_path / "retrieval.sqlite"
    assert health["search_settings"]["search_params"]["ef_search"] == 16
    assert health["search_settings"]["query_dtype"] == "bfloat16"
    run(request(eval_world, tmp_path / "server", index=str(served["index"]),
                retriever_url=served["url"], retrieval="record", store=str(store_path)))
    run(request(eval_world, tmp_path / "here", index=str(served["index"]), retrieval="record",
                store=str(store_path), query_dtype="float32", search_params={"ef_search": 16}))
    identity, _ = read_identity(served["index"])
    store = Store(store_path, create=False)
    keys = store.identities()
    store.close()
    in_process = {**health["search_settings"], "query_dtype": "float32"}
    assert keys == sorted([(identity, settings_key(health["search_settings"])),
                           (identity, settings_key(in_process))])

    live = tmp_path / "live"
    run(request(eval_world, live, retriever_url=served["url"]))
    assert json.loads((live / "config.json").read_text())["index"] == identity
    assert {line["index"] for line in lines(live)} == {identity}


def test_a_recording_without_any_search_replays(eval_world, served, tmp_path):
    """A policy that never searched leaves a store with no results: still a valid recording."""
    recorded, replayed = tmp_path / "recorded", tmp_path / "replayed"
    run(request(eval_world, recorded, modes=["agent"], retriever_url=served["url"],
                retrieval="record"))
    with sqlite3.connect(recorded / "retrieval.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM results").fetchone()[0] == 0
    assert all(line["num_searches"] == 0 for line in lines(recorded)), \
        "the tiny policy searched: this test needs a recording without any search"
    run(request(eval_world, replayed, modes=["agent"], retrieval="replay",
                store=str(recorded / "retrieval.sqlite")))
    assert (replayed / "samples.jsonl").read_bytes() == (recorded / "samples.jsonl").read_bytes()


def _answer(*ids: str, score: float = 0.5) -> list[dict]:
    return [{"document": {"id": i, "contents": f'"{i}"\nabout {i}'}, "score": score} for i in ids]


class Answers:
    """A backend answering each call with the next of `answers` (the store is what's tested)."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)

    def retrieve(self, queries):
        return [self.answers.pop(0) for _ in queries]


def test_a_different_result_under_a_recorded_key_is_refused_not_written_over(tmp_path):
    store = Store(tmp_path / "r.sqlite", create=True)
    name = PEOPLE[0][0]
    first, reordered = _answer("a", "b"), _answer("b", "a")
    rescored = _answer("a", "b", score=0.5000001)  # the same passages: the same result
    recording = Recording(Answers(first, rescored, reordered, reordered), store, "flat-x",
                          {"search_params": {}}, 2)
    assert recording.retrieve([name]) == [first]
    assert recording.retrieve([name]) == [first]  # answered as recorded, bit for bit
    with pytest.raises(StoreError) as caught:
        recording.retrieve([name])
    message = str(caught.value)
    assert "passages [a, b]" in message and "passages [b, a]" in message and name in message
    recording.fail_conflicts = True  # training: that trajectory alone fails
    [failed] = recording.retrieve([name])
    assert isinstance(failed, QueryFailed) and "passages [b, a]" in failed.reason
    assert store.get("flat-x", settings_key({"search_params": {}}), 2, name) == first
    store.close()
