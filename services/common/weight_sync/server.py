"""Learner side of weight sync: publish a versioned state dict, stream it to replicas.

`publish` copies the tensors once into a CPU snapshot (the learner keeps training on its own
copy) and computes the checksum there, so every fetch streams the same bytes without work.
Only one snapshot is kept: publishing a new version first retires the old one, and streams
still reading it stop at their next chunk with FAILED_PRECONDITION ("superseded"), so the
server never holds two copies for long and a client never receives a mix of versions.

`publish_lazy` keeps no copy at all: it takes a provider that yields (name, tensor) pairs again
for every fetch (a ZeRO-3 learner can gather bucket by bucket, a checkpoint can be read from
disk). The stream's checksum is computed while streaming and sent in the last chunk; when the
provider's bytes change between publish and fetch the client sees a checksum mismatch.
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch
from prometheus_client import Counter, Gauge

from services.common.proto_gen.forage import weight_sync_pb2 as pb
from services.common.weight_sync import wire

log = logging.getLogger("forage.weight_sync")

PUBLISHED_VERSION = Gauge("forage_weight_sync_published_version", "policy version being served")
PUBLISHED_BYTES = Gauge("forage_weight_sync_published_bytes", "bytes in the served state dict")
BYTES_SENT = Counter("forage_weight_sync_bytes_sent_total", "tensor bytes streamed to replicas")
FETCHES = Counter("forage_weight_sync_fetches_total", "fetch streams by outcome", ["result"])

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
    # eager: the serialized data chunks; lazy: None and a provider
    messages: list[bytes] | None
    provider: Provider | None = None
    retired: threading.Event = field(default_factory=threading.Event)

    @property
    def version(self) -> int:
        return self.manifest.version


class _Superseded(Exception):
    pass


class WeightSyncServer:
    """gRPC `WeightSync` service; see the module docstring and docs/weight_sync.md."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        chunk_bytes: int = 4 << 20,
        max_workers: int = 4,
        checksum_algo: str = wire.DEFAULT_CHECKSUM,
        grpc_options: list[tuple[str, object]] | None = None,
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be positive")
        wire.new_hasher(checksum_algo)
        self.host = host
        self.chunk_bytes = chunk_bytes
        self.checksum_algo = checksum_algo
        self._token = token or None
        # A chunk is its payload plus a few small fields; the manifest travels alone in the
        # first message and must fit the same limit (checked at publish).
        self.max_message_bytes = chunk_bytes + (1 << 20)
        self._lock = threading.Lock()
        self._current: _Snapshot | None = None
        self._last_version = 0
        self._publishing = False  # between retiring the old copy and installing the new one
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
        self._server.add_generic_rpc_handlers([
            grpc.method_handlers_generic_handler(wire.SERVICE, {
                "GetVersion": grpc.unary_unary_rpc_method_handler(
                    self._get_version,
                    request_deserializer=pb.GetVersionRequest.FromString,
                    response_serializer=pb.VersionInfo.SerializeToString,
                ),
                # Chunks are already serialized by wire.encode_chunk: no serializer.
                "Fetch": grpc.unary_stream_rpc_method_handler(
                    self._fetch, request_deserializer=pb.FetchRequest.FromString,
                ),
            })
        ])
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"weight sync server cannot bind {host}:{port}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def version(self) -> int:
        snapshot = self._current
        return snapshot.version if snapshot else 0

    def start(self) -> WeightSyncServer:
        self._server.start()
        log.info("weight sync serving on %s (auth %s)", self.address, "on" if self._token else "off")
        return self

    def stop(self, grace_s: float | None = 1.0) -> None:
        self._retire()
        self._server.stop(grace_s).wait()

    def __enter__(self) -> WeightSyncServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- publishing -------------------------------------------------------------------------

    def publish(self, state_dict: TensorSource, version: int) -> pb.Manifest:
        """Serve a copy of `state_dict` (a mapping, or an iterable of (name, tensor)) as `version`.

        The old version is retired before the copy is made, so peak memory is one snapshot.
        An iterable lets a ZeRO-3 learner gather one parameter (or bucket) at a time. If the
        publish fails (bad dtype, manifest too large) nothing is served until the next one.
        """
        return self._guarded(version, lambda: self._publish(state_dict, version))

    def _guarded(self, version: int, run: Callable[[], pb.Manifest]) -> pb.Manifest:
        """Check the version, and flag the gap between retiring and installing a copy, during
        which fetches answer `publishing` (clients wait) rather than `not_published`."""
        self._check_version(version)
        self._publishing = True
        try:
            return run()
        finally:
            self._publishing = False

    def _publish(self, state_dict: TensorSource, version: int) -> pb.Manifest:
        self._retire()
        hasher = wire.new_hasher(self.checksum_algo)
        packer = wire.ChunkPacker(version, self.chunk_bytes)
        specs: list[pb.TensorSpec] = []
        offset = 0
        for name, tensor in _items(state_dict):
            cpu, data = _cpu_bytes(tensor)
            spec = wire.spec_of(name, cpu, offset)
            hasher.update(data)
            packer.add(name, data)
            specs.append(spec)
            offset += spec.nbytes
        manifest = self._manifest(version, specs, offset, hasher.hexdigest())
        self._install(_Snapshot(manifest, self._manifest_bytes(manifest), packer.finish()))
        return manifest

    def publish_lazy(
        self,
        provider: Provider,
        version: int,
        specs: Sequence[tuple[str, torch.dtype, Sequence[int]]] | None = None,
    ) -> pb.Manifest:
        """See `_publish_lazy`; nothing is served after a failed publish until the next one."""
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
        self._retire()
        layout: list[pb.TensorSpec] = []
        offset = 0
        checksum = ""
        if specs is None:
            hasher = wire.new_hasher(self.checksum_algo)
            for name, tensor in provider():
                cpu, data = _cpu_bytes(tensor)
                layout.append(wire.spec_of(name, cpu, offset))
                hasher.update(data)
                offset += len(data)
            checksum = hasher.hexdigest()
        else:
            for name, dtype, shape in specs:
                dims = [int(d) for d in shape]
                nbytes = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
                layout.append(pb.TensorSpec(name=name, dtype=wire.dtype_name(dtype), shape=dims,
                                            nbytes=nbytes, offset=offset))
                offset += nbytes
        manifest = self._manifest(version, layout, offset, checksum)
        self._install(_Snapshot(manifest, self._manifest_bytes(manifest), None, provider))
        return manifest

    def _check_version(self, version: int) -> None:
        if version < 1:
            raise ValueError("versions start at 1 (0 means nothing published)")
        if version <= self._last_version:
            raise ValueError(f"version {version} is not newer than {self._last_version}")

    def _manifest(
        self, version: int, specs: list[pb.TensorSpec], total: int, checksum: str
    ) -> pb.Manifest:
        return pb.Manifest(
            version=version, tensors=specs, total_bytes=total, checksum=checksum,
            checksum_algo=self.checksum_algo, chunk_bytes=self.chunk_bytes,
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

    def _install(self, snapshot: _Snapshot) -> None:
        with self._lock:
            self._current = snapshot
            self._last_version = snapshot.version
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

    def _fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        snapshot = self._current
        if snapshot is None:
            if self._publishing:
                FETCHES.labels("publishing").inc()
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"publishing: version {self._last_version} is being replaced")
            FETCHES.labels("not_published").inc()
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not_published: no weights served")
        if request.version and request.version != snapshot.version:
            FETCHES.labels("superseded").inc()
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"superseded: version {request.version} is not served; current is "
                f"{snapshot.version}",
            )
        try:
            yield from self._encode_chunks(snapshot)
        except _Superseded:
            FETCHES.labels("superseded").inc()
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"superseded: version {snapshot.version} was replaced during the transfer",
            )
        except ValueError as exc:  # a lazy provider that no longer matches its manifest
            FETCHES.labels("error").inc()
            log.error("weights v%d: %s", snapshot.version, exc)
            context.abort(grpc.StatusCode.DATA_LOSS, f"corrupt: {exc}")
        FETCHES.labels("ok").inc()

    def _encode_chunks(self, snapshot: _Snapshot) -> Iterator[bytes]:
        """The serialized chunks of one fetch: manifest, data chunks, then the checksum."""
        yield snapshot.manifest_bytes
        version = snapshot.version
        if snapshot.messages is not None:
            checksum = snapshot.manifest.checksum
            for message in snapshot.messages:
                if snapshot.retired.is_set():
                    raise _Superseded
                BYTES_SENT.inc(len(message))
                yield message
        else:
            hasher = wire.new_hasher(snapshot.manifest.checksum_algo)
            tensors = self._lazy_tensors(snapshot)
            for offset, pieces, name, inner in wire.iter_stream_pieces(tensors, self.chunk_bytes):
                if snapshot.retired.is_set():
                    raise _Superseded
                for piece in pieces:
                    hasher.update(piece)
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
