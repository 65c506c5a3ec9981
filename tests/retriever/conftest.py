"""Retriever fixtures: one small corpus and one Flat index per session, a live server process."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from services.common.ports import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[2]
FORAGE = str(REPO / ".venv" / "bin" / "forage")

TOPICS = {
    "river": "flows through the valley past old mills and into the northern sea",
    "castle": "stands on a hill with stone walls, towers and a deep moat",
    "dragon": "breathes fire and guards a hoard of gold in a mountain cave",
    "harbor": "shelters fishing boats and merchant ships from winter storms",
    "forest": "is full of oak trees, wolves, owls and hidden footpaths",
    "bakery": "sells fresh bread, pastries and cakes every morning",
    "observatory": "houses a large telescope used to study distant stars and comets",
    "vineyard": "grows grapes on sunny slopes and makes red and white wine",
    "library": "keeps thousands of books, maps and ancient manuscripts",
    "mine": "digs copper and iron ore from tunnels deep underground",
}
KEYWORD = "zyxquorble"
KEYWORD_ROW = 137


def _make_corpus(path: Path, rows: int = 200, seed: int = 0) -> list[dict]:
    """Passages about fictional places; odd rows use id+title+text, even rows id+contents."""
    rng = random.Random(seed)
    names = list(TOPICS)
    written = []
    with open(path, "w") as handle:
        for row in range(rows):
            topic = names[row % len(names)]
            other = rng.choice(names)
            place = f"{rng.choice(['North', 'South', 'Old', 'New', 'Upper'])} {topic} {row}"
            text = (f"The {topic} of {place} {TOPICS[topic]}. Nearby there is also a {other} "
                    f"that {TOPICS[other]}.")
            if row == KEYWORD_ROW:
                text += f" The local word for friendship is {KEYWORD}."
            title = place.title()
            if row % 2:
                item = {"id": row, "title": title, "text": text}
            else:
                item = {"id": str(row), "contents": f'"{title}"\n{text}'}
            handle.write(json.dumps(item) + "\n")
            written.append(item)
    return written


@pytest.fixture(scope="session", autouse=True)
def _limit_threads():
    import torch

    torch.set_num_threads(1)
    try:
        import faiss

        faiss.omp_set_num_threads(1)
    except (ImportError, AttributeError):
        pass


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> tuple[Path, list[dict]]:
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    return path, _make_corpus(path)


@pytest.fixture(scope="session")
def flat_index(corpus, tmp_path_factory) -> Path:
    from services.retriever.build import build_index

    out = tmp_path_factory.mktemp("indexes") / "flat"
    return build_index(corpus[0], out, "flat", show_progress=False)


@pytest.fixture(scope="session")
def flat_searcher(flat_index):
    from services.retriever.searcher import Searcher

    return Searcher.load(flat_index)


def start_server(args: list[str], port: int, timeout: float = 90.0) -> subprocess.Popen:
    """`forage retriever serve ...` as a real process; returns once /healthz is 200."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [FORAGE, "retriever", "serve", *args, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = process.stdout.read() if process.stdout else ""
            raise RuntimeError(f"server exited with {process.returncode}:\n{output}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(process)
    raise RuntimeError("server did not become healthy in time")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def server(flat_index, tmp_path_factory):
    """A server with a config file (topk 3, small limits) and flags that must win over it."""
    config = tmp_path_factory.mktemp("config") / "run.yaml"
    config.write_text(
        "retriever:\n"
        "  port: 1\n"  # overridden by --port: flags win
        "  topk: 2\n"
        "  max_topk: 20\n"
        "  max_queries_per_request: 64\n"
        "  max_query_chars: 200\n"
        "  max_body_bytes: 65536\n"
        # Compared with the in-process float32 searcher to 1e-5 (test_server.py); the reduced
        # precision `auto` picks on some CPUs has its own test (test_search.py).
        "  query_dtype: float32\n"
    )
    port = free_port()
    process = start_server(
        ["--config", str(config), "--set", "retriever.max_wait_ms=10", "--index",
         str(flat_index), "--topk", "3"],
        port,
    )
    yield f"http://127.0.0.1:{port}"
    stop_server(process)


@pytest.fixture(scope="session")
def keyword() -> tuple[str, int]:
    """The rare word planted in one passage (BM25's exact-match test) and its row."""
    return KEYWORD, KEYWORD_ROW


@pytest.fixture(scope="session")
def tools() -> SimpleNamespace:
    """Helpers for tests that start processes (importlib mode cannot import conftest)."""
    return SimpleNamespace(free_port=free_port, start_server=start_server,
                           stop_server=stop_server, forage=FORAGE, python=sys.executable,
                           make_corpus=_make_corpus)
