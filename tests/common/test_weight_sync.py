"""Weight sync over a real gRPC server on loopback (docs/architecture.md)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.proto_gen.forage import weight_sync_pb2 as pb
from services.common.weight_sync import (
    WeightFollower,
    WeightSyncClient,
    WeightSyncError,
    WeightSyncServer,
    wire,
)
from tests.conftest import import_or_skip

torch.set_num_threads(1)
CHUNK = 4096  # small messages, so a few KB tensors span many of them


def state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 48, generator=g),  # 12 KB > one message
        "layer.0.bf16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "layer.0.fp16": torch.randn(5, generator=g).half(),
        "layer.0.transposed": torch.randn(6, 9, generator=g).t(),  # non-contiguous source
        "step": torch.tensor(7 + seed),  # 0-d int64
        "ids": torch.randint(-1000, 1000, (11,), generator=g, dtype=torch.int32),
        "mask": torch.rand(13, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "bytes": torch.randint(0, 255, (3, 3), generator=g, dtype=torch.uint8),
        "big.bf16": torch.randn(40_000, generator=g).to(torch.bfloat16),  # 80 KB, ~20 messages
    }


def version_dict(version: int) -> dict[str, torch.Tensor]:
    """Every element equals the version, so a mix of versions shows."""
    return {
        f"w{i}": torch.full((1000 + i,), float(version), dtype=torch.bfloat16 if i % 2 else torch.float32)
        for i in range(6)
    }


def assert_same(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


@pytest.fixture()
def server():
    srv = WeightSyncServer(chunk_bytes=CHUNK).start()
    yield srv
    srv.stop(0)


def client_for(srv: WeightSyncServer, **kwargs) -> WeightSyncClient:
    return WeightSyncClient(srv.address, timeout_s=10, fetch_timeout_s=30, **kwargs)


def test_round_trip_mixed_dtypes_and_multi_message_tensors(server):
    source = state_dict()
    expected = {k: v.clone() for k, v in source.items()}
    manifest = server.publish(source, version=3)
    source["embed.weight"].add_(1.0)  # the learner keeps training: the snapshot must not move
    with client_for(server) as client:
        version, info = client.get_version()
        assert version == 3
        assert [t.name for t in info.tensors] == list(expected)
        assert {t.name: t.dtype for t in info.tensors}["layer.0.bf16"] == "bfloat16"
        assert list(info.tensors[0].shape) == [64, 48]
        assert info.total_bytes == sum(v.numel() * v.element_size() for v in expected.values())
        assert info.checksum == manifest.checksum
        # the default checksum is XXH3-64 of the raw bytes, in manifest order
        assert info.checksum_algo == wire.DEFAULT_CHECKSUM == "xxh3_64"
        digest = xxhash.xxh3_64()
        for tensor in expected.values():
            digest.update(wire.as_bytes(tensor.contiguous()))
        assert info.checksum == digest.hexdigest()
        assert info.total_bytes > 20 * CHUNK
        got_version, got = client.fetch()
        assert got_version == 3
        assert_same(expected, got)
        assert all(t.is_contiguous() for t in got.values())
        # by version number too, and verified against the caller's own shapes/dtypes
        assert_same(expected, client.fetch(3, expect=expected)[1])
        # the set is copied at publish: later changes to the source do not leak into it
        assert not torch.equal(source["embed.weight"], expected["embed.weight"])
        # bf16 travels as raw bits: every pattern (NaNs, infs, subnormals) survives exactly
        bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
        server.publish({"bits": bits.view(torch.bfloat16)}, 4)
        assert torch.equal(client.fetch()[1]["bits"].view(torch.int16), bits)


def test_nothing_published_and_versions_must_increase(server):
    with client_for(server) as client:
        assert client.get_version() == (0, None)
        with pytest.raises(WeightSyncError) as err:
            client.fetch()
        assert err.value.reason == "not_published"
    server.publish(version_dict(1), 1)
    with pytest.raises(ValueError):
        server.publish(version_dict(1), 1)
    with pytest.raises(ValueError):
        server.publish(version_dict(0), 0)


def test_expected_shapes_and_dtypes_are_checked(server):
    server.publish(version_dict(1), 1)
    wrong_dtype = {k: v.float() for k, v in version_dict(1).items()}
    wrong_shape = {k: v[:-1] for k, v in version_dict(1).items()}
    missing = dict(list(version_dict(1).items())[:-1])
    with client_for(server) as client:
        for expect in (wrong_dtype, wrong_shape, missing):
            with pytest.raises(WeightSyncError) as err:
                client.fetch(expect=expect)
            assert err.value.reason == "manifest"


class CorruptingServer(WeightSyncServer):
    """Flips one payload byte of the fifth message on the wire."""

    def _encode_chunks(self, snapshot, *args):
        for i, message in enumerate(super()._encode_chunks(snapshot, *args)):
            if i == 4:
                message = bytearray(message)
                message[-10] ^= 0x01
                message = bytes(message)
            yield message


class TruncatingServer(WeightSyncServer):
    """Ends the stream cleanly two messages early (no final chunk)."""

    def _encode_chunks(self, snapshot, *args):
        messages = list(super()._encode_chunks(snapshot, *args))
        yield from messages[:-2]


class GappyServer(WeightSyncServer):
    """Skips one data chunk in the middle."""

    def _encode_chunks(self, snapshot, *args):
        for i, message in enumerate(super()._encode_chunks(snapshot, *args)):
            if i != 3:
                yield message


def _follower_rejects(srv: WeightSyncServer, reason: str | set[str]) -> None:
    """A replica with v1 weights polls a broken v2 transfer and keeps v1, untouched."""
    current = version_dict(1)
    applied: list[int] = []

    def apply(version, tensors):
        applied.append(version)
        current.update(tensors)

    with client_for(srv) as client:
        follower = WeightFollower(client, apply, version=1)
        assert follower.poll() is False
        assert applied == []
        assert follower.version == 1
        assert_same(version_dict(1), current)
        reasons = {reason} if isinstance(reason, str) else reason
        assert follower.last_error is not None and follower.last_error.reason in reasons


@pytest.mark.parametrize(
    "server_cls, reason",
    [(CorruptingServer, "checksum"), (TruncatingServer, "truncated"), (GappyServer, "corrupt")],
)
def test_broken_transfers_are_rejected_and_old_weights_kept(server_cls, reason):
    srv = server_cls(chunk_bytes=CHUNK).start()
    try:
        srv.publish(state_dict(), 2)
        with client_for(srv) as client, pytest.raises(WeightSyncError) as err:
            client.fetch()
        assert err.value.reason == reason
        _follower_rejects(srv, reason)
    finally:
        srv.stop(0)


@pytest.mark.parametrize("hash_thread", [False, True], ids=["inline", "helper-thread"])
@pytest.mark.parametrize("algo", wire.CHECKSUMS)
def test_every_checksum_algorithm_round_trips_and_catches_a_flipped_byte(algo, hash_thread):
    for server_cls in (WeightSyncServer, CorruptingServer):
        srv = server_cls(chunk_bytes=CHUNK, checksum_algo=algo).start()
        try:
            srv.publish(state_dict(), 1)
            with client_for(srv, hash_thread=hash_thread) as client:
                if server_cls is WeightSyncServer:
                    assert_same(state_dict(), client.fetch()[1])
                    continue
                with pytest.raises(WeightSyncError) as err:
                    client.fetch()
                assert err.value.reason == "checksum" and algo in str(err.value)
        finally:
            srv.stop(0)


class DroppingProxy:
    """Loopback TCP proxy that cuts the connection after `limit` bytes from the server."""

    def __init__(self, target_port: int, limit: int) -> None:
        self.limit = limit
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.sockets += [downstream, upstream]
            threading.Thread(target=self._pump, args=(downstream, upstream, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, downstream, self.limit), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while limit is None or sent < limit:
                data = src.recv(65536 if limit is None else min(65536, limit - sent))
                if not data:
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for sock in (src, dst):  # drop both sides, as a dying network would
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            sock.close()


def test_dropped_connection_is_rejected_and_old_weights_kept(server):
    server.publish(state_dict(), 2)
    total = server._current.manifest.total_bytes
    proxy = DroppingProxy(server.port, limit=total // 2)
    try:
        current = version_dict(1)
        client = WeightSyncClient(f"127.0.0.1:{proxy.port}", timeout_s=10, fetch_timeout_s=30)
        follower = WeightFollower(client, lambda v, t: current.update(t), version=1)
        with pytest.raises(WeightSyncError) as err:
            client.fetch()
        assert err.value.reason in {"unavailable", "transport", "truncated"}
        assert follower.poll() is False
        assert follower.version == 1
        assert_same(version_dict(1), current)
        client.close()
    finally:
        proxy.close()


def test_auth_token_required_when_configured():
    srv = WeightSyncServer(chunk_bytes=CHUNK, token="s3cret").start()
    try:
        srv.publish(version_dict(1), 1)
        for token in (None, "wrong"):
            with client_for(srv, token=token) as client:
                with pytest.raises(WeightSyncError) as err:
                    client.get_version()
                assert err.value.reason == "auth"
                with pytest.raises(WeightSyncError) as err:
                    client.fetch()
                assert err.value.reason == "auth"
        with client_for(srv, token="s3cret") as client:
            assert client.get_version()[0] == 1
            assert_same(version_dict(1), client.fetch()[1])
    finally:
        srv.stop(0)


def test_tls_pull_keeps_the_token_and_refuses_a_wrong_ca_or_plain_grpc(tmp_path):
    import_or_skip("cryptography", "the TLS tests make their certificates with it")
    from services.common.config import ConfigError
    from services.common.weight_sync.tls import ServerTls
    from tests.common.tls_certs import make_certs

    certs = make_certs(tmp_path)
    ca, cert, key = certs["ca"].cert, certs["server"].cert, certs["server"].key
    srv = WeightSyncServer(chunk_bytes=CHUNK, token="s3cret", tls=ServerTls(cert, key)).start()
    plain = WeightSyncServer(chunk_bytes=CHUNK).start()
    try:
        manifest = srv.publish(state_dict(), 1)
        with client_for(srv, token="s3cret", tls_ca_file=ca) as client:
            assert client.get_version()[1].checksum == manifest.checksum
            assert_same(state_dict(), client.fetch()[1])  # the client checked the checksum
        refused = [  # (client, reason, what the one-line error says)
            (client_for(srv, tls_ca_file=ca), "auth", "missing or wrong token"),
            (client_for(srv, token="s3cret", tls_ca_file=certs["other_ca"].cert), "tls",
             "not signed by the CA in learner.weight_sync_tls_ca_file"),
            (client_for(srv, token="s3cret"), "unavailable",
             "if it serves TLS, set learner.weight_sync_tls_ca_file"),
            (client_for(plain, tls_ca_file=ca), "tls", "does not speak TLS"),
        ]
        for client, reason, said in refused:
            with client, pytest.raises(WeightSyncError) as err:
                client.fetch()
            assert err.value.reason == reason and said in str(err.value), err.value
            assert "\n" not in str(err.value)
        # a replica whose client cannot verify the server keeps the weights it has
        with client_for(srv, token="s3cret", tls_ca_file=certs["other_ca"].cert) as client:
            follower = WeightFollower(client, lambda *a: pytest.fail("applied"), version=1)
            assert follower.poll() is False and follower.last_error.reason == "tls"
    finally:
        srv.stop(0)
        plain.stop(0)
    bad_files = [  # a file that cannot work is refused before anything binds or dials
        (lambda: ServerTls(str(tmp_path / "nope.crt"), key).credentials(),
         "learner.weight_sync_tls_cert_file .*nope.crt does not exist"),
        (lambda: ServerTls(cert, certs["client"].key).credentials(), "not a PEM certificate "
         "and its private key"),
        (lambda: WeightSyncClient("127.0.0.1:1", tls_ca_file=key, tune_malloc=False),
         "learner.weight_sync_tls_ca_file .* holds no PEM CA certificate"),
    ]
    for make, said in bad_files:
        with pytest.raises(ConfigError, match=said):
            make()


class RepublishingServer(WeightSyncServer):
    """Publishes v2 (once) while a v1 stream is on its third message."""

    def _encode_chunks(self, snapshot, *args):
        for i, message in enumerate(super()._encode_chunks(snapshot, *args)):
            yield message
            if i == 2 and snapshot.version == 1:
                self.publish(version_dict(2), 2)


def test_version_replaced_mid_fetch_never_mixes():
    srv = RepublishingServer(chunk_bytes=1024).start()
    try:
        with client_for(srv) as client:
            srv.publish(version_dict(1), 1)
            with pytest.raises(WeightSyncError) as err:
                client.fetch(1)  # a named version that went away: a clear error
            assert err.value.reason == "superseded"
            with pytest.raises(WeightSyncError) as err:
                client.fetch(1)  # and it is not served any more at all
            assert err.value.reason == "superseded"
        srv2 = RepublishingServer(chunk_bytes=1024).start()
        try:
            srv2.publish(version_dict(1), 1)
            with client_for(srv2) as client:
                version, got = client.fetch()  # latest: the consistent newer set
                assert version == 2
                assert_same(version_dict(2), got)
        finally:
            srv2.stop(0)
    finally:
        srv.stop(0)


def test_concurrent_fetches_while_publishing():
    srv = WeightSyncServer(chunk_bytes=2048, max_workers=4).start()
    srv.publish(version_dict(1), 1)
    results: list[tuple[int, dict]] = []
    errors: list[WeightSyncError] = []
    stop = threading.Event()

    def replica() -> None:
        with client_for(srv) as client:
            while not stop.is_set():
                try:
                    results.append(client.fetch(retries=5))
                except WeightSyncError as exc:
                    errors.append(exc)

    threads = [threading.Thread(target=replica) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        for version in range(2, 8):
            srv.publish(version_dict(version), version)
            threading.Event().wait(0.05)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        srv.stop(0)
    assert len(results) >= 3
    for version, got in results:  # every set is exactly one version
        assert_same(version_dict(version), got)
    assert all(e.reason == "superseded" for e in errors), [str(e) for e in errors]
    assert max(v for v, _ in results) >= 2


def test_lazy_publish_streams_from_provider(server):
    source = state_dict(seed=1)
    calls = []

    def provider():
        calls.append(1)
        return iter(source.items())

    manifest = server.publish_lazy(provider, 1)
    assert manifest.checksum and len(calls) == 1
    with client_for(server) as client:
        assert_same(source, client.fetch()[1])
        assert len(calls) == 2
        # the provider's bytes changed after publishing: the fetch must fail, not mix
        source["embed.weight"].add_(1.0)
        with pytest.raises(WeightSyncError) as err:
            client.fetch()
        assert err.value.reason == "checksum"
        # with specs nothing is read at publish; the last chunk's checksum is authoritative
        specs = [(k, v.dtype, tuple(v.shape)) for k, v in source.items()]
        manifest = server.publish_lazy(provider, 2, specs=specs)
        assert manifest.checksum == "" and len(calls) == 3
        assert_same(source, client.fetch()[1])
        # a provider that no longer matches its manifest aborts the stream
        server.publish_lazy(lambda: iter(list(source.items())[1:]), 3, specs=specs)
        with pytest.raises(WeightSyncError) as err:
            client.fetch()
        assert err.value.reason == "corrupt"


def test_iterable_publish_for_bucketed_gathering(server):
    source = state_dict(seed=2)
    server.publish(((name, tensor) for name, tensor in source.items()), 1)
    with client_for(server) as client:
        assert_same(source, client.fetch()[1])


@settings(max_examples=60, deadline=None)
@given(
    version=st.integers(0, 2**63),
    offset=st.integers(0, 2**40),
    data=st.binary(max_size=300),
    name=st.text(max_size=20),
    tensor_offset=st.integers(0, 2**40),
    checksum=st.text(alphabet="0123456789abcdef", max_size=64),
    last=st.booleans(),
    with_manifest=st.booleans(),
)
def test_hand_encoded_chunk_matches_protobuf(
    version, offset, data, name, tensor_offset, checksum, last, with_manifest
):
    manifest = pb.Manifest(
        version=version, total_bytes=offset, checksum=checksum, checksum_algo="sha256",
        tensors=[pb.TensorSpec(name="a", dtype="bfloat16", shape=[2, 3], nbytes=12)],
    ) if with_manifest else None
    pieces = [memoryview(data[:7]), memoryview(data[7:])]
    encoded = wire.encode_chunk(
        version=version, offset=offset, pieces=pieces, name=name, tensor_offset=tensor_offset,
        manifest=manifest.SerializeToString() if manifest else b"", checksum=checksum, last=last,
    )
    reference = pb.Chunk(
        version=version, offset=offset, data=data, name=name, tensor_offset=tensor_offset,
        checksum=checksum, last=last, manifest=manifest,
    )
    assert pb.Chunk.FromString(encoded) == reference
    decoded = wire.decode_chunk(reference.SerializeToString())
    assert (decoded.version, decoded.offset, bytes(decoded.data), decoded.name) == (
        version, offset, data, name)
    assert (decoded.tensor_offset, decoded.checksum, decoded.last) == (tensor_offset, checksum, last)
    assert decoded.manifest == manifest


def test_garbage_chunk_raises_weight_sync_error():
    for raw in (b"\x1a\xff\xff\xff\xff\x0f", b"\x08", b"\x0f\x00"):
        with pytest.raises(WeightSyncError):
            wire.decode_chunk(raw)


def test_message_limits_follow_chunk_size():
    srv = WeightSyncServer(chunk_bytes=64 << 10).start()
    try:
        # a client whose message limit is below the server's chunks refuses, naming the setting
        srv.publish(version_dict(1), 1)
        with client_for(srv, max_message_bytes=512 << 10) as client:
            with pytest.raises(WeightSyncError) as err:
                client.fetch()
            assert err.value.reason == "manifest" and "max_message_bytes" in str(err.value)
        # a manifest that cannot fit one message is refused at publish, not at fetch
        many = {f"t{i:05d}." + "x" * 200: torch.zeros(1) for i in range(8000)}
        with pytest.raises(ValueError, match="raise chunk_bytes"):
            srv.publish(many, 2)
        with client_for(srv) as client:  # the version before the failed publish still serves
            assert client.get_version()[0] == 1
            assert_same(version_dict(1), client.fetch()[1])
    finally:
        srv.stop(0)
