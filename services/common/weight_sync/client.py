"""Rollout side of weight sync: fetch a version into staging, verify it, then hand it over.

`fetch` allocates one staging buffer (tensors are views of it) and copies each chunk's bytes
straight into it (one copy per byte; bf16 lands as bf16), then feeds the same bytes to the
checksum (on this thread, or a helper thread where cores are to spare: see checksum.py).
Nothing is returned until the stream was complete, in order, consistent with the manifest and
matched its checksum, so a corrupt, truncated or superseded transfer raises `WeightSyncError`
and the caller's weights stay as they were.

A name the manifest lists as an alias (`alias_of`: tied weights, sent once) is returned as the
very tensor it names, so callers see the same names as the learner's state dict; before
returning, the client checks that every name of the manifest is in the result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import grpc
import numpy as np
import torch
from prometheus_client import Counter, Histogram

from services.common.proto_gen.forage import weight_sync_pb2 as pb
from services.common.weight_sync import checksum, malloc_tuning, wire
from services.common.weight_sync.wire import WeightSyncError

log = logging.getLogger("forage.weight_sync")

FETCH_SECONDS = Histogram(
    "forage_weight_sync_fetch_seconds", "wall time of a successful weight fetch",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)
BYTES_RECEIVED = Counter("forage_weight_sync_bytes_received_total", "tensor bytes fetched")
FETCH_FAILURES = Counter(
    "forage_weight_sync_fetch_failures_total", "rejected weight fetches", ["reason"]
)

_STATUS_REASONS = {
    grpc.StatusCode.UNAUTHENTICATED: "auth",
    grpc.StatusCode.PERMISSION_DENIED: "auth",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "unavailable",
    grpc.StatusCode.DATA_LOSS: "corrupt",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "transport",
}


def _rpc_error(exc: grpc.RpcError) -> WeightSyncError:
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    reason = _STATUS_REASONS.get(code, "transport")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        reason = details.split(":", 1)[0] if ":" in details else "superseded"
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and (
            details.startswith("busy:") or "Concurrent RPC limit" in details):
        reason = "busy"  # the server's fetch slots are taken: retried by fetch()
    return WeightSyncError(reason, f"{getattr(code, 'name', code)}: {details}")


class WeightSyncClient:
    """Talks to one learner's `WeightSync` service at `address` ("host:port").

    Unless `tune_malloc=False`, constructing one pins glibc's malloc thresholds for the whole
    process (`malloc_tuning.keep_receive_buffers`): without it every received message lands on
    freshly faulted pages, which measured as the largest single cost of a fetch.
    `hash_thread` (None = when the process has 4+ cores) checksums on a helper thread.
    """

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout_s: float = 30.0,
        fetch_timeout_s: float | None = None,
        max_message_bytes: int = 256 << 20,
        grpc_options: list[tuple[str, object]] | None = None,
        tune_malloc: bool = True,
        hash_thread: bool | None = None,
    ) -> None:
        if tune_malloc:
            malloc_tuning.keep_receive_buffers()
        self.address = address
        self.hash_thread = hash_thread
        self.timeout_s = timeout_s
        self.fetch_timeout_s = fetch_timeout_s
        self.max_message_bytes = max_message_bytes
        self._metadata = ((wire.AUTH_METADATA_KEY, f"Bearer {token}"),) if token else None
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", 1 << 20),
            # Notice a learner that vanished mid-transfer instead of waiting forever.
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            *wire.TRANSPORT_OPTIONS,
            *(grpc_options or []),
        ])
        self._get_version = self._channel.unary_unary(
            wire.GET_VERSION_METHOD,
            request_serializer=pb.GetVersionRequest.SerializeToString,
            response_deserializer=pb.VersionInfo.FromString,
        )
        # Raw bytes in: chunks are decoded by wire.decode_chunk without copying the payload.
        self._fetch = self._channel.unary_stream(
            wire.FETCH_METHOD, request_serializer=pb.FetchRequest.SerializeToString,
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> WeightSyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_version(self) -> tuple[int, pb.Manifest | None]:
        """(current version, its manifest); (0, None) while nothing is published."""
        try:
            info = self._get_version(pb.GetVersionRequest(), timeout=self.timeout_s,
                                     metadata=self._metadata)
        except grpc.RpcError as exc:
            error = _rpc_error(exc)
            FETCH_FAILURES.labels(error.reason).inc()
            raise error from None
        if info.version == 0:
            return 0, None
        return info.version, info.manifest

    def fetch(
        self,
        version: int | None = None,
        expect: Mapping[str, torch.Tensor] | None = None,
        retries: int = 2,
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, tensors): `fetch_with_metadata` without the manifest's metadata."""
        got, tensors, _ = self.fetch_with_metadata(version, expect, retries)
        return got, tensors

    def fetch_with_metadata(
        self,
        version: int | None = None,
        expect: Mapping[str, torch.Tensor] | None = None,
        retries: int = 2,
    ) -> tuple[int, dict[str, torch.Tensor], dict[str, str]]:
        """Fetch `version` (None = the current one) as fresh CPU tensors, fully verified.

        `expect` (e.g. the model's state dict) makes names, shapes and dtypes part of the
        check. With `version=None`, a version replaced during the transfer is retried (up to
        `retries` times) so the caller gets the newer consistent set, and a server caught
        between two versions (`publishing`, older servers) is waited for up to `timeout_s`; a
        named version that is no longer served raises ("superseded"). A server whose fetch
        slots are all taken (`busy`) is retried with backoff for up to `timeout_s`.
        """
        attempt = 0
        deadline = time.monotonic() + self.timeout_s
        pause = 0.05
        while True:
            try:
                return self._fetch_once(version or 0, expect)
            except WeightSyncError as exc:
                if exc.reason == "busy" and time.monotonic() < deadline:
                    time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                    pause = min(pause * 2, 1.0)
                    continue
                if version is None:
                    if exc.reason == "superseded" and attempt < retries:
                        attempt += 1
                        log.info("weights changed during the fetch; fetching the new version")
                        continue
                    if exc.reason == "publishing" and time.monotonic() < deadline:
                        time.sleep(0.05)
                        continue
                FETCH_FAILURES.labels(exc.reason).inc()
                raise

    def _fetch_once(
        self, version: int, expect: Mapping[str, torch.Tensor] | None
    ) -> tuple[int, dict[str, torch.Tensor], dict[str, str]]:
        started = time.perf_counter()
        try:
            stream = self._fetch(pb.FetchRequest(version=version), timeout=self.fetch_timeout_s,
                                 metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _rpc_error(exc) from None
        hasher: checksum.ChunkChecksum | None = None
        try:
            try:
                first = wire.decode_chunk(next(stream))
            except StopIteration:
                raise WeightSyncError("truncated", "the stream ended before the manifest") from None
            manifest = first.manifest
            if manifest is None:
                raise WeightSyncError("manifest", "the first chunk carries no manifest")
            layout = wire.check_manifest(manifest)
            if version and manifest.version != version:
                raise WeightSyncError(
                    "superseded", f"asked for version {version}, got {manifest.version}")
            if manifest.chunk_bytes + (1 << 20) > self.max_message_bytes:
                raise WeightSyncError(
                    "manifest", f"server chunks of {manifest.chunk_bytes} bytes exceed this "
                    f"client's max_message_bytes {self.max_message_bytes}")
            if expect is not None:
                _check_expected(layout, expect)
            staging, targets = _staging(layout)
            hasher = checksum.chunk_checksum(manifest.checksum_algo, self.hash_thread)
            cursor = 0
            index = 0  # first target whose bytes are not all written yet
            final: wire.DecodedChunk | None = None
            for raw in stream:
                chunk = wire.decode_chunk(raw)
                if chunk.version != manifest.version:
                    raise WeightSyncError(
                        "corrupt", f"chunk of version {chunk.version} in a v{manifest.version} "
                        "stream")
                if chunk.last:
                    final = chunk
                    break
                data = chunk.data
                if chunk.offset != cursor or cursor + len(data) > manifest.total_bytes:
                    raise WeightSyncError(
                        "corrupt", f"chunk at offset {chunk.offset} (+{len(data)}), expected "
                        f"{cursor} within {manifest.total_bytes}")
                if chunk.name and data and chunk.name != targets[index][0].name:
                    raise WeightSyncError(
                        "corrupt", f"chunk names {chunk.name!r} at offset {cursor}, manifest "
                        f"has {targets[index][0].name!r}")
                pos = 0
                while pos < len(data):
                    spec, dest = targets[index]
                    inner = cursor - spec.offset
                    take = min(len(data) - pos, spec.nbytes - inner)
                    dest[inner:inner + take] = data[pos:pos + take]
                    pos += take
                    cursor += take
                    if inner + take == spec.nbytes:
                        index += 1
                hasher.update(data)  # after the copy, while the bytes are in cache
            if final is None:
                raise WeightSyncError(
                    "truncated", f"stream ended at byte {cursor} of {manifest.total_bytes} "
                    "without its final chunk")
            if cursor != manifest.total_bytes:
                raise WeightSyncError(
                    "truncated", f"received {cursor} of {manifest.total_bytes} bytes")
            digest = hasher.hexdigest()
            expected = {final.checksum, manifest.checksum or final.checksum}
            if expected != {digest}:
                raise WeightSyncError(
                    "checksum", f"{manifest.checksum_algo} of the received bytes is {digest}, "
                    f"server said {final.checksum} (manifest {manifest.checksum or '-'})")
            _check_complete(manifest, staging)
        except grpc.RpcError as exc:
            raise _rpc_error(exc) from None
        finally:
            if hasher is not None:
                hasher.close()
            stream.cancel()
        elapsed = time.perf_counter() - started
        FETCH_SECONDS.observe(elapsed)
        BYTES_RECEIVED.inc(manifest.total_bytes)
        log.info("fetched weights v%d: %d bytes in %.2fs (%.0f MB/s)", manifest.version,
                 manifest.total_bytes, elapsed, manifest.total_bytes / max(elapsed, 1e-9) / 1e6)
        return manifest.version, staging, dict(manifest.metadata)


_ALIGN = 64


def _staging(
    layout: list[wire.TensorLayout],
) -> tuple[dict[str, torch.Tensor], list[tuple[wire.TensorLayout, np.ndarray]]]:
    """Uninitialised CPU tensors for `layout`, views of one flat numpy buffer.

    One large numpy allocation gets transparent huge pages (numpy asks for them; torch does
    not): first-touch faults on 4 KiB pages ran at ~0.5 GB/s on the machines measured, slower
    than the transfer itself. The tensors share that buffer; it is freed when all are dropped.
    Returns the tensors by name and (spec, its uint8 region) for every non-empty tensor. An
    alias is the same tensor object as the one it names (check_manifest put that one earlier).
    """
    offsets, total = [], 0
    for spec in layout:
        offsets.append(total)
        total += -(-spec.nbytes // _ALIGN) * _ALIGN
    flat = np.empty(total, dtype=np.uint8)
    tensors: dict[str, torch.Tensor] = {}
    targets: list[tuple[wire.TensorLayout, np.ndarray]] = []
    for spec, offset in zip(layout, offsets, strict=True):
        if spec.alias_of:
            tensors[spec.name] = tensors[spec.alias_of]
            continue
        if spec.nbytes == 0:
            tensors[spec.name] = torch.empty(spec.shape, dtype=spec.dtype)
            continue
        region = flat[offset:offset + spec.nbytes]
        tensors[spec.name] = torch.from_numpy(region).view(spec.dtype).view(spec.shape)
        targets.append((spec, region))
    return tensors, targets


def _check_expected(layout: list[wire.TensorLayout], expect: Mapping[str, torch.Tensor]) -> None:
    got = {t.name: t for t in layout}
    missing = sorted(set(expect) - set(got))
    extra = sorted(set(got) - set(expect))
    if missing or extra:
        raise WeightSyncError(
            "manifest", f"names differ from the expected set: missing {missing[:5]}, "
            f"unexpected {extra[:5]}")
    for name, tensor in expect.items():
        spec = got[name]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise WeightSyncError(
                "manifest", f"{name}: server has {spec.dtype}{list(spec.shape)}, expected "
                f"{tensor.dtype}{list(tensor.shape)}")


def _check_complete(manifest: pb.Manifest, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every name the manifest lists, aliases included, is in what fetch returns (and nothing
    else): a name dropped on the way would leave that weight stale in the caller's model."""
    listed = {spec.name for spec in manifest.tensors}
    if listed != tensors.keys():
        missing = sorted(listed - tensors.keys())
        extra = sorted(tensors.keys() - listed)
        raise WeightSyncError(
            "manifest", f"fetched names differ from the manifest's: missing {missing[:5]}, "
            f"unexpected {extra[:5]}")
