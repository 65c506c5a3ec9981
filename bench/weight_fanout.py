"""Weight fan-out: time until N replicas hold a new version, relays vs direct pull.

One learner process (a `WeightSyncServer`) and 16 receiver processes on loopback, each with a
per-process bandwidth cap that emulates a NIC: a token bucket of --mib-per-s in each direction
(full duplex), charged per gRPC message, in the learner's sends (`pace` on the server) and in
each receiver's sends (its relay's server) and receives (its client). The cap is implemented
here, in the bench's own processes: loopback alone has no NIC to share. The sending side
holds each message until its transmission at the cap would end (no burst: store-and-forward,
so every relay hop costs one chunk's time, as on a real link); the receiving side caps the
average inflow (a burst of one message, so what the sender already paced is not delayed twice).

For N in --counts, the learner publishes a fresh version and N receivers are told to fetch it
at the same moment, once pulling directly from the learner (today's path: the learner's uplink
carries N copies) and once through relays (`relays=True` with a `WeightRelay`: the learner
names a source for each receiver, a pipelined chain, and each receiver forwards verified
chunks as they arrive). The time is from the start signal to the last receiver holding the
verified version. Both modes run in the same session on the same processes, alternating which
goes first. Also reported: the learner's bytes sent and CPU seconds per version (the server
runs in rank 0's training process), and with --probe a training-like step loop timed inside the
learner process while N receivers fetch.

    .venv/bin/python bench/weight_fanout.py                       # 64 MiB, 10 MiB/s, N up to 16
    .venv/bin/python bench/weight_fanout.py --size-mb 128 --mib-per-s 20 --chunk-kb 512

The last line printed is `ratio: direct_time / relay_time at N=16` (target >= 5, with the relay
time at N=16 <= 1.5 x the relay time at N=1).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class TokenBucket:
    """A NIC's rate in one direction: `take(n)` returns once n bytes fit under `rate` bytes/s.

    Debt-based: a taker adds its bytes and sleeps until the bucket is back to zero, so several
    threads sharing the bucket (a relay serving children, a server's streams) share the rate.
    `burst` bytes may go at once after an idle spell (about one message).
    """

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= nbytes
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


def _state_dict(size_mb: int):
    """bf16 tensors of `size_mb` in all, transformer-like shapes, deterministic bits."""
    import torch

    generator = torch.Generator().manual_seed(0)
    hidden, total, layer, tensors = 1024, size_mb << 20, 0, {}
    while total > 0:
        for name, shape in (("mlp.weight", (4 * hidden, hidden)), ("attn.weight", (hidden, hidden)),
                            ("norm.weight", (hidden,))):
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


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _learner(conn, size_mb: int, chunk_bytes: int, rate: float) -> None:
    """The learner: publishes on command, serves at `rate` bytes/s up; optional step loop."""
    import torch

    from services.common.weight_sync import WeightSyncServer

    torch.set_num_threads(1)
    up = TokenBucket(rate, 0)
    # Every direct fetch at once (the per-address cap would make most of them wait on "busy"
    # on loopback, where all receivers share one address): the config keys
    # learner.weight_sync_max_fetches / _per_peer.
    server = WeightSyncServer(chunk_bytes=chunk_bytes, max_workers=40, max_fetches=36,
                              max_fetches_per_peer=36, pace=up.take).start()
    state = _state_dict(size_mb)
    first = next(iter(state.values()))
    probe_stop = threading.Event()
    steps: list[float] = []

    def step_loop() -> None:  # a training-like step: matmuls plus a little Python
        a, b = torch.randn(384, 384), torch.randn(384, 384)
        while not probe_stop.is_set():
            started = time.perf_counter()
            for _ in range(8):
                a = torch.tanh(a @ b) * 0.5
            steps.append(time.perf_counter() - started)

    conn.send(server.address)
    probe: threading.Thread | None = None
    while True:
        command, *args = conn.recv()
        if command == "publish":
            first.view(-1)[0] = float(args[0])  # each version's bytes (and checksum) differ
            server.publish(state, args[0])
            conn.send((server.bytes_sent, _cpu_s()))
        elif command == "stats":
            conn.send((server.bytes_sent, _cpu_s()))
        elif command == "probe":
            steps.clear()
            probe_stop.clear()
            probe = threading.Thread(target=step_loop, daemon=True)
            probe.start()
            conn.send(None)
        elif command == "probe_stop":
            probe_stop.set()
            if probe is not None:
                probe.join()
            conn.send(list(steps))
        elif command == "stop":
            server.stop(0)
            conn.send(None)
            return


def _receiver(conn, address: str, rate: float, chunk_bytes: int) -> None:
    """One replica: fetch on command, directly or through relays (serving its own relay)."""
    import torch

    from services.common.weight_sync import WeightSyncClient
    from services.common.weight_sync.relay import WeightRelay

    torch.set_num_threads(1)
    down, up = TokenBucket(rate, chunk_bytes), TokenBucket(rate, 0)
    relay = WeightRelay(pace=up.take, hold_s=3600, stall_timeout_s=120).start()
    clients = {
        "relay": WeightSyncClient(address, relays=True, relay=relay, pace=down.take,
                                  timeout_s=900),
        "direct": WeightSyncClient(address, pace=down.take, timeout_s=900),
    }
    conn.send("ready")
    while True:
        command, *args = conn.recv()
        if command == "stop":
            relay.stop()
            conn.send(None)
            return
        mode, version, start_at = args
        time.sleep(max(0.0, start_at - time.monotonic()))
        try:
            got, tensors = clients[mode].fetch(version)
            first = next(iter(tensors.values()))
            ok = got == version and float(first.view(-1)[0]) == float(version)
            conn.send((time.monotonic(), ok, ""))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            conn.send((time.monotonic(), False, f"{type(exc).__name__}: {exc}"))
        tensors = None


def run(size_mb: int, chunk_kb: int, mib_per_s: float, counts: list[int], probe: bool) -> dict:
    ctx = mp.get_context("spawn")
    rate = mib_per_s * (1 << 20)
    chunk_bytes = chunk_kb << 10
    learner_conn, child = ctx.Pipe()
    learner = ctx.Process(target=_learner, args=(child, size_mb, chunk_bytes, rate), daemon=True)
    learner.start()
    address = learner_conn.recv()
    receivers = []
    for _ in range(max(counts)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_receiver, args=(child, address, rate, chunk_bytes),
                           daemon=True)
        proc.start()
        receivers.append((proc, parent))
    for _, conn in receivers:
        assert conn.recv() == "ready"
    version = 0
    results: dict[tuple[str, int], dict[str, float]] = {}

    def one_round(mode: str, n: int) -> dict[str, float]:
        nonlocal version
        version += 1
        learner_conn.send(("publish", version))
        sent0, cpu0 = learner_conn.recv()
        start = time.monotonic() + 0.3
        for _, conn in receivers[:n]:
            conn.send(("fetch", mode, version, start))
        answers = [conn.recv() for _, conn in receivers[:n]]
        learner_conn.send(("stats",))
        sent1, cpu1 = learner_conn.recv()
        bad = [err or "wrong bytes" for _, ok, err in answers if not ok]
        if bad:
            raise RuntimeError(f"{mode} N={n}: {len(bad)} receiver(s) failed: {bad[0]}")
        elapsed = max(done for done, _, _ in answers) - start
        row = {"s": elapsed, "sent_mib": (sent1 - sent0) / 2**20, "cpu_s": cpu1 - cpu0}
        print(f"{mode:6s} N={n:2d}: {elapsed:6.2f} s, learner sent {row['sent_mib']:7.1f} MiB, "
              f"learner CPU {row['cpu_s']:.2f} s", flush=True)
        return row

    try:
        for i, n in enumerate(counts):
            order = ("direct", "relay") if i % 2 == 0 else ("relay", "direct")
            for mode in order:
                results[(mode, n)] = one_round(mode, n)
        probes: dict[str, float] = {}
        if probe:
            n = max(counts)
            for label, mode in (("idle", None), ("direct", "direct"), ("relay", "relay")):
                learner_conn.send(("probe",))
                learner_conn.recv()
                if mode is None:
                    time.sleep(5.0)
                else:
                    one_round(mode, n)
                learner_conn.send(("probe_stop",))
                steps = learner_conn.recv()
                probes[label] = statistics.median(steps) * 1e3 if steps else float("nan")
                print(f"probe {label:6s}: median step {probes[label]:.1f} ms over {len(steps)} "
                      "steps", flush=True)
    finally:
        for _, conn in receivers:
            conn.send(("stop",))
        learner_conn.send(("stop",))
        for proc, _ in receivers:
            proc.join(10)
        learner.join(10)
    return {"results": results, "probes": probes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--chunk-kb", type=int, default=512,
                        help="learner chunk size; each relay hop adds about chunk / rate")
    parser.add_argument("--mib-per-s", type=float, default=10.0,
                        help="emulated NIC: per process, each direction")
    parser.add_argument("--counts", default="1,2,4,8,16")
    parser.add_argument("--no-probe", action="store_true",
                        help="skip timing a step loop in the learner process")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    print(f"weight fan-out: {args.size_mb} MiB bf16, {args.chunk_kb} KiB chunks, every process "
          f"capped at {args.mib_per_s:g} MiB/s up and {args.mib_per_s:g} MiB/s down (token "
          "buckets in this bench's processes emulating a NIC; sends store-and-forward), "
          "loopback gRPC; "
          f"{os.cpu_count()} cores, load {', '.join(f'{x:.2f}' for x in os.getloadavg())}",
          flush=True)
    started = time.monotonic()
    figures = run(args.size_mb, args.chunk_kb, args.mib_per_s, counts, not args.no_probe)
    results = figures["results"]
    ideal = args.size_mb / args.mib_per_s
    print(f"\none transfer at the cap: {ideal:.2f} s\n")
    print("| N | direct pull | relays | direct / relays | relays / relays at N=1 | learner "
          "sent direct / relays (MiB) | learner CPU direct / relays (s) |")
    print("|---|---|---|---|---|---|---|")
    first = results[("relay", counts[0])]["s"]
    for n in counts:
        d, r = results[("direct", n)], results[("relay", n)]
        print(f"| {n} | {d['s']:.2f} s | {r['s']:.2f} s | {d['s'] / r['s']:.2f} | "
              f"{r['s'] / first:.2f} | {d['sent_mib']:.0f} / {r['sent_mib']:.0f} | "
              f"{d['cpu_s']:.2f} / {r['cpu_s']:.2f} |")
    if figures["probes"]:
        p = figures["probes"]
        print(f"\nstep loop in the learner process, median: idle {p['idle']:.1f} ms, while "
              f"{max(counts)} pull directly {p['direct']:.1f} ms, through relays "
              f"{p['relay']:.1f} ms")
    last = max(counts)
    direct, relay = results[("direct", last)]["s"], results[("relay", last)]["s"]
    print(f"\nload after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"wall {time.monotonic() - started:.0f} s")
    print(f"targets at N={last}: relays <= 1.5 x N=1 ({relay / first:.2f}), "
          f">= 5x faster than direct ({direct / relay:.2f})")
    print(f"ratio: {direct / relay:.2f}")


if __name__ == "__main__":
    main()
