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


def _serve(index, extra_env: dict[str, str]) -> tuple[subprocess.Popen, dict]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update(HF_HUB_OFFLINE="1", **extra_env)
    port = free_port()
    process = subprocess.Popen([FORAGE, "retriever", "serve", "--index", str(index), "--port",
                                str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=env)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and process.poll() is None:
        try:
            reply = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            if reply.status_code == 200:
                return process, reply.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(process)
    pytest.fail("retriever did not become healthy")


@pytest.mark.parametrize(("env", "threads", "policy"), [
    ({"FORAGE_THREADS": "2"}, 2, "PASSIVE"),
    # forage up's children: the cores split between processes (any machine below 128 cores).
    ({"FORAGE_CPU_SHARE": "128"}, 1, "PASSIVE"),
    ({"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}, 2, "ACTIVE"),  # the user's win
])
def test_server_applies_the_thread_policy(flat_index, env, threads, policy):
    process, health = _serve(flat_index, env)
    try:
        assert health["threads"] == {"torch": threads, "faiss": threads,
                                     "omp_wait_policy": policy}
    finally:
        stop_server(process)
