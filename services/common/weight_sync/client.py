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

With `relays=True` the client first asks the learner where to fetch (`Locate`: the learner
itself or another replica's relay, fanout.py), checks that the source's manifest is the
learner's, checks every chunk against the learner's per-chunk digest on arrival, and when the
source fails goes on from the same byte at another source the learner names (after
`relay_retries` failed sources: the learner itself). With `relay=WeightRelay(...)` it serves
what it receives to others as it arrives (relay.py). Either way the whole stream's checksum is
compared before anything is returned.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch
from prometheus_client import Counter, Histogram

from services.common.proto_gen.forage import weight_sync_pb2 as pb
from services.common.weight_sync import checksum, malloc_tuning, tls, wire
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
RELAY_FAILOVERS = Counter(
    "forage_weight_sync_relay_failovers_total",
    "relay sources that failed mid-fetch (the fetch went on from another source)", ["reason"],
)

_STATUS_REASONS = {
    grpc.StatusCode.UNAUTHENTICATED: "auth",
    grpc.StatusCode.PERMISSION_DENIED: "auth",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "unavailable",
    grpc.StatusCode.DATA_LOSS: "corrupt",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "transport",
}


def _rpc_error(exc: grpc.RpcError, where: str = "", tls_ca: str | None = None
               ) -> WeightSyncError:
    """`exc` as a WeightSyncError; a connection to `where` that failed because of TLS (or its
    absence: `tls_ca` is the client's CA file, None when it dials plain) says so in one line."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    if code == grpc.StatusCode.UNAVAILABLE and where:
        said = tls.explain(details, tls_ca is not None, where, tls_ca or "")
        if said is not None:
            return WeightSyncError("tls" if tls_ca is not None else "unavailable", said)
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
    `relays`: ask the learner where to fetch (`Locate`) and fail over between sources;
    `relay`: a started `WeightRelay` that serves what this client receives to others;
    `pace(nbytes)` is called after each received message and may sleep (a receive-rate cap).
    `tls_ca_file`: dial TLS and trust only this CA (the learner and every relay; a "unix:"
    address stays plain); `relay_tls_name`: the name relay certificates carry, checked instead
    of the relay's address (empty: the address's host). See tls.py.
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
        relays: bool = False,
        relay: Any = None,
        relay_retries: int = 3,
        pace: Callable[[int], None] | None = None,
        tls_ca_file: str | None = None,
        relay_tls_name: str = "",
    ) -> None:
        self.tls_ca_file = tls_ca_file or None
        self.relay_tls_name = relay_tls_name
        # read and checked now: a bad CA file is one error naming its setting, not a failed
        # handshake later
        self._credentials = (tls.channel_credentials(self.tls_ca_file)
                             if self.tls_ca_file else None)
        if tune_malloc:
            malloc_tuning.keep_receive_buffers()
        self.address = address
        self.hash_thread = hash_thread
        self.timeout_s = timeout_s
        self.fetch_timeout_s = fetch_timeout_s
        self.max_message_bytes = max_message_bytes
        self.relays = relays
        self.relay = relay
        self.relay_retries = relay_retries
        self.client_id = uuid.uuid4().hex
        self._pace = pace
        self._grpc_options = list(grpc_options or [])
        self._metadata = ((wire.AUTH_METADATA_KEY, f"Bearer {token}"),) if token else None
        self._channel = self._open_channel(address)
        self._locate_supported = True
        self._locate_rpc = self._channel.unary_unary(
            wire.LOCATE_METHOD, request_serializer=pb.LocateRequest.SerializeToString,
            response_deserializer=pb.LocateReply.FromString,
        )
        # Channels to relay sources, most recently used last (a few: sources change per version).
        self._sources: OrderedDict[str, tuple[grpc.Channel, Any]] = OrderedDict()
        self._get_version = self._channel.unary_unary(
            wire.GET_VERSION_METHOD,
            request_serializer=pb.GetVersionRequest.SerializeToString,
            response_deserializer=pb.VersionInfo.FromString,
        )
        # Raw bytes in: chunks are decoded by wire.decode_chunk without copying the payload.
        self._fetch = self._channel.unary_stream(
            wire.FETCH_METHOD, request_serializer=pb.FetchRequest.SerializeToString,
        )

    def _open_channel(self, address: str, relay: bool = False) -> grpc.Channel:
        options: list[tuple[str, object]] = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", 1 << 20),
            # Notice a learner that vanished mid-transfer instead of waiting forever.
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            *wire.TRANSPORT_OPTIONS,
            *self._grpc_options,
        ]
        if self._credentials is None or address.startswith("unix:"):
            return grpc.insecure_channel(address, options=options)
        if relay and self.relay_tls_name:
            options.append(("grpc.ssl_target_name_override", self.relay_tls_name))
        return grpc.secure_channel(address, self._credentials, options=options)

    def _error(self, exc: grpc.RpcError, where: str = "") -> WeightSyncError:
        return _rpc_error(exc, where or self.address, self.tls_ca_file)

    def close(self) -> None:
        self._channel.close()
        while self._sources:
            _, (channel, _) = self._sources.popitem()
            channel.close()

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
            error = self._error(exc)
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
        """One fetch: from the learner, or with relays from the source the learner names,
        going on from another source (resume at the same byte) when a relay fails."""
        started = time.perf_counter()
        plan = self._locate(version) if self.relays else _Plan(version, LEARNER, None)
        progress = _Progress()
        failed: list[str] = []
        try:
            while True:
                try:
                    self._receive(plan, progress, expect)
                    break
                except WeightSyncError as exc:
                    if plan.source == LEARNER:
                        raise  # the learner itself: fetch()'s retry rules apply
                    failed.append(plan.source)
                    RELAY_FAILOVERS.labels(exc.reason).inc()
                    log.warning("weights v%d: source %s failed (%s); asking the learner for "
                                "another", plan.version, plan.source, exc)
                    plan = self._locate(plan.version, failed,
                                        learner_only=len(failed) > self.relay_retries)
                    held = progress.transfer
                    if held is not None and held.poisoned:
                        # bytes nothing could check chunk by chunk (a manifest without chunk
                        # digests) failed the checksum: no resume can repair them, start over
                        held.abandon(str(exc))
                        progress.transfer = held = None
                    if held is not None and plan.version != held.manifest.version:
                        raise WeightSyncError(
                            "superseded", f"the learner moved to version {plan.version} "
                            f"while v{held.manifest.version} was being received") from exc
        except BaseException as exc:
            if progress.transfer is not None:
                progress.transfer.abandon(f"{type(exc).__name__}: {exc}")
            raise
        transfer = progress.transfer
        assert transfer is not None
        transfer.close()
        manifest = transfer.manifest
        if self.relays:
            self._announce_done(manifest.version)
        elapsed = time.perf_counter() - started
        FETCH_SECONDS.observe(elapsed)
        BYTES_RECEIVED.inc(manifest.total_bytes)
        log.info("fetched weights v%d: %d bytes in %.2fs (%.0f MB/s)%s", manifest.version,
                 manifest.total_bytes, elapsed, manifest.total_bytes / max(elapsed, 1e-9) / 1e6,
                 f" via {len(failed) + 1} source(s)" if self.relays else "")
        return manifest.version, transfer.staging, dict(manifest.metadata)

    # --- relays -----------------------------------------------------------------------------

    def _locate(self, version: int, failed: Sequence[str] = (),
                learner_only: bool = False) -> _Plan:
        """Ask the learner where to fetch `version` (0 = current). A learner that predates
        `Locate` (UNIMPLEMENTED) or has nothing yet means: fetch from it directly."""
        if learner_only or not self._locate_supported:
            return _Plan(version, LEARNER, None)
        request = pb.LocateRequest(
            version=version, client_id=self.client_id, failed=list(failed),
            relay_address=self.relay.address if self.relay is not None else "")
        try:
            reply = self._locate_rpc(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("the weight server at %s predates relays: fetching from it directly",
                         self.address)
                self._locate_supported = False
                return _Plan(version, LEARNER, None)
            raise self._error(exc) from None
        if reply.version == 0 or (version and reply.version != version):
            # nothing published, or the named version is gone: the learner's own Fetch says so
            return _Plan(version, LEARNER, None)
        return _Plan(reply.version, reply.source,
                     reply.manifest if reply.HasField("manifest") else None)

    def _announce_done(self, version: int) -> None:
        """Tell the learner this client holds `version` (frees its source's slot); best effort."""
        if not self._locate_supported:
            return
        try:
            self._locate_rpc(pb.LocateRequest(version=version, client_id=self.client_id,
                                              done=True),
                             timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            log.debug("announcing v%d as held failed: %s", version, exc)

    def _stub_for(self, source: str):
        if source == LEARNER:
            return self._fetch
        entry = self._sources.pop(source, None)
        if entry is None:
            channel = self._open_channel(source, relay=True)
            entry = (channel, channel.unary_stream(
                wire.FETCH_METHOD, request_serializer=pb.FetchRequest.SerializeToString))
        self._sources[source] = entry  # most recent last
        while len(self._sources) > _MAX_SOURCE_CHANNELS:
            _, (old, _) = self._sources.popitem(last=False)
            old.close()
        return entry[1]

    def _receive(self, plan: _Plan, progress: _Progress,
                 expect: Mapping[str, torch.Tensor] | None) -> None:
        """Stream `plan.version` from `plan.source` into `progress.transfer` (made from the
        first manifest), from where it stopped; returns once it is complete and verified."""
        where = plan.source or self.address
        held = progress.transfer
        request = pb.FetchRequest(version=plan.version, offset=held.cursor if held else 0)
        try:
            stream = self._stub_for(plan.source)(request, timeout=self.fetch_timeout_s,
                                                 metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._error(exc, where) from None
        try:
            try:
                raw = next(stream)
            except StopIteration:
                raise WeightSyncError("truncated", "the stream ended before the manifest") from None
            if self._pace is not None:
                self._pace(len(raw))
            manifest = wire.decode_chunk(raw).manifest
            if manifest is None:
                raise WeightSyncError("manifest", "the first chunk carries no manifest")
            if plan.manifest is not None and not wire.same_manifest(manifest, plan.manifest):
                raise WeightSyncError("manifest", f"{where} sent a manifest that differs from "
                                      "the one the learner publishes")
            if plan.version and manifest.version != plan.version:
                raise WeightSyncError(
                    "superseded", f"asked for version {plan.version}, got {manifest.version}")
            if held is None:
                held = progress.transfer = _Transfer(
                    manifest, expect, self.hash_thread, self.max_message_bytes, self.relay)
            elif not wire.same_manifest(manifest, held.manifest):
                raise WeightSyncError("manifest", f"{where} sent another manifest for "
                                      f"v{manifest.version} than the transfer began with")
            # Chunk digests matter where a bad chunk could travel on (this client relays) or
            # come from another replica; straight from the learner to a client that relays
            # nothing, the whole stream's checksum alone decides, as before (no extra pass).
            verify = plan.source != LEARNER or held.buffer is not None
            final: wire.DecodedChunk | None = None
            for raw in stream:
                if self._pace is not None:
                    self._pace(len(raw))
                chunk = wire.decode_chunk(raw)
                if chunk.last:
                    final = chunk
                    break
                held.feed(chunk, verify)
            held.finish(final)
            _read_to_end(stream)
        except grpc.RpcError as exc:
            raise self._error(exc, where) from None
        finally:
            stream.cancel()


def _read_to_end(stream) -> None:
    """Wait for the server to end a verified stream instead of cancelling it at the last chunk.

    The server counts a message as sent (bytes_sent, forage_weight_sync_bytes_sent_total) and
    the fetch as served (forage_weight_sync_fetches_total{result="ok"}) when gRPC asks it for the
    next one; a cancel that arrives first would drop both counts. The transfer is already
    verified, so an error at the call's end changes nothing here."""
    try:
        for _ in stream:
            log.warning("weight sync: the server sent data after the last chunk; ignored")
            return
    except grpc.RpcError as exc:
        log.debug("the verified stream ended with %s", exc.code())


LEARNER = ""  # a plan's source "": the server this client was made for
_MAX_SOURCE_CHANNELS = 4


@dataclass
class _Plan:
    """Which version to fetch from where; `manifest` is the learner's, when it said so."""

    version: int
    source: str
    manifest: pb.Manifest | None


@dataclass
class _Progress:
    transfer: _Transfer | None = None


class _Transfer:
    """One version being received into staging; it survives a change of source, since the
    bytes of a version are the same everywhere: the cursor, the staging buffer and the running
    checksum carry over to a resumed stream.

    Every chunk is checked on arrival (version, offset, the tensor it starts in, and, when it
    comes from a relay or this client relays, its digest against the manifest's) before it is
    copied, hashed and, with a relay, offered to this client's own children. The whole stream's checksum is compared at
    the end, before anything is returned.
    """

    def __init__(self, manifest: pb.Manifest, expect: Mapping[str, torch.Tensor] | None,
                 hash_thread: bool | None, max_message_bytes: int, relay: Any) -> None:
        layout = wire.check_manifest(manifest)
        if manifest.chunk_bytes + (1 << 20) > max_message_bytes:
            raise WeightSyncError(
                "manifest", f"server chunks of {manifest.chunk_bytes} bytes exceed this "
                f"client's max_message_bytes {max_message_bytes}")
        if expect is not None:
            _check_expected(layout, expect)
        self.manifest = manifest
        self.staging, self.targets = _staging(layout)
        self.cursor = 0
        self._index = 0  # first target whose bytes are not all written yet
        self._chunk = 0  # data chunks received
        self._hasher = checksum.chunk_checksum(manifest.checksum_algo, hash_thread)
        self.poisoned = False  # the whole stream failed its checksum: resuming cannot help
        self.buffer = relay.begin(manifest, self.targets) if relay is not None else None

    def feed(self, chunk: wire.DecodedChunk, verify: bool = True) -> None:
        """Check and place one data chunk; `verify` also checks its digest (when listed)."""
        manifest, cursor = self.manifest, self.cursor
        if chunk.version != manifest.version:
            raise WeightSyncError(
                "corrupt", f"chunk of version {chunk.version} in a v{manifest.version} stream")
        data = chunk.data
        if chunk.offset != cursor or cursor + len(data) > manifest.total_bytes:
            raise WeightSyncError(
                "corrupt", f"chunk at offset {chunk.offset} (+{len(data)}), expected "
                f"{cursor} within {manifest.total_bytes}")
        if chunk.name and data and chunk.name != self.targets[self._index][0].name:
            raise WeightSyncError(
                "corrupt", f"chunk names {chunk.name!r} at offset {cursor}, manifest "
                f"has {self.targets[self._index][0].name!r}")
        expected = wire.expected_digest(manifest, self._chunk) if verify else None
        if expected is not None:
            if len(data) != min(manifest.chunk_bytes, manifest.total_bytes - cursor):
                raise WeightSyncError(
                    "corrupt", f"chunk {self._chunk} has {len(data)} bytes, the manifest's "
                    f"chunks {manifest.chunk_bytes}")
            if wire.chunk_digest(manifest.checksum_algo, (data,)) != expected:
                raise WeightSyncError(
                    "checksum", f"chunk {self._chunk} (bytes {cursor}..{cursor + len(data)}) "
                    f"does not match the learner's {manifest.checksum_algo} digest")
        pos = 0
        while pos < len(data):
            spec, dest = self.targets[self._index]
            inner = cursor - spec.offset
            take = min(len(data) - pos, spec.nbytes - inner)
            dest[inner:inner + take] = data[pos:pos + take]
            pos += take
            cursor += take
            if inner + take == spec.nbytes:
                self._index += 1
        self._hasher.update(data)  # after the copy, while the bytes are in cache
        self.cursor = cursor
        self._chunk += 1
        if self.buffer is not None:
            self.buffer.advance(cursor)

    def finish(self, final: wire.DecodedChunk | None) -> None:
        manifest = self.manifest
        if final is None:
            raise WeightSyncError(
                "truncated", f"stream ended at byte {self.cursor} of {manifest.total_bytes} "
                "without its final chunk")
        if self.cursor != manifest.total_bytes:
            raise WeightSyncError(
                "truncated", f"received {self.cursor} of {manifest.total_bytes} bytes")
        digest = self._hasher.hexdigest()
        expected = {final.checksum, manifest.checksum or final.checksum}
        if expected != {digest}:
            self.poisoned = True
            raise WeightSyncError(
                "checksum", f"{manifest.checksum_algo} of the received bytes is {digest}, "
                f"server said {final.checksum} (manifest {manifest.checksum or '-'})")
        _check_complete(manifest, self.staging)
        if self.buffer is not None:
            self.buffer.complete(digest)

    def close(self) -> None:
        self._hasher.close()

    def abandon(self, reason: str) -> None:
        """The fetch failed for good: children reading this relay go elsewhere."""
        if self.buffer is not None:
            self.buffer.fail(reason)
        self.close()


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
