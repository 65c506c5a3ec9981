"""A replica's relay: serve the version it is receiving to other receivers, chunk by chunk.

The client fetches into one staging buffer (client.py); with a relay, that buffer is also what
this process serves. `WeightRelay.begin` installs a `RelayBuffer` for the version as soon as
its manifest arrived, the client `advance`s it after each chunk it verified against the
learner's per-chunk digest (so only verified bytes are ever served), `complete`s it once the
whole stream's checksum matched, or `fail`s it. A child's Fetch streams chunk k as soon as it is
in (a growing buffer), waits for the next, and gets the final chunk, with the learner's
checksum, only after this relay verified the whole stream itself.

Why serve from the staging buffer rather than keep the received messages: the messages would
be a second copy of the model in host memory for the whole transfer; re-encoding a chunk from
staging costs one memory copy per child, cheap next to gRPC's own per-message work. Before a
chunk is sent its digest is checked again, so a staging buffer that changed after it was
verified (a consumer that wrote into the tensors it was given) is refused (DATA_LOSS) instead
of forwarded.

Memory: the buffer lives while the relay serves it, i.e. until the next version begins or
`hold_s` after it completed with no child reading (then it is released and children asking
for it get `not_held`, so the learner sends them elsewhere).
"""

from __future__ import annotations

import bisect
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from services.common.proto_gen.forage import weight_sync_pb2 as pb
from services.common.weight_sync import wire
from services.common.weight_sync.tls import ServerTls
from services.common.weight_sync.wire import WeightSyncError

log = logging.getLogger("forage.weight_sync")

Region = tuple[wire.TensorLayout, np.ndarray]


class RelayUnavailable(Exception):
    """The relay cannot go on serving this stream (its own transfer failed or stalled)."""


class RelayBuffer:
    """One version's bytes as this process receives them, served to children as they arrive.

    `regions` are (tensor layout, its uint8 region of the staging buffer) for every tensor
    with bytes, in stream order (client._staging's targets).
    """

    def __init__(self, manifest: pb.Manifest, regions: Sequence[Region]) -> None:
        self.manifest = manifest
        self.version = manifest.version
        self.total = manifest.total_bytes
        self.chunk_bytes = manifest.chunk_bytes or max(1, self.total)
        self.chunks = wire.chunk_count(self.total, self.chunk_bytes)
        self._regions = list(regions)
        self._starts = [spec.offset for spec, _ in self._regions]
        self._cond = threading.Condition()
        self.available = 0  # bytes received and verified, from the stream's start
        self.checksum: str | None = None  # the whole stream's, once verified
        self.failure: str | None = None
        self.progress_at = time.monotonic()
        self.completed_at: float | None = None
        self.readers = 0  # child streams now reading (server.py counts them)
        self.last_read = time.monotonic()

    # --- the receiving side (client.py) ------------------------------------------------------

    def advance(self, available: int) -> None:
        with self._cond:
            self.available = available
            self.progress_at = time.monotonic()
            self._cond.notify_all()

    def complete(self, checksum: str) -> None:
        with self._cond:
            self.available = self.total
            self.checksum = checksum
            self.completed_at = self.progress_at = time.monotonic()
            self._cond.notify_all()

    def fail(self, reason: str) -> None:
        with self._cond:
            if self.checksum is None:
                self.failure = reason
            self._cond.notify_all()

    # --- the serving side (server.py) --------------------------------------------------------

    def reading(self, delta: int) -> None:
        """A child stream started (+1) or ended (-1): `hold_s` counts from the last reader."""
        with self._cond:
            self.readers += delta
            self.last_read = time.monotonic()

    def _wait(self, ready: Callable[[], bool], stop: Callable[[], bool], stall_s: float) -> bool:
        """Wait until `ready()`; False when `stop()` turned true first. Raises RelayUnavailable
        when this relay's own transfer failed or made no progress for `stall_s`."""
        with self._cond:
            while not ready():
                if self.failure is not None:
                    raise RelayUnavailable(f"relay_failed: this relay's transfer of "
                                           f"v{self.version} failed ({self.failure})")
                if stop():
                    return False
                idle = time.monotonic() - self.progress_at
                if idle > stall_s:
                    raise RelayUnavailable(f"relay_stalled: this relay received nothing of "
                                           f"v{self.version} for {idle:.0f}s")
                self._cond.wait(timeout=0.2)
        return True

    def message(self, index: int, stop: Callable[[], bool], stall_s: float) -> bytes | None:
        """Data chunk `index` as a serialized `Chunk`, once this relay has it (None: stopped)."""
        offset = index * self.chunk_bytes
        end = min(offset + self.chunk_bytes, self.total)
        if not self._wait(lambda: self.available >= end, stop, stall_s):
            return None
        pieces, name, inner = self._pieces(offset, end)
        expected = wire.expected_digest(self.manifest, index)
        if expected is not None and wire.chunk_digest(self.manifest.checksum_algo,
                                                      pieces) != expected:
            raise ValueError(f"chunk {index} of v{self.version} changed in this relay's "
                             "memory after it was verified")
        return wire.encode_chunk(version=self.version, offset=offset, pieces=pieces, name=name,
                                 tensor_offset=inner)

    def final_checksum(self, stop: Callable[[], bool], stall_s: float) -> str | None:
        """The whole stream's checksum once this relay verified it (None: stopped)."""
        if not self._wait(lambda: self.checksum is not None, stop, stall_s):
            return None
        return self.checksum

    def _pieces(self, offset: int, end: int) -> tuple[list[memoryview], str, int]:
        """The staging memory of stream bytes [offset, end), tensor by tensor."""
        index = bisect.bisect_right(self._starts, offset) - 1
        first, _ = self._regions[index]
        pieces: list[memoryview] = []
        cursor = offset
        while cursor < end:
            spec, region = self._regions[index]
            inner = cursor - spec.offset
            take = min(end - cursor, spec.nbytes - inner)
            pieces.append(memoryview(region[inner:inner + take]))
            cursor += take
            index += 1
        return pieces, first.name, offset - first.offset


class WeightRelay:
    """A replica's relay server: `WeightSync` Fetch/GetVersion for the version it holds.

    Listens on `host:port` (TCP, what other replicas dial: `address`, advertised as
    `advertise_host:port`) and, with `local`, also on a Unix socket path, which the other
    tensor-parallel ranks of the same replica read from. Same bearer token as the learner.
    With `tls` (tls.ServerTls) the TCP port serves TLS with that certificate, which must name
    the advertised host (or the name clients check instead: `relay_tls_name`); the Unix socket
    stays plain.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 advertise_host: str = "", local: str | None = None, hold_s: float = 300.0,
                 max_fetches: int = 16, stall_timeout_s: float = 20.0,
                 pace: Callable[[int], None] | None = None, listen_tcp: bool = True,
                 tls: ServerTls | None = None) -> None:
        from services.common.weight_sync.server import WeightSyncServer

        # before anything is bound: a host that cannot be worked out fails cleanly
        advertised = (advertise_host or _advertised_host(host)) if listen_tcp else ""
        self.hold_s = hold_s
        # chunk_bytes only sizes the message limit here: a relay forwards the learner's chunks,
        # whatever their size (up to the client's default max_message_bytes).
        self.server = WeightSyncServer(
            host=host, port=port, token=token, chunk_bytes=255 << 20,
            max_workers=max_fetches + 2,
            max_fetches=max_fetches, max_fetches_per_peer=max_fetches,
            stall_timeout_s=stall_timeout_s, coordinate=False, pace=pace,
            listen=listen_tcp, extra_ports=[local] if local else [], tls=tls,
        )
        self.local = local
        self.address = f"{advertised}:{self.server.port}" if listen_tcp else ""
        self._buffer: RelayBuffer | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._janitor: threading.Thread | None = None

    def start(self) -> WeightRelay:
        self.server.start()
        self._janitor = threading.Thread(target=self._release_idle, name="weight-relay-hold",
                                         daemon=True)
        self._janitor.start()
        log.info("weight relay serving on %s%s", self.address or "-",
                 f" and {self.local}" if self.local else "")
        return self

    def stop(self) -> None:
        self._stopping.set()
        self.server.stop(0)
        if self._janitor is not None:
            self._janitor.join(timeout=5)

    def __enter__(self) -> WeightRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def version(self) -> int:
        buffer = self._buffer
        return buffer.version if buffer is not None else 0

    def begin(self, manifest: pb.Manifest, regions: Sequence[Region]) -> RelayBuffer:
        """Serve `manifest`'s version from `regions` as they fill; replaces what was served."""
        buffer = RelayBuffer(manifest, regions)
        with self._lock:
            old, self._buffer = self._buffer, buffer
        if old is not None:
            old.fail("replaced by a newer transfer")
        self.server.serve_buffer(buffer)
        return buffer

    def release(self) -> None:
        """Stop serving (frees the staging buffer once the caller dropped its tensors)."""
        with self._lock:
            old, self._buffer = self._buffer, None
        if old is not None:
            old.fail("released")
            self.server.serve_buffer(None)

    def _release_idle(self) -> None:
        while not self._stopping.wait(1.0):
            buffer = self._buffer
            if (buffer is not None and buffer.completed_at is not None
                    and buffer.readers == 0
                    and time.monotonic() - max(buffer.completed_at, buffer.last_read)
                    > self.hold_s):
                with self._lock:
                    if self._buffer is not buffer:
                        continue
                    self._buffer = None
                self.server.serve_buffer(None)
                log.info("weight relay released v%d after %.0fs without readers",
                         buffer.version, self.hold_s)


def _advertised_host(host: str) -> str:
    """What other hosts dial to reach a relay bound to `host`: the host itself, unless it is a
    wildcard, then this machine's name resolved (a pod's IP in Kubernetes, a container's in
    Compose)."""
    if host not in ("", "0.0.0.0", "::", "[::]"):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        raise WeightSyncError("unavailable", f"cannot work out this host's address for the "
                              f"weight relay ({exc}); set rollout.weight_relay_advertise") from exc
