"""A pool of reward worker processes with a wall-clock limit per item.

Why not concurrent.futures / multiprocessing.Pool: neither can kill one hung task. math_verify's
own limits use SIGALRM, which cannot interrupt long C-level sympy/bignum work, so a bad item can
hold a worker forever. Here each worker gets a chunk of jobs and streams one result per job
back; when a worker makes no progress for `timeout_s`, the job it is on is scored as a timeout,
the worker is SIGKILLed and replaced, and the rest of its chunk goes back in the queue.

Jobs and results cross the pipe as msgpack bytes (never pickle): a job is a reward reference
(`module:function`), positional args and keyword options; a result is the function's return
value (number, None, or a map of numbers) or a status.
"""

from __future__ import annotations

import atexit
import collections
import importlib
import logging
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import msgpack

from services.scorer import metrics

log = logging.getLogger("forage.scorer.pool")

STATUS_OK = "ok"
STATUS_TIMEOUT = "timeout"
STATUS_ERROR = "error"


@dataclass(frozen=True)
class Job:
    ref: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] | None = None


@dataclass
class JobResult:
    status: str
    value: Any = None
    error: str | None = None


class PoolError(RuntimeError):
    """The pool cannot run (a worker failed to start)."""


# ---------------------------------------------------------------- worker process


def _resolve(ref: str, cache: dict[str, Any]) -> Any:
    if ref not in cache:  # the scorer's own rule: module:function or path/to/file.py:function
        from services.scorer.rewards.registry import load_ref

        cache[ref] = load_ref(ref)
    return cache[ref]


def _worker_main(conn: Connection, preload: list[str]) -> None:
    """Runs in the child: import what will be needed, say ready, then serve chunks."""
    from services.scorer.rewards.math import RewardTimeout

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cache: dict[str, Any] = {}
    for module in preload:
        importlib.import_module(module)
        warm = getattr(importlib.import_module(module), "warm_up", None)
        if callable(warm):
            warm()
    conn.send_bytes(msgpack.packb({"ready": os.getpid()}))
    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            return
        chunk = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        if chunk is None:
            return
        for index, ref, args, kwargs in chunk:
            try:
                value = _resolve(ref, cache)(*args, **(kwargs or {}))
                reply = {"i": index, "s": STATUS_OK, "v": _plain(value)}
            except RewardTimeout as exc:
                reply = {"i": index, "s": STATUS_TIMEOUT, "e": str(exc)}
            except Exception as exc:  # any bug in a reward function: reported, not fatal
                reply = {"i": index, "s": STATUS_ERROR, "e": f"{type(exc).__name__}: {exc}"}
            try:
                packed = msgpack.packb(reply, use_bin_type=True)
            except (TypeError, ValueError) as exc:
                packed = msgpack.packb({"i": index, "s": STATUS_ERROR,
                                        "e": f"unserialisable result: {exc}"})
            conn.send_bytes(packed)


def _plain(value: Any) -> Any:
    """Numbers from numpy/torch scalars become Python floats so msgpack can carry them."""
    if hasattr(value, "item") and not isinstance(value, dict):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------- parent side


def _unpackable(job: Job) -> str | None:
    """Why a job cannot cross the pipe (an integer of 2^64 or more, a lone surrogate, an
    object msgpack does not know), or None."""
    try:
        msgpack.packb([0, job.ref, list(job.args), job.kwargs or {}], use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        return f"cannot send the item to a reward worker: {type(exc).__name__}: {exc}"
    return None


class _Worker:
    def __init__(self, ctx: Any, preload: list[str]) -> None:
        parent, child = ctx.Pipe(duplex=True)
        self.conn: Connection = parent
        self.process = ctx.Process(target=_worker_main, args=(child, preload), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.started_at = time.monotonic()
        self.inflight: collections.deque[int] = collections.deque()
        self.last_progress = 0.0

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def start_failure(exitcode: int | None, exc: BaseException, method: str) -> str:
    """Why a worker died before it was ready, and what to do about the usual cause.

    Workers start with 'spawn' (no fork of a process that holds threads and sockets), and a
    spawned worker first imports the caller's main script, as multiprocessing always does. A
    script that starts scoring at import time, without an `if __name__ == "__main__":` guard,
    then runs again inside the worker, which fails while starting its own workers."""
    detail = f": {exc}" if str(exc) else ""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    text = f"reward worker died at start (exit code {exitcode}{detail})"
    if method != "fork" and script:
        text += (f". Reward workers start with {method!r}, which imports your main script "
                 f"({script}) in each worker: put the code that scores under "
                 "`if __name__ == \"__main__\":` so the workers do not run it again")
    return text


class RewardPool:
    """`run(jobs)` returns one JobResult per job, in order. Thread-safe (one batch at a time)."""

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        start_method: str = "spawn",
        preload: tuple[str, ...] = ("services.scorer.rewards.math",),
        max_chunk: int = 32,
        start_timeout_s: float = 120.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.max_chunk = max_chunk
        self.start_timeout_s = start_timeout_s
        self._ctx = multiprocessing.get_context(start_method)
        self._preload = list(preload)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self.restarts = 0
        self.timeouts = 0

    # lifecycle -----------------------------------------------------------

    def start(self, wait_ready: bool = True) -> RewardPool:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self._preload))
        if wait_ready:
            deadline = time.monotonic() + self.start_timeout_s
            for worker in self._workers:
                while not worker.ready:
                    if not self._await_ready(worker, deadline - time.monotonic()):
                        raise PoolError("a reward worker did not start in time")
        return self

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.conn.send_bytes(msgpack.packb(None))
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            worker.process.join(timeout=2)
            worker.kill()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    def _await_ready(self, worker: _Worker, timeout: float) -> bool:
        if not worker.conn.poll(max(0.0, timeout)):
            if not worker.process.is_alive():
                raise PoolError(f"reward worker exited with {worker.process.exitcode} at start")
            return False
        try:
            message = msgpack.unpackb(worker.conn.recv_bytes(), raw=False)
        except (EOFError, OSError) as exc:
            worker.process.join(timeout=5)
            raise PoolError(start_failure(worker.process.exitcode, exc,
                                          self._ctx.get_start_method())) from None
        worker.ready = isinstance(message, dict) and "ready" in message
        return worker.ready

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        self.restarts += 1
        metrics.WORKER_RESTARTS.inc()
        fresh = _Worker(self._ctx, self._preload)
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    # work ------------------------------------------------------------------

    def run(self, jobs: list[Job]) -> list[JobResult]:
        if not jobs:
            return []
        with self._lock:
            if not self._workers:
                self.start()
            try:
                return self._run(jobs)
            except BaseException:
                # Whatever failed, no worker may keep jobs of this run: their late results
                # would be read as the next run's. Busy workers are replaced.
                for worker in list(self._workers):
                    if worker.inflight:
                        worker.inflight.clear()
                        self._replace(worker)
                raise

    def _run(self, jobs: list[Job]) -> list[JobResult]:
        results: list[JobResult | None] = [None] * len(jobs)
        pending: collections.deque[int] = collections.deque()
        for index, job in enumerate(jobs):
            problem = _unpackable(job)
            if problem is None:
                pending.append(index)
            else:  # rejected alone, before any worker holds it
                results[index] = JobResult(STATUS_ERROR, error=problem)
        remaining = len(pending)
        while remaining:
            now = time.monotonic()
            for worker in list(self._workers):
                if not worker.ready:
                    # A replacement's "ready" may have waited in the pipe since an earlier run.
                    try:
                        ready = self._await_ready(worker, 0.0)
                    except PoolError:
                        self._replace(worker)
                        continue
                    if not ready:
                        if now - worker.started_at > self.start_timeout_s:
                            raise PoolError("a replacement reward worker did not start in time")
                        continue
                if not worker.inflight and pending:
                    self._send_chunk(worker, jobs, pending)
            waiting = {w.conn: w for w in self._workers if w.inflight or not w.ready}
            deadlines = [w.last_progress + self.timeout_s for w in self._workers if w.inflight]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.5
            for conn in wait(list(waiting), timeout=timeout):
                worker = waiting[conn]
                if not worker.ready:
                    try:
                        self._await_ready(worker, 0.01)
                    except PoolError:
                        self._replace(worker)
                    continue
                remaining -= self._drain(worker, results, pending)
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.inflight and now - worker.last_progress > self.timeout_s:
                    index = worker.inflight.popleft()
                    results[index] = JobResult(
                        STATUS_TIMEOUT, error=f"no result within {self.timeout_s:g}s; worker killed"
                    )
                    remaining -= 1
                    self.timeouts += 1
                    log.warning("reward job %s (%s) hung for %.1fs: killing worker pid %s",
                                index, jobs[index].ref, self.timeout_s, worker.process.pid)
                    pending.extendleft(reversed(worker.inflight))
                    worker.inflight.clear()
                    self._replace(worker)
        return [r for r in results if r is not None]

    def _send_chunk(self, worker: _Worker, jobs: list[Job], pending: collections.deque) -> None:
        size = max(1, min(self.max_chunk, -(-len(pending) // (2 * self.num_workers))))
        chunk = []
        for _ in range(min(size, len(pending))):
            index = pending.popleft()
            job = jobs[index]
            chunk.append([index, job.ref, list(job.args), job.kwargs or {}])
            worker.inflight.append(index)
        worker.last_progress = time.monotonic()
        worker.conn.send_bytes(msgpack.packb(chunk, use_bin_type=True))

    def _drain(self, worker: _Worker, results: list, pending: collections.deque) -> int:
        """Read every result the worker has ready; returns how many jobs finished."""
        done = 0
        while worker.inflight:
            try:
                if not worker.conn.poll():
                    break
                reply = msgpack.unpackb(worker.conn.recv_bytes(), raw=False)
            except (EOFError, OSError):
                # The worker died (OOM killer, segfault): its current job fails, the rest retry.
                index = worker.inflight.popleft()
                results[index] = JobResult(STATUS_ERROR, error="reward worker process died")
                done += 1
                pending.extendleft(reversed(worker.inflight))
                worker.inflight.clear()
                self._replace(worker)
                return done
            index = reply["i"]
            if not worker.inflight or worker.inflight[0] != index:
                raise PoolError(f"reward worker answered job {index} out of order")
            worker.inflight.popleft()
            results[index] = JobResult(reply["s"], reply.get("v"), reply.get("e"))
            if reply["s"] == STATUS_TIMEOUT:
                self.timeouts += 1
            worker.last_progress = time.monotonic()
            done += 1
        return done


# ---------------------------------------------------------------- shared pool

_shared: RewardPool | None = None
_shared_lock = threading.Lock()


class RewardFailed(RuntimeError):
    """A reward function raised in a pool worker; the message names it and the error."""


def shared_pool(num_workers: int = 2, timeout_s: float = 5.0) -> RewardPool:
    """The process's pool for isolated rewards (math_verify) called off the main thread:
    `compute_score` from a verl-style threaded or asyncio reward manager, `Scorer` without its
    own pool. Started on first use (the arguments count then only), closed at exit."""
    global _shared
    with _shared_lock:
        if _shared is None:
            pool = RewardPool(num_workers=num_workers, timeout_s=timeout_s).start()
            atexit.register(pool.close)
            _shared = pool
        return _shared


def on_main_thread() -> bool:
    """math_verify's SIGALRM limits work only here; elsewhere isolated rewards use a pool."""
    return threading.current_thread() is threading.main_thread()
