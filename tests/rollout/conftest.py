"""Fixtures for the rollout tests: a loaded engine over the session's tiny policy
(`tiny_policy_dir` in tests/conftest.py) and a real retriever process."""

from __future__ import annotations

import pytest
import torch

from services.common.ports import free_port as _free_port


@pytest.fixture()
def engine(tiny_policy_dir):
    from services.rollout.transformers_engine import TransformersEngine

    torch.set_num_threads(1)
    return TransformersEngine.from_pretrained(str(tiny_policy_dir), max_batch_size=4, seed=0)


# ---------------------------------------------------------------- retriever

CORPUS = [
    {"id": "0", "contents": '"Brixol"\nBrixol was born in Corvale. Brixol founded a company in 1900.'},
    {"id": "1", "contents": '"Tamra"\nTamra was born in Dunmore. Tamra founded a company in 1907.'},
    {"id": "2", "contents": '"Velden"\nVelden was born in Ashby. Velden founded a company in 1914.'},
    {"id": "3", "contents": '"Osric"\nOsric was born in Pellam. Osric founded a company in 1921.'},
]


def _wait_http(url: str, timeout: float, proc=None) -> None:
    import time

    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"retriever exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout}s")


@pytest.fixture(scope="session")
def retriever_url(tmp_path_factory):
    """A real retriever process (`forage retriever build-index` + `serve`) on a small corpus."""
    import json
    import subprocess
    import sys

    work = tmp_path_factory.mktemp("retriever")
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in CORPUS))
    forage = [sys.executable, "-m", "services.cli", "retriever"]
    subprocess.run(forage + ["build-index", "--corpus", str(corpus), "--out", str(work / "index"),
                             "--index", "flat"], check=True, capture_output=True, timeout=300)
    port = _free_port()
    proc = subprocess.Popen(forage + ["serve", "--index", str(work / "index"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_http(f"http://127.0.0.1:{port}/healthz", 120, proc)
        yield f"http://127.0.0.1:{port}/retrieve"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture()
def dead_retriever_url() -> str:
    return f"http://127.0.0.1:{_free_port()}/retrieve"  # nothing listens there
