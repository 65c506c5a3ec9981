"""Several micro-batch workers (services/retriever/batcher.py): batches run at once, large
requests keep that many chunks in flight, the limit drops when the workers share a core, and
the encoder gives the same vectors from several threads."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from services.retriever.batcher import (
    CONTENDED_CPU_SHARE,
    FASTER_BY,
    PROBE_AFTER_S,
    MicroBatcher,
    next_limit,
)
from tests.retriever.conftest import FORAGE, free_port, stop_server

REPO = Path(__file__).resolve().parents[2]


def test_next_limit_drops_on_contention_and_probes_back():
    low, high = CONTENDED_CPU_SHARE - 0.2, CONTENDED_CPU_SHARE + 0.2
    assert next_limit(2, 2, [low, low], 0.0) == 1
    assert next_limit(2, 2, [low], 0.0) == 2  # one slow batch is not enough
    assert next_limit(2, 2, [high, low, high], 0.0) == 2  # the mean decides
    assert next_limit(2, 2, [high, high, low, low, low], 0.0) == 1  # the last few
    assert next_limit(1, 2, [low, low], 0.0) == 1  # never below one
    assert next_limit(1, 2, [], PROBE_AFTER_S - 0.1) == 1
    assert next_limit(1, 2, [], PROBE_AFTER_S) == 2  # a core may have come free
    assert next_limit(2, 2, [], 100.0) == 2  # never above the workers
    assert next_limit(3, 8, [high, high], 100.0) == 4


def test_a_contended_limit_stays_when_it_serves_more_than_the_one_below():
    """Time-sharing cores is a loss only if fewer batches at once would serve as much."""
    low = CONTENDED_CPU_SHARE - 0.2
    assert next_limit(2, 2, [low, low], 0.0, None, None) == 1  # nothing to compare: drop
    assert next_limit(2, 2, [low, low], 0.0, None, 400.0) == 2  # measure this limit first
    faster = 400.0 * (1 + FASTER_BY) + 1
    assert next_limit(2, 2, [low, low], 0.0, faster, 400.0) == 2
    assert next_limit(2, 2, [low, low], 0.0, 400.0 * (1 + FASTER_BY), 400.0) == 1
    assert next_limit(2, 2, [low, low], 0.0, 300.0, 400.0) == 1


def _run(coro):
    return asyncio.run(coro)


def test_two_workers_run_two_batches_at_once():
    barrier = threading.Barrier(2, timeout=10)  # broken (an error) unless both run together

    def fn(queries, topks):
        barrier.wait()
        return [f"r:{q}" for q in queries]

    async def main():
        batcher = MicroBatcher(fn, max_batch=1, max_wait_s=0, workers=2)
        batcher.start()
        try:
            return await asyncio.gather(batcher.submit(["a"], 1), batcher.submit(["b"], 1))
        finally:
            await batcher.stop()

    assert _run(main()) == [["r:a"], ["r:b"]]


def test_a_large_request_keeps_at_most_workers_chunks_in_flight_and_lets_others_in():
    running, peak, lock = [0], [0], threading.Lock()
    finished: list[str] = []

    def fn(queries, topks):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
            finished.append(queries[0])
        return [q.upper() for q in queries]

    async def main():
        batcher = MicroBatcher(fn, max_batch=2, max_wait_s=0, workers=2)
        batcher.start()
        try:
            large = asyncio.ensure_future(batcher.submit([f"q{i}" for i in range(16)], 1))
            await asyncio.sleep(0.07)  # the large request is under way
            small = await batcher.submit(["small"], 1)
            small_done_while_large_ran = not large.done()
            return await large, small, small_done_while_large_ran
        finally:
            await batcher.stop()

    large, small, interleaved = _run(main())
    assert large == [f"Q{i}" for i in range(16)]  # in order, every chunk
    assert small == ["SMALL"] and interleaved
    assert peak[0] == 2  # two chunks at once, never more


def test_a_cancelled_request_does_not_run_its_queued_chunks():
    calls: list[str] = []

    def fn(queries, topks):
        calls.append(queries[0])
        time.sleep(0.05)
        return queries

    async def main():
        batcher = MicroBatcher(fn, max_batch=1, max_wait_s=0, workers=1)
        batcher.start()
        try:
            task = asyncio.ensure_future(batcher.submit([f"q{i}" for i in range(10)], 1))
            await asyncio.sleep(0.08)
            task.cancel()
            await asyncio.sleep(0.3)
        finally:
            await batcher.stop()

    _run(main())
    assert len(calls) <= 3  # the one running, perhaps the next; not all ten


CONTENDED = f"""
import asyncio, hashlib, os, sys
sys.path.insert(0, {str(REPO)!r})
os.sched_setaffinity(0, {{0}})  # one CPU: two workers must share it
import services.retriever.batcher as B
B.PROBE_AFTER_S = 0.5
DATA = b"x" * (24 << 20)

def fn(queries, topks):
    hashlib.sha256(DATA).digest()  # CPU work without the GIL, as torch's is
    return queries

async def main():
    batcher = B.MicroBatcher(fn, max_batch=1, max_wait_s=0, workers=2)
    batcher.start()
    seen = []
    for _ in range(6):
        await asyncio.gather(*(batcher.submit([str(i)], 1) for i in range(4)))
        seen.append(batcher.limit)
    await asyncio.sleep(B.PROBE_AFTER_S)
    await batcher.submit(["alone"], 1)  # a batch after the probe time: the limit goes back up
    seen.append(batcher.limit)
    await batcher.stop()
    print(seen)

asyncio.run(main())
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_workers_sharing_one_core_fall_back_to_one_then_probe_again():
    out = subprocess.run([sys.executable, "-c", CONTENDED], capture_output=True, text=True,
                         timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert 1 in seen[:-1], seen  # two workers on one CPU got about half of it each
    assert seen[-1] == 2, seen


HALF_WAITING = f"""
import asyncio, hashlib, json, os, sys, time
sys.path.insert(0, {str(REPO)!r})
os.sched_setaffinity(0, {{0}})  # one CPU: two batches at once time-share it
import services.retriever.batcher as B
B.PROBE_AFTER_S, B.MIN_RATE_WINDOW_S = 0.5, 0.3
DATA = b"x" * (12 << 20)

def fn(queries, topks):
    hashlib.sha256(DATA).digest()  # CPU work without the GIL, as torch's is ...
    time.sleep(0.03)  # ... then a wait that needs no CPU, in which the other batch computes
    return queries

async def client(batcher, stop):
    while time.monotonic() < stop:
        await batcher.submit(["q"], 1)

async def main():
    batcher = B.MicroBatcher(fn, max_batch=1, max_wait_s=0, workers=2)
    batcher.start()
    stop = time.monotonic() + 8.0
    tasks = [asyncio.ensure_future(client(batcher, stop)) for _ in range(4)]
    seen = []
    while time.monotonic() < stop:
        await asyncio.sleep(0.05)
        seen.append(batcher.limit)
    await asyncio.gather(*tasks)
    await batcher.stop()
    print(json.dumps({{"seen": seen, "rates": {{k: v[0] for k, v in batcher.rates.items()}}}}))

asyncio.run(main())
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_batches_that_time_share_a_core_but_serve_more_keep_running_together():
    """Two batches on one CPU, each half computing and half waiting: they get under
    CONTENDED_CPU_SHARE of it while computing side by side, yet serve more than one at a time
    (the other computes while one waits). The limit settles at 2 after measuring both."""
    out = subprocess.run([sys.executable, "-c", HALF_WAITING], capture_output=True, text=True,
                         timeout=120, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    seen, rates = report["seen"], report["rates"]
    assert rates.get("1") and rates.get("2"), report
    assert rates["2"] > rates["1"] * (1 + FASTER_BY), report
    late = seen[len(seen) // 2:]
    assert late.count(2) >= 0.8 * len(late), report


def test_encoder_gives_the_same_vectors_from_several_threads(flat_searcher):
    encoder = flat_searcher.encoder
    queries = ["castle on a hill", "", "fresh bread every morning " * 40, "wolves", "mine",
               "a telescope to study comets"] * 3
    reference = encoder._encode(queries)  # sentence-transformers' own encode
    assert np.abs(encoder.encode_queries(queries) - reference).max() < 1e-5
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: encoder.encode_queries(queries), range(8)))
    for vectors in results:
        assert np.abs(vectors - reference).max() < 1e-5


def test_a_two_worker_server_answers_concurrent_clients_like_the_searcher(flat_index,
                                                                        flat_searcher):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "FORAGE_"))}
    env.update(HF_HUB_OFFLINE="1", FORAGE_THREADS="2")
    port = free_port()
    process = subprocess.Popen([FORAGE, "retriever", "serve", "--index", str(flat_index),
                                "--port", str(port), "--max-batch", "3",
                                "--set", "retriever.query_dtype=float32"],  # as the searcher
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None and time.monotonic() < deadline
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                if health.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert health.json()["threads"]["workers"] == 2
        requests = [[f"{topic} number {n}" for n in range(k % 5 + 1)]
                    for k, topic in enumerate(["river", "castle", "dragon", "harbor", "forest",
                                               "bakery", "library", "mine"] * 2)]

        def ask(queries):
            reply = httpx.post(f"http://127.0.0.1:{port}/retrieve", timeout=60,
                               json={"queries": queries, "topk": 2, "return_scores": True})
            assert reply.status_code == 200
            return [[hit["document"]["id"] for hit in hits] for hits in reply.json()["result"]]

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, requests))
        for queries, answer in zip(requests, answers, strict=True):
            expected = [[doc["id"] for doc, _ in hits]
                        for hits in flat_searcher.search(queries, 2)]
            assert answer == expected
    finally:
        stop_server(process)
