"""Weight sync against failed publishes and hostile clients, real gRPC on loopback (issue 14,
items 4 and 6).

- A publish that raises leaves the version that was serving serving, and a fetch while a
  publish is under way gets the old version at once.
- Clients that open Fetch and never read (raw gRPC calls, no client library) hold a worker
  thread each on a thread-pool server: they must not keep a legitimate replica from its
  weights, nor GetVersion from answering.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from services.common.proto_gen.forage import weight_sync_pb2 as pb
from services.common.weight_sync import WeightSyncClient, WeightSyncError, WeightSyncServer, wire
from services.common.weight_sync.server import FETCHES, peer_host

torch.set_num_threads(1)


def weights(version: int, mib: int = 1) -> dict[str, torch.Tensor]:
    return {"w": torch.full((mib << 18,), float(version)), "b": torch.full((7,), float(version))}


def assert_version(tensors: dict[str, torch.Tensor], version: int) -> None:
    assert set(tensors) == {"w", "b"}
    assert all(bool((t == version).all()) for t in tensors.values())


def client_for(server: WeightSyncServer, **kw) -> WeightSyncClient:
    kw.setdefault("timeout_s", 10)
    kw.setdefault("fetch_timeout_s", 30)
    return WeightSyncClient(server.address, tune_malloc=False, **kw)


# ----------------------------------------------------------------- item 4: failed publishes


def test_a_failed_publish_leaves_the_old_version_serving():
    server = WeightSyncServer(chunk_bytes=64 << 10).start()
    try:
        server.publish(weights(1), 1)
        oversized = {f"t{i:05d}." + "x" * 200: torch.zeros(1) for i in range(8000)}
        with pytest.raises(ValueError, match="raise chunk_bytes"):
            server.publish(oversized, 2)  # its manifest does not fit one message
        with pytest.raises(ValueError, match="cannot carry dtype"):
            server.publish({"z": torch.zeros(2, dtype=torch.complex64)}, 2)
        with pytest.raises(ValueError, match="cannot carry dtype"):
            server.publish_lazy(lambda: iter([("z", torch.zeros(2, dtype=torch.complex64))]), 2)
        with client_for(server) as client:
            version, manifest = client.get_version()
            assert version == 1 and manifest.tensors
            got_version, tensors = client.fetch()
            assert got_version == 1
            assert_version(tensors, 1)
            server.publish(weights(2), 2)  # a failed number is not burnt: 2 can be published
            assert client.fetch()[0] == 2
    finally:
        server.stop(0)


def test_a_fetch_during_a_publish_gets_the_old_version_at_once():
    server = WeightSyncServer(chunk_bytes=64 << 10).start()
    release = threading.Event()
    entered = threading.Event()

    def slow_gather():  # a ZeRO-3 learner gathering bucket by bucket
        yield "w", torch.full((1 << 18,), 2.0)
        entered.set()
        release.wait(30)
        yield "b", torch.full((7,), 2.0)

    try:
        server.publish(weights(1), 1)
        publisher = threading.Thread(target=server.publish, args=(slow_gather(), 2))
        publisher.start()
        assert entered.wait(10)
        started = time.monotonic()
        with client_for(server) as client:
            version, tensors = client.fetch()
            assert version == 1 and time.monotonic() - started < 5
            assert_version(tensors, 1)
            release.set()
            publisher.join(10)
            assert client.fetch()[0] == 2
    finally:
        release.set()
        server.stop(0)


# ----------------------------------------------------------------- item 6: stalled readers


def stall(server: WeightSyncServer, count: int) -> list[tuple[grpc.Channel, object]]:
    """`count` raw clients, each on its own connection, that open Fetch and never read."""
    calls = []
    for _ in range(count):
        channel = grpc.insecure_channel(server.address)
        fetch = channel.unary_stream(wire.FETCH_METHOD,
                                     request_serializer=pb.FetchRequest.SerializeToString)
        calls.append((channel, fetch(pb.FetchRequest(), timeout=120)))
    return calls


def close(calls) -> None:
    for channel, call in calls:
        call.cancel()
        channel.close()


def test_four_clients_that_stop_reading_do_not_block_others_with_default_settings():
    """The reported case: four stalled readers took all four threads; a fetch waited 110 s."""
    server = WeightSyncServer(chunk_bytes=1 << 20).start()
    calls = []
    try:
        server.publish(weights(1, mib=16), 1)
        calls = stall(server, 4)
        time.sleep(1.0)  # their streams are now blocked on full windows
        started = time.monotonic()
        with client_for(server, timeout_s=5) as client:
            assert client.get_version()[0] == 1
            assert time.monotonic() - started < 2
            version, tensors = client.fetch()
            assert version == 1
            assert_version(tensors, 1)
        assert time.monotonic() - started < 10
    finally:
        close(calls)
        server.stop(0)


def test_stalled_streams_are_cancelled_and_a_fetch_completes_within_a_bound():
    """More stalled readers than fetch slots: the legitimate fetch is answered 'busy' and
    retried until the watchdog cancels stalled streams (stall_timeout_s), then completes."""
    stall_s = 1.5
    server = WeightSyncServer(chunk_bytes=1 << 20, max_workers=6,
                              stall_timeout_s=stall_s).start()
    calls = []
    before = FETCHES.labels("stalled")._value.get()
    try:
        server.publish(weights(1, mib=16), 1)
        calls = stall(server, 12)  # 4 fetch slots, 2 per peer: most are refused 'busy'
        time.sleep(0.5)
        started = time.monotonic()
        with client_for(server, timeout_s=30) as client:
            assert client.get_version()[0] == 1  # GetVersion keeps a thread
            assert time.monotonic() - started < 2
            version, tensors = client.fetch()
        waited = time.monotonic() - started
        assert version == 1
        assert_version(tensors, 1)
        assert waited < stall_s + 10, waited
        assert FETCHES.labels("stalled")._value.get() - before >= 1
        codes = set()
        for _channel, call in calls:
            try:
                for _ in call:
                    pass
            except grpc.RpcError as exc:
                codes.add(exc.code())
        assert codes <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert grpc.StatusCode.CANCELLED in codes
    finally:
        close(calls)
        server.stop(0)


def test_a_busy_server_says_so_and_the_client_waits_for_a_slot():
    server = WeightSyncServer(chunk_bytes=1 << 20, max_workers=3, max_fetches=1,
                              stall_timeout_s=60).start()
    calls = []
    try:
        server.publish(weights(1, mib=16), 1)
        calls = stall(server, 1)
        time.sleep(0.5)
        with client_for(server, timeout_s=1.0) as client:
            started = time.monotonic()
            with pytest.raises(WeightSyncError) as err:
                client.fetch()
            assert err.value.reason == "busy" and "max_fetches=1" in str(err.value)
            assert 0.9 < time.monotonic() - started < 5  # retried until timeout_s
            close(calls)
            calls = []
            assert client.fetch()[0] == 1
    finally:
        close(calls)
        server.stop(0)


def test_peer_host_drops_the_port():
    assert peer_host("ipv4:10.0.0.3:51234") == "ipv4:10.0.0.3"
    assert peer_host("ipv6:[::1]:5") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_workers"):
        WeightSyncServer(max_workers=1)
    with pytest.raises(ValueError, match="stall_timeout_s"):
        WeightSyncServer(stall_timeout_s=0)
    server = WeightSyncServer(max_workers=4, max_fetches=10)
    assert (server.max_fetches, server.max_fetches_per_peer) == (3, 1)
    server.stop(0)
