"""Learner side of weight sync: publish a versioned state dict, stream it to replicas.

`publish` copies the tensors once into a CPU snapshot (the learner keeps training on its own
copy) and computes the checksum there, so every fetch streams the same bytes without work.
The new snapshot is built aside while the old one keeps serving, and they swap only when the
new one is complete: a publish that fails (unsupported dtype, manifest too large, out of
memory) leaves the old version serving. Streams still reading a replaced version stop at their
next chunk with FAILED_PRECONDITION ("superseded"), so a client never receives a mix of
versions. The price is two copies in memory while a publish runs; `publish_lazy` keeps none.

Slow or stalled readers cannot starve the others: each Fetch holds one worker thread, so
fetches are capped (`max_fetches`, and `max_fetches_per_peer` per client address; more answer
RESOURCE_EXHAUSTED "busy", which the client retries) to leave threads for GetVersion, and a
watchdog cancels a stream whose next chunk has not been accepted for `stall_timeout_s` (a
client that stopped reading holds its thread only that long).

Tied weights are sent once: when `publish` is given two names for the same memory (a model with
`tie_word_embeddings` has `lm_head.weight` and `model.embed_tokens.weight` on one storage), the
first is copied, hashed and streamed, and the manifest lists the second as its alias
(`alias_of`, no bytes); the client hands back both names as one tensor. The checksum and
`total_bytes` cover the stream, i.e. what is actually sent.

`publish_lazy` keeps no copy at all: it takes a provider that yields (name, tensor) pairs again
for every fetch (a ZeRO-3 learner can gather bucket by bucket, a checkpoint can be read from
disk). The stream's checksum is computed while streaming and sent in the last chunk; when the
provider's bytes change between publish and fetch the client sees a checksum mismatch.

Relay fan-out (docs/weight_sync.md "Relays"): the manifest also carries each chunk's digest,
`Locate` tells a receiver where to fetch from (fanout.py: the learner, or a replica that holds
or is receiving the version), and a Fetch may resume at a chunk boundary (`offset`), so a
receiver whose source died goes on from another one. A replica's relay is this same server
serving a growing `RelayBuffer` (relay.py, `serve_buffer`) instead of a published snapshot.
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch
from prometheus_client import Counter, Gauge

from services.common.proto_gen.forage import weight_sync_pb2 as pb
from services.common.weight_sync import wire
from services.common.weight_sync.aliases import AliasFinder
from services.common.weight_sync.fanout import FanoutPlan
from services.common.weight_sync.relay import RelayBuffer, RelayUnavailable
from services.common.weight_sync.tls import ServerTls

log = logging.getLogger("forage.weight_sync")

PUBLISHED_VERSION = Gauge("forage_weight_sync_published_version", "policy version being served")
PUBLISHED_BYTES = Gauge("forage_weight_sync_published_bytes", "bytes in the served state dict")
BYTES_SENT = Counter("forage_weight_sync_bytes_sent_total", "tensor bytes streamed to replicas")
FETCHES = Counter("forage_weight_sync_fetches_total", "fetch streams by outcome", ["result"])
PUBLISH_FAILURES = Counter("forage_weight_sync_publish_failures_total",
                           "publishes that raised (the previous version kept serving)")
ACTIVE_FETCHES = Gauge("forage_weight_sync_active_fetches", "fetch streams in progress")

TensorSource = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
Provider = Callable[[], Iterable[tuple[str, torch.Tensor]]]


def _items(source: TensorSource) -> Iterable[tuple[str, torch.Tensor]]:
    return source.items() if isinstance(source, Mapping) else source


def _cpu_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """`tensor` on the CPU, contiguous (copied only when it is not), and its raw bytes."""
    cpu = tensor.detach().to("cpu").contiguous()
    return cpu, wire.as_bytes(cpu)


@dataclass
class _Snapshot:
    manifest: pb.Manifest
    manifest_bytes: bytes
    # eager: the serialized data chunks; lazy: None and a provider; relay: None and a buffer
    messages: list[bytes] | None
    provider: Provider | None = None
    relay: RelayBuffer | None = None
    retired: threading.Event = field(default_factory=threading.Event)

    @property
    def version(self) -> int:
        return self.manifest.version


class _Superseded(Exception):
    pass


@dataclass
class _Stream:
    """One Fetch in progress, as the watchdog sees it."""

    context: grpc.ServicerContext
    peer: str
    # monotonic time since which a chunk has waited for gRPC to accept it (the client's flow
    # control window is full); None while the server itself prepares the next chunk
    waiting_since: float | None = None
    cancelled: bool = False


def peer_host(peer: str) -> str:
    """The client address of a gRPC peer string without its port ("ipv4:10.0.0.3:51234" ->
    "ipv4:10.0.0.3", "ipv6:[::1]:5" -> "ipv6:[::1]"): what per-peer limits count by."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        return f"{kind}:{rest.rsplit(':', 1)[0]}"
    return peer


class WeightSyncServer:
    """gRPC `WeightSync` service; see the module docstring and docs/weight_sync.md."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        chunk_bytes: int = 4 << 20,
        max_workers: int = 16,
        checksum_algo: str = wire.DEFAULT_CHECKSUM,
        grpc_options: list[tuple[str, object]] | None = None,
        max_fetches: int | None = None,
        max_fetches_per_peer: int | None = None,
        stall_timeout_s: float = 20.0,
        relay: bool = True,
        relay_fanout: int = 1,
        coordinate: bool = True,
        pace: Callable[[int], None] | None = None,
        listen: bool = True,
        extra_ports: Sequence[str] = (),
        tls: ServerTls | None = None,
    ) -> None:
        """`relay`/`relay_fanout`: how `Locate` assigns sources (fanout.py; `relay=False`
        sends every receiver to this server, the direct pull). `coordinate=False` serves no
        `Locate` at all (a replica's relay). `pace(nbytes)` is called before each message is
        sent and may sleep (a rate cap; the fan-out bench emulates a NIC with it).
        `listen=False` binds no TCP port, only `extra_ports` (e.g. "unix:/tmp/x.sock").
        `tls`: serve TLS on the TCP port with this certificate (tls.py); `extra_ports`, Unix
        sockets that never leave the host, stay plain. The token is checked either way."""
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be positive")
        if max_workers < 2:
            raise ValueError("max_workers must be at least 2 (fetches leave one for GetVersion)")
        if stall_timeout_s <= 0:
            raise ValueError("stall_timeout_s must be positive")
        wire.new_hasher(checksum_algo)
        self.host = host
        self.chunk_bytes = chunk_bytes
        self.checksum_algo = checksum_algo
        self._token = token or None
        self.tls = tls
        # read and checked before anything binds: a bad file is one error naming its setting
        credentials = tls.credentials() if tls is not None else None
        # A chunk is its payload plus a few small fields; the manifest travels alone in the
        # first message and must fit the same limit (checked at publish).
        self.max_message_bytes = chunk_bytes + (1 << 20)
        self._lock = threading.Lock()
        # notified whenever what is served changes (a relay's child may wait for its version)
        self._changed = threading.Condition(self._lock)
        self._current: _Snapshot | None = None
        self._last_version = 0
        # Each Fetch holds a worker thread for its whole stream: cap them below max_workers so
        # GetVersion always finds a thread, and per client address so one host cannot take all.
        self.max_fetches = min(max_fetches or max(1, max_workers - 2), max_workers - 1)
        self.max_fetches_per_peer = max_fetches_per_peer or max(1, self.max_fetches // 2)
        self.stall_timeout_s = stall_timeout_s
        self.fanout = FanoutPlan(relay_fanout, enabled=relay)
        self._coordinate = coordinate
        self._pace = pace
        # Bytes of serialized chunks this server streamed (all fetches, this instance only).
        self.bytes_sent = 0
        self._sent_lock = threading.Lock()
        self._streams: dict[int, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None
        options = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", 1 << 20),
            ("grpc.so_reuseport", 0),
            *wire.TRANSPORT_OPTIONS,
            *(grpc_options or []),
        ]
        interceptors = [_TokenInterceptor(self._token)] if self._token else []
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="weight-sync"),
            options=options,
            interceptors=interceptors,
            maximum_concurrent_rpcs=max_workers * 4,
        )
        handlers = {
            "GetVersion": grpc.unary_unary_rpc_method_handler(
                self._get_version,
                request_deserializer=pb.GetVersionRequest.FromString,
                response_serializer=pb.VersionInfo.SerializeToString,
            ),
            # Chunks are already serialized by wire.encode_chunk: no serializer.
            "Fetch": grpc.unary_stream_rpc_method_handler(
                self._fetch, request_deserializer=pb.FetchRequest.FromString,
            ),
        }
        if coordinate:
            handlers["Locate"] = grpc.unary_unary_rpc_method_handler(
                self._locate, request_deserializer=pb.LocateRequest.FromString,
                response_serializer=pb.LocateReply.SerializeToString,
            )
        self._server.add_generic_rpc_handlers([
            grpc.method_handlers_generic_handler(wire.SERVICE, handlers)])
        self.port = 0
        if listen:
            bind = f"{host}:{port}"
            self.port = (self._server.add_secure_port(bind, credentials) if credentials
                         else self._server.add_insecure_port(bind))
            if self.port == 0:
                raise OSError(f"weight sync server cannot bind {host}:{port}")
        for extra in extra_ports:
            if self._server.add_insecure_port(extra) == 0:
                raise OSError(f"weight sync server cannot bind {extra}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def version(self) -> int:
        snapshot = self._current
        return snapshot.version if snapshot else 0

    def start(self) -> WeightSyncServer:
        self._server.start()
        self._watchdog = threading.Thread(target=self._watch, name="weight-sync-watchdog",
                                          daemon=True)
        self._watchdog.start()
        log.info("weight sync serving on %s (auth %s, tls %s)", self.address,
                 "on" if self._token else "off", "on" if self.tls else "off")
        return self

    def stop(self, grace_s: float | None = 1.0) -> None:
        self._stopping.set()
        self._retire()
        self._server.stop(grace_s).wait()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)

    def __enter__(self) -> WeightSyncServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- publishing -------------------------------------------------------------------------

    def publish(self, state_dict: TensorSource, version: int,
                metadata: Mapping[str, str] | None = None) -> pb.Manifest:
        """Serve a copy of `state_dict` (a mapping, or an iterable of (name, tensor)) as `version`.

        The copy is built while the previous version keeps serving and replaces it only when
        complete, so a publish that raises (bad dtype, manifest too large, out of memory)
        leaves the previous version serving; peak memory is two snapshots during the copy.
        An iterable lets a ZeRO-3 learner gather one parameter (or bucket) at a time. Names on
        the same memory (tied weights) are sent once, the later ones as aliases (module doc).
        `metadata` travels in the manifest (e.g. a LoRA adapter's kind, scaling and base).
        """
        return self._guarded(version, lambda: self._publish(state_dict, version, metadata))

    def _guarded(self, version: int, run: Callable[[], pb.Manifest]) -> pb.Manifest:
        self._check_version(version)
        try:
            return run()
        except Exception as exc:
            PUBLISH_FAILURES.inc()
            log.error("publishing weights v%d failed, v%d keeps serving: %s", version,
                      self.version, exc)
            raise

    def _publish(self, state_dict: TensorSource, version: int,
                 metadata: Mapping[str, str] | None = None) -> pb.Manifest:
        hasher = wire.new_hasher(self.checksum_algo)
        packer = wire.ChunkPacker(version, self.chunk_bytes, self.checksum_algo)
        specs: list[pb.TensorSpec] = []
        sent: dict[str, pb.TensorSpec] = {}
        aliases = AliasFinder()
        offset = 0
        for name, tensor in _items(state_dict):
            target = aliases.seen(name, tensor)
            if target is not None:  # tied: its bytes are already in the stream
                specs.append(wire.alias_spec(name, sent[target]))
                continue
            cpu, data = _cpu_bytes(tensor)
            spec = wire.spec_of(name, cpu, offset)
            hasher.update(data)
            packer.add(name, data)
            specs.append(spec)
            sent[name] = spec
            offset += spec.nbytes
        messages = packer.finish()
        manifest = self._manifest(version, specs, offset, hasher.hexdigest(), metadata,
                                  b"".join(packer.digests))
        self._install(_Snapshot(manifest, self._manifest_bytes(manifest), messages))
        return manifest

    def publish_lazy(
        self,
        provider: Provider,
        version: int,
        specs: Sequence[tuple[str, torch.dtype, Sequence[int]]] | None = None,
    ) -> pb.Manifest:
        """See `_publish_lazy`; a publish that raises leaves the previous version serving."""
        return self._guarded(version, lambda: self._publish_lazy(provider, version, specs))

    def _publish_lazy(
        self,
        provider: Provider,
        version: int,
        specs: Sequence[tuple[str, torch.dtype, Sequence[int]]] | None = None,
    ) -> pb.Manifest:
        """Serve `version` from `provider()`, called again for every fetch; no copy is kept.

        Without `specs` the provider is run once now to learn names, dtypes, shapes and the
        checksum; with `specs` (name, dtype, shape) nothing is read now and the manifest
        carries no checksum (the last chunk's is authoritative).
        """
        layout: list[pb.TensorSpec] = []
        offset = 0
        checksum = ""
        digests: list[bytes] = []
        if specs is None:
            hasher = wire.new_hasher(self.checksum_algo)
            tensors: list[tuple[pb.TensorSpec, memoryview]] = []

            def walk() -> Iterator[tuple[pb.TensorSpec, memoryview]]:
                nonlocal offset
                for name, tensor in provider():
                    cpu, data = _cpu_bytes(tensor)
                    spec = wire.spec_of(name, cpu, offset)
                    layout.append(spec)
                    offset += len(data)
                    tensors.append((spec, data))  # alive until its chunk is hashed
                    yield spec, data

            for _, pieces, _, _ in wire.iter_stream_pieces(walk(), self.chunk_bytes):
                for piece in pieces:
                    hasher.update(piece)
                digests.append(wire.chunk_digest(self.checksum_algo, pieces))
                tensors.clear()
            checksum = hasher.hexdigest()
        else:
            for name, dtype, shape in specs:
                dims = [int(d) for d in shape]
                nbytes = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
                layout.append(pb.TensorSpec(name=name, dtype=wire.dtype_name(dtype), shape=dims,
                                            nbytes=nbytes, offset=offset))
                offset += nbytes
        manifest = self._manifest(version, layout, offset, checksum, None, b"".join(digests))
        self._install(_Snapshot(manifest, self._manifest_bytes(manifest), None, provider))
        return manifest

    def _check_version(self, version: int) -> None:
        if version < 1:
            raise ValueError("versions start at 1 (0 means nothing published)")
        if version <= self._last_version:
            raise ValueError(f"version {version} is not newer than {self._last_version}")

    def _manifest(
        self, version: int, specs: list[pb.TensorSpec], total: int, checksum: str,
        metadata: Mapping[str, str] | None = None, chunk_digests: bytes = b"",
    ) -> pb.Manifest:
        bad = [k for k, v in (metadata or {}).items()
               if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ValueError(f"manifest metadata must map strings to strings: {bad[:3]}")
        return pb.Manifest(
            version=version, tensors=specs, total_bytes=total, checksum=checksum,
            checksum_algo=self.checksum_algo, chunk_bytes=self.chunk_bytes,
            metadata=dict(metadata or {}), chunk_digests=chunk_digests,
        )

    def _manifest_bytes(self, manifest: pb.Manifest) -> bytes:
        encoded = wire.encode_chunk(version=manifest.version,
                                    manifest=manifest.SerializeToString())
        if len(encoded) > self.max_message_bytes:
            raise ValueError(
                f"manifest of {len(encoded)} bytes exceeds the message limit "
                f"{self.max_message_bytes}; raise chunk_bytes"
            )
        return encoded

    def _retire(self) -> None:
        with self._lock:
            old, self._current = self._current, None
        if old is not None:
            old.retired.set()

    def serve_buffer(self, buffer: RelayBuffer | None) -> None:
        """Serve a relay's growing buffer (relay.py) instead of a published version; None stops
        serving. Unlike `publish`, the same version may be installed again (a relay whose
        transfer failed starts over)."""
        if buffer is None:
            self._retire()
            return
        manifest = buffer.manifest
        snapshot = _Snapshot(manifest, self._manifest_bytes(manifest), None, relay=buffer)
        with self._lock:
            old, self._current = self._current, snapshot
            self._changed.notify_all()
        if old is not None:
            old.retired.set()

    def _install(self, snapshot: _Snapshot) -> None:
        """Swap the complete new snapshot in; streams of the old one stop as superseded."""
        with self._lock:
            old, self._current = self._current, snapshot
            self._last_version = snapshot.version
            self._changed.notify_all()
        if old is not None:
            old.retired.set()
        PUBLISHED_VERSION.set(snapshot.version)
        PUBLISHED_BYTES.set(snapshot.manifest.total_bytes)
        log.info("published weights v%d: %d tensors, %d bytes", snapshot.version,
                 len(snapshot.manifest.tensors), snapshot.manifest.total_bytes)

    # --- RPCs -----------------------------------------------------------------------------

    def _get_version(self, request: pb.GetVersionRequest, context: grpc.ServicerContext):
        snapshot = self._current
        if snapshot is None:
            return pb.VersionInfo(version=0)
        return pb.VersionInfo(version=snapshot.version, manifest=snapshot.manifest)

    def _locate(self, request: pb.LocateRequest, context: grpc.ServicerContext):
        """Where the caller should fetch the current version (fanout.py)."""
        snapshot = self._current
        if snapshot is None:
            return pb.LocateReply(version=0)
        source = self.fanout.locate(snapshot.version, request.client_id, request.relay_address,
                                    request.failed, request.done)
        if request.done:
            return pb.LocateReply(version=snapshot.version)
        return pb.LocateReply(version=snapshot.version, source=source,
                              manifest=snapshot.manifest)

    def _fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        stream = self._admit(context)
        try:
            yield from self._serve(request, context, stream)
        finally:
            self._leave(stream)

    def _await_version(self, version: int, context: grpc.ServicerContext) -> _Snapshot | None:
        """A relay asked for a version it has not begun to receive: the learner assigns a
        child as soon as its parent asked where to fetch, which may be a moment before the
        parent's first chunk arrived. Wait up to `stall_timeout_s` for it to begin."""
        deadline = time.monotonic() + self.stall_timeout_s
        with self._changed:
            while (self._current is None or self._current.version < version) \
                    and not self._stopping.is_set() and context.is_active():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 0.2))
            return self._current

    def _serve(self, request: pb.FetchRequest, context: grpc.ServicerContext,
               stream: _Stream) -> Iterator[bytes]:
        snapshot = self._current
        if not self._coordinate and request.version and (
                snapshot is None or snapshot.version < request.version):
            snapshot = self._await_version(request.version, context)
        if snapshot is None:
            FETCHES.labels("not_published").inc()
            if not self._coordinate:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              "not_held: this relay holds no version")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not_published: no weights served")
        if request.version and request.version != snapshot.version:
            FETCHES.labels("superseded").inc()
            if snapshot.relay is not None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"not_held: this relay holds version {snapshot.version}, not "
                              f"{request.version}")
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"superseded: version {request.version} is not served; current is "
                f"{snapshot.version}",
            )
        chunk_bytes = snapshot.manifest.chunk_bytes or 1
        if request.offset % chunk_bytes or request.offset > snapshot.manifest.total_bytes:
            FETCHES.labels("error").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"manifest: offset {request.offset} is not a chunk boundary of the "
                          f"{snapshot.manifest.total_bytes}-byte stream")
        if snapshot.relay is not None:
            snapshot.relay.reading(+1)
        try:
            for message in self._encode_chunks(snapshot, request.offset // chunk_bytes,
                                               context):
                if self._pace is not None:
                    self._pace(len(message))
                stream.waiting_since = time.monotonic()
                yield message  # returns once gRPC accepted it (the client's window had room)
                stream.waiting_since = None
                with self._sent_lock:
                    self.bytes_sent += len(message)
        except _Superseded:
            FETCHES.labels("superseded").inc()
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"superseded: version {snapshot.version} was replaced during the transfer",
            )
        except RelayUnavailable as exc:  # this relay's own transfer failed or stalled
            FETCHES.labels("error").inc()
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ValueError as exc:  # a lazy provider (or relay copy) that no longer matches
            FETCHES.labels("error").inc()
            log.error("weights v%d: %s", snapshot.version, exc)
            context.abort(grpc.StatusCode.DATA_LOSS, f"corrupt: {exc}")
        finally:
            if snapshot.relay is not None:
                snapshot.relay.reading(-1)
        FETCHES.labels("ok").inc()

    # --- slow readers ---------------------------------------------------------------------

    def _admit(self, context: grpc.ServicerContext) -> _Stream:
        """Register a Fetch, or answer RESOURCE_EXHAUSTED "busy" when the caps are reached."""
        stream = _Stream(context, peer_host(context.peer() or "unknown"))
        with self._streams_lock:
            total = len(self._streams)
            same = sum(1 for s in self._streams.values() if s.peer == stream.peer)
            busy = None
            if total >= self.max_fetches:
                busy = f"busy: {total} fetches in progress (max_fetches={self.max_fetches})"
            elif same >= self.max_fetches_per_peer:
                busy = (f"busy: {same} fetches from {stream.peer} in progress "
                        f"(max_fetches_per_peer={self.max_fetches_per_peer})")
            if busy is None:
                self._streams[id(stream)] = stream
                ACTIVE_FETCHES.set(len(self._streams))
        if busy is not None:
            FETCHES.labels("busy").inc()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{busy}; retry later")
        return stream

    def _leave(self, stream: _Stream) -> None:
        with self._streams_lock:
            self._streams.pop(id(stream), None)
            ACTIVE_FETCHES.set(len(self._streams))

    def _watch(self) -> None:
        """Cancel streams whose client stopped reading: a chunk not accepted within
        `stall_timeout_s` (gRPC blocks the handler's thread while the window is full)."""
        interval = min(1.0, self.stall_timeout_s / 4)
        while not self._stopping.wait(interval):
            now = time.monotonic()
            with self._streams_lock:
                stalled = [s for s in self._streams.values() if not s.cancelled
                           and s.waiting_since is not None
                           and now - s.waiting_since > self.stall_timeout_s]
                for stream in stalled:
                    stream.cancelled = True
            for stream in stalled:
                FETCHES.labels("stalled").inc()
                log.warning("cancelling a weight fetch from %s: its client accepted no data for "
                            "%.0fs (stall_timeout_s)", stream.peer, self.stall_timeout_s)
                stream.context.cancel()

    def _encode_chunks(self, snapshot: _Snapshot, start: int = 0,
                       context: grpc.ServicerContext | None = None) -> Iterator[bytes]:
        """The serialized chunks of one fetch: manifest, data chunks from chunk `start` on
        (a resumed fetch), then the checksum."""
        yield snapshot.manifest_bytes
        version = snapshot.version
        if snapshot.relay is not None:
            buffer = snapshot.relay

            def stop() -> bool:
                return snapshot.retired.is_set() or (context is not None
                                                     and not context.is_active())

            for index in range(start, buffer.chunks):
                message = buffer.message(index, stop, self.stall_timeout_s)
                if message is None:
                    raise _Superseded
                BYTES_SENT.inc(len(message))
                yield message
            checksum = buffer.final_checksum(stop, self.stall_timeout_s)
            if checksum is None:
                raise _Superseded
        elif snapshot.messages is not None:
            checksum = snapshot.manifest.checksum
            for message in snapshot.messages[start:]:
                if snapshot.retired.is_set():
                    raise _Superseded
                BYTES_SENT.inc(len(message))
                yield message
        else:
            hasher = wire.new_hasher(snapshot.manifest.checksum_algo)
            tensors = self._lazy_tensors(snapshot)
            for index, (offset, pieces, name, inner) in enumerate(
                    wire.iter_stream_pieces(tensors, self.chunk_bytes)):
                if snapshot.retired.is_set():
                    raise _Superseded
                for piece in pieces:  # the whole stream is hashed, also what a resume skips
                    hasher.update(piece)
                if index < start:
                    continue
                message = wire.encode_chunk(version=version, offset=offset, pieces=pieces,
                                            name=name, tensor_offset=inner)
                BYTES_SENT.inc(len(message))
                yield message
            checksum = hasher.hexdigest()
        if snapshot.retired.is_set():
            raise _Superseded
        yield wire.encode_chunk(version=version, offset=snapshot.manifest.total_bytes,
                                checksum=checksum, last=True)

    def _lazy_tensors(self, snapshot: _Snapshot) -> Iterator[tuple[pb.TensorSpec, memoryview]]:
        specs = list(snapshot.manifest.tensors)
        count = 0
        for name, tensor in snapshot.provider():
            if count >= len(specs):
                raise ValueError(f"provider yielded more than the manifest's {len(specs)} tensors")
            spec = specs[count]
            cpu, data = _cpu_bytes(tensor)
            if (name != spec.name or wire.dtype_name(cpu.dtype) != spec.dtype
                    or list(cpu.shape) != list(spec.shape)):
                raise ValueError(f"provider yielded {name!r} {cpu.dtype}{list(cpu.shape)} where "
                                 f"the manifest has {spec.name!r} {spec.dtype}{list(spec.shape)}")
            count += 1
            yield spec, data
        if count != len(specs):
            raise ValueError(f"provider yielded {count} tensors, manifest has {len(specs)}")


class _TokenInterceptor(grpc.ServerInterceptor):
    """Reject calls whose `authorization: Bearer <token>` metadata does not match."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == wire.AUTH_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._expected):
                    return handler
        if handler is None:
            return None

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "auth: missing or wrong token")

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)
