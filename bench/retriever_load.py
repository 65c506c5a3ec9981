"""Retriever throughput on a quiet machine and under one competing busy process, optionally side
by side with Search-R1's `retrieval_server.py` on the same index, corpus and encoder.

    .venv/bin/python bench/retriever_load.py [--rounds 3] [--loads quiet,busy]
        [--peer /tmp/searchr1/retrieval_server.py --peer-python /tmp/searchr1/venv/bin/python]
        [--server-env NAME=VALUE ...] [--world DIR]

What it does: builds (or reuses) the synthetic world and a Flat index of its corpus with
all-MiniLM-L6-v2 (`forage data synth`, `forage retriever build-index`), starts `forage
retriever serve` as shipped (the thread variables of the calling shell are removed, so the
server's own policy, services/common/threads.py, decides; `--server-env` adds some back for
experiments) and, with `--peer`, Search-R1's server from a patched copy in a temp folder (its
`.cuda()` calls made no-ops, fp16 off, host/port from the environment; nothing of it is kept
or committed). It checks that both give the same top-1 passage on 20 questions, then, for
`--rounds` rounds, for each load (`quiet`; `busy`: a `while True: pass` process it starts and
stops itself) and each server (the order alternating between rounds), lets the server settle
at that load (SETTLE_S of unmeasured batch traffic: Forage's worker limit adapts at most once
per 3 s) and measures:

- single: 8 client threads, each sending one-query requests (`--single-requests` in all);
- batch: 4 client threads, each sending 32-query requests (`--batch-requests` in all).

Queries are the world's questions, `topk` 3, `return_scores: true` (Search-R1's endpoint needs
it). Figures are medians over rounds, in queries/s. Printed: the table, Forage busy/quiet per
workload and, with a peer, Forage/Search-R1 per cell. The last line is `ratio: ...`: the
smallest Forage/Search-R1 ratio with a peer, else the smallest Forage busy/quiet ratio.
Load averages before and after are printed: on a shared machine other work skews every figure.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from services.common.threads import without_thread_settings

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
WORKLOADS = {"single": (8, 1), "batch": (4, 32)}  # name: (client threads, queries per request)
TOPK = 3

# Search-R1's retrieval_server.py, made to run on this CPU: each pattern
# must match, so a changed upstream file fails loudly instead of benchmarking something else.
PEER_PATCHES = [
    (r"model\.cuda\(\)", "model  # .cuda() removed: CPU"),
    (r"inputs = \{k: v\.cuda\(\) for k, v in inputs\.items\(\)\}",
     "inputs = {k: v for k, v in inputs.items()}  # .cuda() removed: CPU"),
    (r"retrieval_use_fp16=True", "retrieval_use_fp16=False"),
    (r'uvicorn\.run\(app, host="0\.0\.0\.0", port=8000\)',
     'uvicorn.run(app, host="127.0.0.1", port=int(os.environ["SEARCHR1_PORT"]))'),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = without_thread_settings(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.update(extra)
    return env


def forage(*args: str) -> None:
    done = subprocess.run([PYTHON, "-m", "services.cli", *args], cwd=REPO, env=clean_env({}),
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"forage {' '.join(args)} failed:\n{done.stdout}{done.stderr}")


def prepare_world(world: Path) -> Path:
    if not (world / "corpus.jsonl").exists():
        forage("data", "synth", "--out", str(world), "--no-sft", "--quiet")
    index = world / "index"
    forage("retriever", "build-index", "--corpus", str(world / "corpus.jsonl"), "--out",
           str(index), "--no-progress")
    return index


def world_questions(world: Path) -> list[str]:
    import pyarrow.parquet as pq

    questions: list[str] = []
    for split in ("train", "test"):
        table = pq.read_table(world / f"{split}.parquet", columns=["extra_info"])
        questions += [row["question"] for row in table.column("extra_info").to_pylist()]
    return questions


def patch_peer(source: Path, folder: Path) -> Path:
    text = source.read_text()
    for pattern, replacement in PEER_PATCHES:
        text, count = re.subn(pattern, replacement, text)
        if count != 1:
            raise SystemExit(f"{source}: expected one match of {pattern!r}, found {count}")
    target = folder / "retrieval_server.py"
    target.write_text(text)
    return target


class Server:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int,
                 log: Path) -> None:
        self.name, self.port = name, port
        self.log = log
        self.process = subprocess.Popen(argv, env=env, cwd=REPO, stdout=log.open("w"),
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{self.name} exited ({self.process.returncode}); see {self.log}")
            try:
                post(self.connect(), json.dumps({"queries": ["warm up"], "topk": TOPK,
                                                 "return_scores": True}).encode(), 1)
                return
            except (OSError, http.client.HTTPException, RuntimeError):
                time.sleep(0.5)
        raise SystemExit(f"{self.name} did not answer in {timeout:.0f} s; see {self.log}")

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def post(conn: http.client.HTTPConnection, body: bytes, expected: int) -> list:
    conn.request("POST", "/retrieve", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {data[:200]!r}")
    result = json.loads(data)["result"]
    if len(result) != expected:
        raise RuntimeError(f"{len(result)} results for {expected} queries")
    return result


def throughput(server: Server, questions: list[str], clients: int, per_request: int,
               requests: int, offset: int) -> float:
    """Queries/s of `requests` requests of `per_request` queries sent by `clients` threads,
    each on its own keep-alive connection."""
    bodies = []
    for n in range(requests):
        start = (offset + n * per_request) % len(questions)
        chunk = [questions[(start + i) % len(questions)] for i in range(per_request)]
        bodies.append(json.dumps({"queries": chunk, "topk": TOPK,
                                  "return_scores": True}).encode())
    lock, errors = threading.Lock(), []

    def client() -> None:
        conn = server.connect()
        try:
            while True:
                with lock:
                    if not bodies:
                        return
                    body = bodies.pop()
                post(conn, body, per_request)
        except Exception as exc:  # noqa: BLE001 (reported after the run)
            errors.append(exc)
        finally:
            conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise SystemExit(f"{server.name}: {errors[0]}")
    return requests * per_request / elapsed


# Forage's server adapts how many micro-batches run at once to the load it sees, changing the
# limit at most once per PROBE_AFTER_S (3 s; services/retriever/batcher.py). A workload
# measured right after the load changed (a round's ~1-3 s) would time the previous load's
# setting, so each server first serves the batch workload this long under the new load (both
# servers alike).
SETTLE_S = 4.0


def settle(server: Server, questions: list[str], seconds: float) -> None:
    """Serve the batch workload for `seconds` at the current load (not measured)."""
    clients, size = WORKLOADS["batch"]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        throughput(server, questions, clients, size, clients, 0)


def top1(server: Server, questions: list[str]) -> list[str]:
    conn = server.connect()
    try:
        body = json.dumps({"queries": questions, "topk": TOPK, "return_scores": True}).encode()
        return [hits[0]["document"]["contents"] for hits in post(conn, body, len(questions))]
    finally:
        conn.close()


class Busy:
    """One competing CPU-bound process, as a user's other work would be."""

    def __enter__(self) -> Busy:
        self.process = subprocess.Popen([PYTHON, "-c", "while True: pass"])
        time.sleep(1.0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.kill()
        self.process.wait()


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--server-env/--peer-env {item!r}: expected NAME=VALUE")
        env[name] = value
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", default=None,
                        help="world + index folder (default $TMPDIR/forage-bench-retriever-load)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loads", default="quiet,busy", help="quiet, busy or both")
    parser.add_argument("--single-requests", type=int, default=320)
    parser.add_argument("--batch-requests", type=int, default=24)
    parser.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for Forage's server (e.g. OMP_WAIT_POLICY=ACTIVE)")
    parser.add_argument("--peer", default=None,
                        help="Search-R1's search_r1/search/retrieval_server.py (kept outside "
                        "the repository; a patched copy runs from a temp folder)")
    parser.add_argument("--peer-python", default=PYTHON,
                        help="interpreter for the peer (needs `datasets`)")
    parser.add_argument("--peer-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--server-args", default="",
                        help="extra arguments for `forage retriever serve` (e.g. "
                        "'--set log_level=DEBUG --workers 1')")
    parser.add_argument("--logs", default=None,
                        help="keep the servers' logs in this folder (default: removed)")
    args = parser.parse_args()
    loads = [load for load in args.loads.split(",") if load]
    if not set(loads) <= {"quiet", "busy"}:
        raise SystemExit(f"--loads {args.loads!r}: quiet and/or busy")

    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    world = Path(args.world or Path(tempfile.gettempdir()) / "forage-bench-retriever-load")
    index = prepare_world(world)
    questions = world_questions(world)
    manifest = json.loads((index / "manifest.json").read_text())
    scratch = Path(tempfile.mkdtemp(prefix="retriever-load-"))
    servers: list[Server] = []
    try:
        port = free_port()
        servers.append(Server(
            "forage", [PYTHON, "-m", "services.cli", "retriever", "serve", "--index",
                       str(index), "--port", str(port), *shlex.split(args.server_args)],
            clean_env(parse_env(args.server_env)), port, scratch / "forage.log"))
        if args.peer:
            peer_file = patch_peer(Path(args.peer), scratch)
            port = free_port()
            servers.append(Server(
                "search-r1", [args.peer_python, str(peer_file), "--index_path",
                              str(index / "index.faiss"), "--corpus_path",
                              str(world / "corpus.jsonl"), "--topk", str(TOPK),
                              "--retriever_name", "minilm", "--retriever_model",
                              manifest["encoder"]],
                clean_env({"SEARCHR1_PORT": str(port),
                           "HF_DATASETS_CACHE": str(scratch / "hf-datasets"),
                           **parse_env(args.peer_env)}),
                port, scratch / "search-r1.log"))
        for server in servers:
            server.wait_ready()
        health = json.loads(_get(servers[0], "/healthz"))
        print(f"forage server threads: {health.get('threads')}", flush=True)
        if len(servers) == 2:
            first = [top1(server, questions[:20]) for server in servers]
            same = sum(a == b for a, b in zip(*first, strict=True))
            print(f"top-1 identical on {same}/20 questions", flush=True)
        for server in servers:  # warm-up: every code path once
            for clients, size in WORKLOADS.values():
                throughput(server, questions, clients, size, clients * 2, 0)
        results: dict[tuple[str, str, str], list[float]] = {}
        offset = 0
        for round_number in range(args.rounds):
            order = servers if round_number % 2 == 0 else servers[::-1]
            for load in loads:
                with Busy() if load == "busy" else _Quiet():
                    for server in order:
                        settle(server, questions, SETTLE_S)
                        for name, (clients, size) in WORKLOADS.items():
                            requests = (args.single_requests if name == "single"
                                        else args.batch_requests)
                            qps = throughput(server, questions, clients, size, requests, offset)
                            offset += requests * size
                            results.setdefault((server.name, load, name), []).append(qps)
                            print(f"round {round_number + 1} {load:5} {server.name:9} {name:6} "
                                  f"{qps:7.1f} q/s", flush=True)
    finally:
        for server in servers:
            server.stop()
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            for log in scratch.glob("*.log"):
                shutil.copy(log, Path(args.logs) / log.name)
        shutil.rmtree(scratch, ignore_errors=True)

    median = {key: statistics.median(values) for key, values in results.items()}
    print("\nmedian queries/s (8 clients x 1 query | 4 clients x 32 queries)")
    for load in loads:
        cells = []
        for server in servers:
            cells.append(f"{server.name} {median[(server.name, load, 'single')]:.1f} | "
                         f"{median[(server.name, load, 'batch')]:.1f}")
        print(f"  {load:5}  " + "   ".join(cells))
    ratios = []
    if "quiet" in loads and "busy" in loads:
        for name in WORKLOADS:
            value = median[("forage", "busy", name)] / median[("forage", "quiet", name)]
            print(f"forage busy/quiet {name}: {value:.2f}")
            ratios.append(value)
    peer_ratios = []
    if len(servers) == 2:
        for load in loads:
            for name in WORKLOADS:
                value = median[("forage", load, name)] / median[("search-r1", load, name)]
                print(f"forage/search-r1 {load} {name}: {value:.2f}")
                peer_ratios.append(value)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    final = peer_ratios or ratios
    if final:
        print(f"ratio: {min(final):.2f}")
    return 0


class _Quiet:
    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _get(server: Server, path: str) -> str:
    conn = server.connect()
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main())
