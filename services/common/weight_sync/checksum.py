"""Where a fetch computes its checksum: on the receiving thread, or on a helper thread.

Both compute the same digest over the chunks in order; only the thread differs. On the 2-core
hosts measured a helper thread made fetches slower: the learner, gRPC's own threads and the
receive loop already fill both cores, and queued chunks stay alive longer. Where cores are to
spare, hashing beside the receive loop takes the checksum (~4 GB/s per core for CRC-32,
~1.7 for sha256) off its critical path; hashlib and zlib release the GIL on large buffers.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Protocol

from services.common.weight_sync import wire

# Fewer usable cores than this and the checksum stays on the receiving thread.
HELPER_THREAD_MIN_CPUS = 4


class ChunkChecksum(Protocol):
    def update(self, data: memoryview) -> None: ...

    def hexdigest(self) -> str: ...

    def close(self) -> None: ...


class InlineChecksum:
    """Hashes each chunk when `update` is called, on the caller's thread."""

    def __init__(self, algo: str) -> None:
        self._hash = wire.new_hasher(algo)
        self.update = self._hash.update

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def close(self) -> None:
        pass


class ThreadedChecksum:
    """Hashes chunks in order on a helper thread; `hexdigest()` waits for the backlog.

    The caller must not modify a chunk after `update` (received chunks are immutable bytes).
    """

    def __init__(self, algo: str, backlog: int = 8) -> None:
        self._hash = wire.new_hasher(algo)
        self._queue: queue.Queue[memoryview | None] = queue.Queue(maxsize=backlog)
        self._thread = threading.Thread(target=self._run, name="weight-sync-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._hash.update(item)

    def update(self, data: memoryview) -> None:
        self._queue.put(data)

    def hexdigest(self) -> str:
        self.close()
        return self._hash.hexdigest()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def chunk_checksum(algo: str, threaded: bool | None = None) -> ChunkChecksum:
    """A checksum over a fetch's chunks; `threaded=None` picks by the cores this process has."""
    if threaded is None:
        threaded = usable_cpus() >= HELPER_THREAD_MIN_CPUS
    return ThreadedChecksum(algo) if threaded else InlineChecksum(algo)
