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


def _state_dict(size_mb: int, device: str = "cpu"):
    """Transformer-like bf16 tensors of `size_mb` in all, on `device` (random bits made on the
    CPU, so every device gets the same values)."""
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
            tensors[f"layers.{layer}.{name}"] = t.to(device)
            total -= t.numel() * 2
        layer += 1
    return tensors


def _learner(size_mb: int, chunk_bytes: int, checksum: str, conn, device: str = "cpu") -> None:
    """The learner's side: publish the state dict (from `device`) and serve its bytes on TCP.
    On CUDA the TCP baseline serves a host copy made beforehand, so only the gRPC side pays
    the device-to-host copy (inside `publish`, timed separately)."""
    import torch

    from services.common.weight_sync import WeightSyncServer
    from services.common.weight_sync.wire import as_bytes

    torch.set_num_threads(1)
    state = _state_dict(size_mb, device)
    server = WeightSyncServer(chunk_bytes=chunk_bytes, checksum_algo=checksum).start()
    started = time.perf_counter()
    server.publish(state, version=1)
    publish_s = time.perf_counter() - started
    listener = socket.create_server(("127.0.0.1", 0))
    views = [as_bytes(t.cpu()) for t in state.values()]

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
    conn.send((server.port, listener.getsockname()[1], sum(len(v) for v in views), publish_s))
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


def measure(size_mb: int = 1024, chunk_mb: float = 4.0, repeats: int = 3,
            checksum: str | None = None, hash_thread: bool | None = None,
            device: str = "cpu") -> dict[str, float]:
    """gRPC fetch vs TCP copy of a `size_mb` bf16 state dict published from `device`; on CUDA
    also the time to load the fetched tensors back onto the device (a replica's next step)."""
    import numpy as np
    import torch

    from services.common.weight_sync import WeightSyncClient, wire

    checksum = checksum or wire.DEFAULT_CHECKSUM
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    chunk_bytes = int(chunk_mb * (1 << 20))
    learner = ctx.Process(
        target=_learner, args=(size_mb, chunk_bytes, checksum, child, device)
    )
    learner.start()
    load_s = None
    try:
        grpc_port, tcp_port, total, publish_s = parent.recv()
        client = WeightSyncClient(f"127.0.0.1:{grpc_port}", max_message_bytes=1 << 30,
                                  hash_thread=hash_thread)
        # The first large allocation of a fresh process pays first-touch page faults (1+ s per
        # GB on the VMs measured); pay them once here so neither transport is charged for them.
        warm = np.empty(total, dtype=np.uint8)
        warm[::4096] = 1
        del warm
        grpc_best = tcp_best = float("inf")
        for attempt in range(repeats):
            def run_grpc() -> tuple[float, int]:
                nonlocal load_s
                faults = _minor_faults()
                started = time.perf_counter()
                version, tensors = client.fetch()
                elapsed = time.perf_counter() - started
                assert sum(t.numel() * t.element_size() for t in tensors.values()) == total
                if device != "cpu":
                    started = time.perf_counter()
                    on_device = [t.to(device, non_blocking=True) for t in tensors.values()]
                    torch.cuda.synchronize()
                    load = time.perf_counter() - started
                    load_s = load if load_s is None else min(load_s, load)
                    del on_device
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
    print(f"size {total / 2**20:.0f} MiB bf16 from {device}, chunk {chunk_mb} MiB, {checksum}: "
          f"gRPC fetch {grpc_rate / 1e9:.2f} GB/s, TCP copy {tcp_rate / 1e9:.2f} GB/s")
    figures = {"bytes": float(total), "grpc_gb_per_s": grpc_rate / 1e9,
               "tcp_gb_per_s": tcp_rate / 1e9, "ratio": grpc_rate / tcp_rate,
               "publish_s": publish_s, "checksum": checksum}
    if load_s is not None:
        figures["load_to_device_s"] = load_s
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--chunk-mb", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checksum", default=None,
                        help="xxh3_64 | sha256 | sha1 | blake2b | crc32 (default: the server's, xxh3_64)")
    parser.add_argument("--hash-thread", choices=("auto", "on", "off"), default="auto",
                        help="checksum on a helper thread (auto: with 4+ cores)")
    parser.add_argument("--device", default="cpu", help="where the learner's tensors live")
    args = parser.parse_args()
    hash_thread = {"auto": None, "on": True, "off": False}[args.hash_thread]
    figures = measure(args.size_mb, args.chunk_mb, args.repeats, args.checksum, hash_thread,
                      args.device)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average: {load} on {os.cpu_count()} cores")
    print(f"ratio: {figures['ratio']:.2f}")


if __name__ == "__main__":
    main()
