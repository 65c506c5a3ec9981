"""Micro-batching: concurrent /retrieve requests share one encoder call and one index search.

Many rollout replicas each send a handful of queries per turn; encoding them one request at a
time leaves the encoder (and a GPU, when there is one) mostly idle on tiny batches. Requests
queue here; a single worker takes whatever is waiting (up to `max_batch` queries, waiting at
most `max_wait_s` for more when the queue runs dry) and runs the batch on one thread. While it
runs, new requests accumulate, so under load batches grow by themselves and the wait is never
paid twice.

A request larger than `max_batch` (Search-R1's trainer sends 512 or 2560 queries in one POST) is
answered in chunks of `max_batch` queries, queued one after the other: the next chunk joins the
queue only when the previous one is done, so requests that arrived meanwhile run between two
chunks instead of waiting for the whole large request, and the encoder never holds more than
one batch.

With `workers` > 1 (services/common/threads.py's split: on a 2-core machine two workers of one
thread each), that many batches run at once, each on its own thread with its own small torch /
faiss thread team. One-thread workers never wait on each other at an OpenMP barrier, so a
competing process on the machine slows them by the share of the cores it takes, not by a
scheduler slice per parallel region (bench/README.md: one busy process took a 2-thread team
from 218 to 6 queries/s; two 1-thread workers did not slow down at all). A large request keeps
at most `workers` of its chunks in flight, so it still uses every worker while others' requests
queue behind at most that many chunks.

Workers only help while each gets a core. When another process takes one of two cores, two
one-thread workers end up time-sharing the other: each runs half as fast on half-size batches,
and the encoder's fixed cost per forward (streaming its weights) is paid twice as often. So the
number of batches allowed to run at once adapts (`next_limit`): when batches that overlapped
another got less than CONTENDED_CPU_SHARE of a core while they wanted one (the scheduler's run
time / (run time + run-queue wait) of the worker thread), the limit drops by one; PROBE_AFTER_S
after the last change it is raised by one again, so a freed core is used within seconds.

Time-sharing is not always a loss, though. When the other work on the machine is the clients
themselves (a benchmark, a trainer on the same node), they sleep while they wait for answers,
and two batches at once served 1.6-1.9x what one did even though each got under 0.75 of a core
(bench/README.md, run D). So the batcher also remembers what each limit served (queries per
second of the time a batch was running, over the window since the limit last changed): a
contended limit is kept when it serves FASTER_BY more than the limit below it did within the
last RATE_STALE_S, and dropped otherwise (or when there is no such figure yet).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("forage.retriever.batcher")

BatchFn = Callable[[list[str], list[int]], list[Any]]

# Batches that ran alongside another and got less than this share of a core while they wanted
# one were time-sharing cores with something: quiet, a one-thread worker gets 0.8-1.0 (the event
# loop and the clients take the rest); beside one busy process on 2 cores, two workers and it
# rotate over the cores and get 0.4-0.67 each, and one worker alone then serves as much (it has
# a core to itself; measured in bench/README.md). The mean of the last SHARE_WINDOW such
# batches since the limit last changed decides, so one slow batch does not.
CONTENDED_CPU_SHARE = 0.75
SHARE_WINDOW = 3
PROBE_AFTER_S = 3.0
# A limit's serving rate is compared once it has run batches for MIN_RATE_WINDOW_S; a
# contended limit stays when it serves FASTER_BY more than the one below it did, a figure at
# most RATE_STALE_S old (load changes; a stale figure is measured again by dropping).
MIN_RATE_WINDOW_S = 1.0
MAX_RATE_WINDOW_S = 5.0  # a limit held longer is measured afresh every this many busy seconds
FASTER_BY = 0.1
RATE_STALE_S = 30.0


def _cpu_and_wait() -> tuple[float, float]:
    """(CPU time, time spent runnable but waiting for a CPU) of the calling thread, seconds.

    The wait comes from the scheduler's per-thread statistics (/proc/thread-self/schedstat:
    run time, run-queue delay, in ns), so waiting for the GIL or for I/O does not count as
    contention; (thread CPU time, -1) where they are missing (not Linux, no sched_info)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as handle:
            run_ns, wait_ns, _ = handle.read().split()
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return time.thread_time(), -1.0


def next_limit(limit: int, workers: int, shares: Sequence[float], since_change_s: float,
               served_per_s: float | None = None, below_per_s: float | None = None) -> int:
    """Micro-batches allowed to run at once, after a batch finished.

    `shares`: the core shares (CPU time / (CPU time + run-queue wait)) of the batches that
    overlapped another since the limit last changed, oldest first. When the mean of the last
    SHARE_WINDOW (at least 2 of them) is under CONTENDED_CPU_SHARE, the batches are
    time-sharing cores: the limit drops by one, unless the limit below has a recent serving rate
    (`below_per_s`, queries/s) and this one does not beat it by FASTER_BY (`served_per_s`, None
    until measured long enough: then it waits for the figure). Raised by one PROBE_AFTER_S after
    the last change, to find out whether a core came free."""
    recent = list(shares)[-SHARE_WINDOW:]
    if limit > 1 and len(recent) >= 2 and sum(recent) / len(recent) < CONTENDED_CPU_SHARE:
        if below_per_s is None:
            return limit - 1
        if served_per_s is None:
            return limit
        if served_per_s <= below_per_s * (1.0 + FASTER_BY):
            return limit - 1
        return limit
    if limit < workers and since_change_s >= PROBE_AFTER_S:
        return limit + 1
    return limit


@dataclass
class _Item:
    queries: list[str]
    topk: Any  # an int, or any hashable the batch function understands (topk + options)
    future: asyncio.Future = field(repr=False)


class MicroBatcher:
    def __init__(self, fn: BatchFn, max_batch: int = 64, max_wait_s: float = 0.005,
                 on_batch: Callable[[int, float], None] | None = None, workers: int = 1,
                 init_worker: Callable[[], dict[str, Any]] | None = None) -> None:
        """`init_worker` runs once on each worker thread before its first batch (per-thread
        settings such as OpenMP thread counts); what it returns is kept in `worker_info`."""
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self._fn = fn
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._on_batch = on_batch
        self._workers = workers
        self._init_worker = init_worker
        self.worker_info: dict[str, Any] = {}
        self._queue: asyncio.Queue[_Item] | None = None
        self._held: deque[_Item] = deque()  # items that did not fit a batch: taken first
        self._tasks: list[asyncio.Task] = []
        self._slots: asyncio.Condition | None = None
        self._active = 0  # workers holding a slot (running a batch or waiting for items)
        self._running: set[object] = set()  # batches on the executor now
        self._overlapped: set[object] = set()  # ... of which some ran beside another
        self.limit = workers  # batches allowed to run at once (next_limit)
        self._shares: deque[float] = deque(maxlen=SHARE_WINDOW)
        self._limit_changed = time.monotonic()
        # Serving rate of the current limit: queries answered and seconds with a batch running
        # since the limit last changed; `rates[limit]` = (queries/s, when) of past windows.
        self._served = 0
        self._busy_s = 0.0
        self._busy_since: float | None = None
        self.rates: dict[int, tuple[float, float]] = {}
        # One thread per worker: each batch runs whole on one thread (the encoder and FAISS
        # parallelise inside a call with their per-worker thread count).
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="retrieve",
                                            initializer=self._on_thread_start)

    def _on_thread_start(self) -> None:
        if self._init_worker is not None:
            self.worker_info[threading.current_thread().name] = self._init_worker()

    @property
    def workers(self) -> int:
        return self._workers

    def warm_up(self, fn: Callable[[], Any], timeout_s: float = 60.0) -> None:
        """Run `fn` once on each of the `workers` threads (called from a non-event-loop thread
        before serving): every worker thread exists and has run `init_worker`, and the first
        real batch does not pay the encoder's first-call costs."""
        barrier = threading.Barrier(self._workers)

        def task() -> None:
            try:  # holds each thread until all exist, so the pool starts `workers` of them
                barrier.wait(timeout_s)
            except threading.BrokenBarrierError:
                pass
            fn()

        for future in [self._executor.submit(task) for _ in range(self._workers)]:
            future.result(timeout=timeout_s * 2)

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._slots = asyncio.Condition()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run()) for _ in range(self._workers)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, queries: list[str], topk: Any) -> list[Any]:
        """Results for `queries` (one entry each), computed in shared batches of at most
        `max_batch` queries; a larger request is split into chunks, at most `workers` of them
        queued or running at a time."""
        if self._queue is None:
            raise RuntimeError("batcher not started")
        loop = asyncio.get_running_loop()
        results: list[Any] = []
        pending: deque[asyncio.Future] = deque()
        try:
            for start in range(0, len(queries), self._max_batch):
                if len(pending) >= self._workers:
                    results.extend(await pending.popleft())
                chunk = list(queries[start : start + self._max_batch])
                future = loop.create_future()
                await self._queue.put(_Item(chunk, topk, future))
                pending.append(future)
            while pending:
                results.extend(await pending.popleft())
        finally:  # cancelled (client gone) or failed: the chunks still queued are not run
            for future in pending:
                future.cancel()
        return results

    async def _next_item(self, timeout: float | None) -> _Item | None:
        if self._held:
            return self._held.popleft()
        assert self._queue is not None
        if timeout is None:
            return await self._queue.get()
        if timeout <= 0:
            try:
                return self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return None
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    def _timed(self, queries: list[str], topks: list[int]) -> tuple[list[Any], float, float]:
        """Runs on a worker thread: the results, the share of a core this thread got while it
        wanted one, and the wall time."""
        before, wall = _cpu_and_wait(), time.perf_counter()
        results = self._fn(queries, topks)
        after, wall = _cpu_and_wait(), time.perf_counter() - wall
        cpu, waited = after[0] - before[0], after[1] - before[1]
        if waited < 0:  # no scheduler statistics: CPU time over wall time (GIL waits count)
            return results, cpu / wall if wall > 0 else 1.0, wall
        return results, cpu / (cpu + waited) if cpu + waited > 0 else 1.0, wall

    async def _run(self) -> None:
        """One worker: wait for a slot under the limit, take a batch, run it, repeat."""
        assert self._slots is not None
        while True:
            async with self._slots:
                await self._slots.wait_for(lambda: self._active < self.limit)
                self._active += 1
            try:
                await self._one_batch()
            finally:
                async with self._slots:
                    self._active -= 1
                    self._slots.notify_all()

    async def _one_batch(self) -> None:
        loop = asyncio.get_running_loop()
        first = await self._next_item(None)
        batch, size = [first], len(first.queries)
        deadline = loop.time() + self._max_wait_s
        while size < self._max_batch:
            item = await self._next_item(deadline - loop.time())
            if item is None:
                break
            if size + len(item.queries) > self._max_batch:
                self._held.append(item)  # starts the next batch; never split an item
                break
            batch.append(item)
            size += len(item.queries)
        batch = [item for item in batch if not item.future.cancelled()]
        if not batch:
            return
        queries = [query for item in batch for query in item.queries]
        topks = [item.topk for item in batch for _ in item.queries]
        token = object()
        if self._running:  # this batch and every one running now overlap
            self._overlapped.update(self._running, (token,))
        else:
            self._busy_since = time.monotonic()
        self._running.add(token)
        try:
            results, share, wall = await loop.run_in_executor(self._executor, self._timed,
                                                              queries, topks)
        except Exception as exc:  # noqa: BLE001 (handed to every waiting request)
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        finally:
            self._running.discard(token)
            overlapped = token in self._overlapped
            self._overlapped.discard(token)
            if not self._running and self._busy_since is not None:
                self._busy_s += time.monotonic() - self._busy_since
                self._busy_since = None
        self._served += len(queries)
        self._adapt(share if overlapped else None)
        if self._on_batch is not None:
            self._on_batch(len(queries), wall)
        position = 0
        for item in batch:
            part = results[position : position + len(item.queries)]
            position += len(item.queries)
            if not item.future.done():
                item.future.set_result(part)

    def _serving_rate(self, now: float) -> tuple[float | None, float]:
        """(queries/s while a batch was running, over at least MIN_RATE_WINDOW_S; else None),
        and the busy seconds, for the window since the limit last changed."""
        busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        if busy < MIN_RATE_WINDOW_S:
            return None, busy
        return self._served / busy, busy

    def _close_window(self, served: float | None, now: float) -> None:
        """Record the current limit's serving rate (when measured long enough) and start a
        new measurement window."""
        if served is not None:
            self.rates[self.limit] = (served, now)
        self._served, self._busy_s = 0, 0.0
        self._busy_since = now if self._running else None

    def _adapt(self, cpu_share: float | None) -> None:
        now = time.monotonic()
        if cpu_share is not None:
            self._shares.append(cpu_share)
        served, busy = self._serving_rate(now)
        if served is not None and busy >= MAX_RATE_WINDOW_S:  # a new window, same limit
            self._close_window(served, now)
        below = self.rates.get(self.limit - 1)
        below_per_s = below[0] if below is not None and now - below[1] <= RATE_STALE_S else None
        limit = next_limit(self.limit, self._workers, self._shares, now - self._limit_changed,
                           served, below_per_s)
        if limit != self.limit:
            log.debug("micro-batches at once: %d -> %d (core shares of overlapping batches: %s;"
                      " served %s q/s, %s q/s at %d)", self.limit, limit,
                      " ".join(f"{x:.2f}" for x in self._shares),
                      "?" if served is None else f"{served:.0f}",
                      "?" if below_per_s is None else f"{below_per_s:.0f}", self.limit - 1)
            self._close_window(served, now)
            self.limit, self._limit_changed = limit, now
            self._shares.clear()
