"""Retriever throughput through HTTP /retrieve vs the same encoder + index in-process.

    .venv/bin/python bench/retriever.py [--index flat] [--passages 2000] [--queries 640]
                                        [--clients 4] [--batch 32] [--single 200]

Builds (or reuses) an index of a synthetic corpus, measures queries/s of `Searcher.search` on
batches of `--batch` queries in this process, then starts `forage retriever serve` as a real
process and measures queries/s with `--clients` concurrent HTTP clients sending the same
batches, and the p50/p99 latency of single-query requests. Both sides use the same thread
settings. Last line: `ratio: HTTP q/s / in-process q/s` (target ≥ 0.7).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORDS = ("river castle dragon harbor forest bakery observatory vineyard library mine tower "
         "bridge market garden temple island valley desert glacier canyon village meadow "
         "lighthouse orchard quarry mill abbey fortress").split()
VERBS = ("guards holds sells grows studies crosses shelters hides trades builds keeps").split()


def make_corpus(path: Path, passages: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for n in range(passages):
            words = rng.sample(WORDS, 6)
            text = " ".join(
                f"The {a} {rng.choice(VERBS)} the {b}." for a, b in zip(words, words[1:], strict=False)
            )
            handle.write(json.dumps({"id": n, "title": f"{words[0].title()} {n}",
                                     "text": text}) + "\n")


def make_queries(count: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [f"which {rng.choice(WORDS)} {rng.choice(VERBS)} the {rng.choice(WORDS)}"
            for _ in range(count)]


def batches(items: list[str], size: int) -> list[list[str]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def in_process_qps(searcher, queries: list[str], batch: int, topk: int) -> float:
    started = time.perf_counter()
    for chunk in batches(queries, batch):
        searcher.search(chunk, topk)
    return len(queries) / (time.perf_counter() - started)


def http_qps(url: str, queries: list[str], batch: int, topk: int, clients: int) -> float:
    chunks = batches(queries, batch)
    local = __import__("threading").local()

    def call(chunk: list[str]) -> None:
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=120)
        response = local.client.post(url, json={"queries": chunk, "topk": topk,
                                                "return_scores": True})
        response.raise_for_status()
        assert len(response.json()["result"]) == len(chunk)

    with ThreadPoolExecutor(max_workers=clients) as pool:
        started = time.perf_counter()
        list(pool.map(call, chunks))
        return len(queries) / (time.perf_counter() - started)


def single_latencies(url: str, queries: list[str], topk: int) -> list[float]:
    timings = []
    with httpx.Client(timeout=60) as client:
        for query in queries:
            started = time.perf_counter()
            response = client.post(url, json={"queries": [query], "topk": topk})
            response.raise_for_status()
            timings.append(time.perf_counter() - started)
    return timings


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", default="flat", choices=("flat", "hnsw", "ivf", "bm25"))
    parser.add_argument("--passages", type=int, default=2000)
    parser.add_argument("--queries", type=int, default=320)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--single", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch/faiss threads, the same on both sides (OMP_NUM_THREADS)")
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--work", default=None, help="where corpus/index live (reused)")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server inherits it
    import faiss
    import torch

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    work = Path(args.work or Path(tempfile.gettempdir()) / "forage-bench-retriever")
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"corpus-{args.passages}.jsonl"
    if not corpus.exists():
        make_corpus(corpus, args.passages)
    from services.retriever.build import build_index

    index_dir = build_index(corpus, work / f"index-{args.index}-{args.passages}", args.index,
                            show_progress=False)
    queries = make_queries(args.queries)

    from services.retriever.searcher import Searcher

    searcher = Searcher.load(index_dir)
    for chunk in batches(queries[: args.batch * 2], args.batch):  # warm-up
        searcher.search(chunk, args.topk)

    port = free_port()
    server = subprocess.Popen(
        [str(REPO / ".venv" / "bin" / "forage"), "retriever", "serve", "--index",
         str(index_dir), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("server did not start")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port}/retrieve"
        http_qps(url, queries[: args.batch * args.clients * 2], args.batch, args.topk,
                 args.clients)  # warm-up
        # Interleaved rounds: on a shared machine the load drifts, and alternating the two
        # measurements exposes both to the same drift; medians drop the outlier rounds.
        bases, https = [], []
        for round_number in range(args.rounds):
            bases.append(in_process_qps(searcher, queries, args.batch, args.topk))
            https.append(http_qps(url, queries, args.batch, args.topk, args.clients))
            print(f"round {round_number + 1}: in-process {bases[-1]:.1f} q/s, "
                  f"HTTP {https[-1]:.1f} q/s", flush=True)
        base, http = statistics.median(bases), statistics.median(https)
        print(f"in-process: {base:.1f} queries/s (median, batches of {args.batch})")
        print(f"HTTP: {http:.1f} queries/s (median, {args.clients} clients, batches of "
              f"{args.batch})", flush=True)
        latencies = single_latencies(url, make_queries(args.single, seed=2), args.topk)
        print(f"single-query latency: p50 {1000 * percentile(latencies, 50):.1f} ms, "
              f"p99 {1000 * percentile(latencies, 99):.1f} ms, "
              f"mean {1000 * statistics.fmean(latencies):.1f} ms ({args.single} requests)")
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"ratio: {http / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
