"""Weight sync throughput: gRPC fetch of a bf16 state dict vs a plain TCP copy of its bytes.

A child process plays the learner: it builds a bf16 state dict of --size-mb (transformer-like
shapes, deterministic), publishes it on a WeightSyncServer and also serves the same bytes on a
plain TCP socket. This process plays the replica: it fetches the set over gRPC (verification
and checksum included) and, as the baseline, receives the same bytes with `recv_into` into a
preallocated buffer. Both are run --repeats times alternately; the best of each is compared.
The last line printed is the ratio gRPC bytes/s / TCP bytes/s (target >= 0.5).

    .venv/bin/python bench/weight_sync.py                  # 1024 MB, ~3 GB RAM peak
    .venv/bin/python bench/weight_sync.py --size-mb 256 --chunk-mb 4
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _state_dict(size_mb: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    hidden = 2048
    total = size_mb << 20
    tensors = {}
    layer = 0
    while total > 0:
        # one "layer": a big matrix, a smaller one and two norm vectors, all bf16
        for name, shape in (("mlp.weight", (4 * hidden, hidden)), ("attn.weight", (hidden, hidden)),
                            ("norm1.weight", (hidden,)), ("norm2.weight", (hidden,))):
            numel = min(int(torch.tensor(shape).prod()), total // 2)
            if numel <= 0:
                break
            rows = max(1, numel // shape[-1]) if len(shape) == 2 else 1
            shape = (rows, shape[-1]) if len(shape) == 2 else (min(shape[0], numel),)
            t = torch.empty(shape, dtype=torch.bfloat16)
            t.view(torch.int16).random_(-(2**15), 2**15 - 1, generator=generator)
            tensors[f"layers.{layer}.{name}"] = t
            total -= t.numel() * 2
        layer += 1
    return tensors


def _learner(size_mb: int, chunk_bytes: int, checksum: str, conn) -> None:
    import torch

    from services.common.weight_sync import WeightSyncServer
    from services.common.weight_sync.wire import as_bytes

    torch.set_num_threads(1)
    state = _state_dict(size_mb)
    server = WeightSyncServer(chunk_bytes=chunk_bytes, checksum_algo=checksum).start()
    server.publish(state, version=1)
    listener = socket.create_server(("127.0.0.1", 0))
    views = [as_bytes(t) for t in state.values()]

    def serve_tcp() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            with sock:
                for view in views:
                    sock.sendall(view)

    threading.Thread(target=serve_tcp, daemon=True).start()
    conn.send((server.port, listener.getsockname()[1], sum(len(v) for v in views)))
    conn.recv()  # wait for "stop"
    listener.close()
    server.stop(0)


def _minor_faults() -> int:
    """Page faults of this process so far: first touches of fresh memory, a large hidden cost."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _tcp_fetch(port: int, total: int, buffer: memoryview) -> float:
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        got = 0
        while got < total:
            n = sock.recv_into(buffer[got:], min(total - got, 4 << 20))
            if n == 0:
                raise RuntimeError(f"TCP baseline got {got} of {total} bytes")
            got += n
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--chunk-mb", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checksum", default=None,
                        help="xxh3_64 | sha256 | sha1 | blake2b | crc32 (default: the server's, xxh3_64)")
    parser.add_argument("--hash-thread", choices=("auto", "on", "off"), default="auto",
                        help="checksum on a helper thread (auto: with 4+ cores)")
    args = parser.parse_args()

    import numpy as np
    import torch

    from services.common.weight_sync import WeightSyncClient, wire

    checksum = args.checksum or wire.DEFAULT_CHECKSUM

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    chunk_bytes = int(args.chunk_mb * (1 << 20))
    learner = ctx.Process(
        target=_learner, args=(args.size_mb, chunk_bytes, checksum, child)
    )
    learner.start()
    try:
        grpc_port, tcp_port, total = parent.recv()
        hash_thread = {"auto": None, "on": True, "off": False}[args.hash_thread]
        client = WeightSyncClient(f"127.0.0.1:{grpc_port}", max_message_bytes=1 << 30,
                                  hash_thread=hash_thread)
        # The first large allocation of a fresh process pays first-touch page faults (1+ s per
        # GB on the VMs measured); pay them once here so neither transport is charged for them.
        warm = np.empty(total, dtype=np.uint8)
        warm[::4096] = 1
        del warm
        grpc_best = tcp_best = float("inf")
        for attempt in range(args.repeats):
            def run_grpc() -> tuple[float, int]:
                faults = _minor_faults()
                started = time.perf_counter()
                version, tensors = client.fetch()
                elapsed = time.perf_counter() - started
                assert sum(t.numel() * t.element_size() for t in tensors.values()) == total
                return elapsed, _minor_faults() - faults

            def run_tcp() -> tuple[float, int]:
                faults = _minor_faults()
                buffer = np.empty(total, dtype=np.uint8)
                return _tcp_fetch(tcp_port, total, memoryview(buffer)), _minor_faults() - faults

            if attempt % 2:  # alternate the order, so neither always runs on a warmer heap
                (tcp_elapsed, tcp_faults), (elapsed, faults) = run_tcp(), run_grpc()
            else:
                (elapsed, faults), (tcp_elapsed, tcp_faults) = run_grpc(), run_tcp()
            grpc_best = min(grpc_best, elapsed)
            tcp_best = min(tcp_best, tcp_elapsed)
            print(f"run {attempt + 1}: grpc {total / elapsed / 1e9:.2f} GB/s "
                  f"({elapsed:.2f}s, {faults} page faults), tcp {total / tcp_elapsed / 1e9:.2f} "
                  f"GB/s ({tcp_elapsed:.2f}s, {tcp_faults} page faults)", flush=True)
        client.close()
    finally:
        parent.send("stop")
        learner.join(30)
        if learner.is_alive():
            learner.terminate()
    grpc_rate, tcp_rate = total / grpc_best, total / tcp_best
    print(f"size {total / 2**20:.0f} MiB bf16, chunk {args.chunk_mb} MiB, {checksum}: "
          f"gRPC fetch {grpc_rate / 1e9:.2f} GB/s, TCP copy {tcp_rate / 1e9:.2f} GB/s")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average: {load} on {os.cpu_count()} cores")
    print(f"ratio: {grpc_rate / tcp_rate:.2f}")


if __name__ == "__main__":
    main()
