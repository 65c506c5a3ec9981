"""A started `forage retriever serve` runs with the thread policy of services/common/threads.py:
the counts torch and faiss report, and the OpenMP wait policy libgomp read at import."""

from __future__ import annotations

import os
import subprocess
import time

import httpx
import pytest

from tests.retriever.conftest import FORAGE, free_port, stop_server

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY",
               "TOKENIZERS_PARALLELISM", "FORAGE_THREADS", "FORAGE_CPU_SHARE",
               "FORAGE_THREADS_FILLED")


def _serve(index, extra_env: dict[str, str], args: list[str]) -> tuple[subprocess.Popen, int]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update(HF_HUB_OFFLINE="1", **extra_env)
    port = free_port()
    process = subprocess.Popen([FORAGE, "retriever", "serve", "--index", str(index), "--port",
                                str(port), *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and process.poll() is None:
        try:
            reply = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            if reply.status_code == 200:
                return process, port
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(process)
    pytest.fail("retriever did not become healthy")


@pytest.mark.parametrize(("env", "args", "expected"), [
    # The process's 2 threads become two one-thread workers (services/common/threads.py).
    ({"FORAGE_THREADS": "2"}, [], {"workers": 2, "per_worker": 1, "omp_wait_policy": "PASSIVE"}),
    # forage up's children: the cores split between processes (any machine below 128 cores).
    ({"FORAGE_CPU_SHARE": "128"}, [],
     {"workers": 1, "per_worker": 1, "omp_wait_policy": "PASSIVE"}),
    # The user's variables win; --workers 1 gives the one worker both threads.
    ({"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}, ["--workers", "1"],
     {"workers": 1, "per_worker": 2, "omp_wait_policy": "ACTIVE"}),
])
def test_server_applies_the_thread_policy(flat_index, env, args, expected):
    process, port = _serve(flat_index, env, args)
    try:
        reply = httpx.post(f"http://127.0.0.1:{port}/retrieve", timeout=30,
                           json={"queries": ["castle on a hill", "fresh bread"], "topk": 1})
        assert reply.status_code == 200
        health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).json()
        # torch and faiss as read back on a worker thread, where the batches run.
        per_worker = expected["per_worker"]
        assert health["threads"] == {**expected, "torch": per_worker, "faiss": per_worker}
    finally:
        stop_server(process)
