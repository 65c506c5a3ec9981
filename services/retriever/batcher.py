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
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

BatchFn = Callable[[list[str], list[int]], list[Any]]


@dataclass
class _Item:
    queries: list[str]
    topk: int
    future: asyncio.Future = field(repr=False)


class MicroBatcher:
    def __init__(self, fn: BatchFn, max_batch: int = 64, max_wait_s: float = 0.005,
                 on_batch: Callable[[int, float], None] | None = None) -> None:
        self._fn = fn
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._on_batch = on_batch
        self._queue: asyncio.Queue[_Item] | None = None
        self._held: _Item | None = None
        self._task: asyncio.Task | None = None
        # One thread: the encoder and FAISS parallelise inside a call; two concurrent calls
        # would only fight for the same cores.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieve")

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, queries: list[str], topk: int) -> list[Any]:
        """Results for `queries` (one entry each), computed in shared batches of at most
        `max_batch` queries; a larger request is split into consecutive chunks."""
        if self._queue is None:
            raise RuntimeError("batcher not started")
        results: list[Any] = []
        for start in range(0, len(queries), self._max_batch):
            chunk = list(queries[start : start + self._max_batch])
            future = asyncio.get_running_loop().create_future()
            await self._queue.put(_Item(chunk, topk, future))
            results.extend(await future)
        return results

    async def _next_item(self, timeout: float | None) -> _Item | None:
        if self._held is not None:
            item, self._held = self._held, None
            return item
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

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._next_item(None)
            batch, size = [first], len(first.queries)
            deadline = loop.time() + self._max_wait_s
            while size < self._max_batch:
                item = await self._next_item(deadline - loop.time())
                if item is None:
                    break
                if size + len(item.queries) > self._max_batch:
                    self._held = item  # starts the next batch; never split an item
                    break
                batch.append(item)
                size += len(item.queries)
            batch = [item for item in batch if not item.future.cancelled()]
            if not batch:
                continue
            queries = [query for item in batch for query in item.queries]
            topks = [item.topk for item in batch for _ in item.queries]
            started = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._executor, self._fn, queries, topks)
            except Exception as exc:  # noqa: BLE001 (handed to every waiting request)
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)
                continue
            if self._on_batch is not None:
                self._on_batch(len(queries), time.perf_counter() - started)
            position = 0
            for item in batch:
                part = results[position : position + len(item.queries)]
                position += len(item.queries)
                if not item.future.done():
                    item.future.set_result(part)
