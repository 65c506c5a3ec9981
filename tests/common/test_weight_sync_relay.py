"""Relay fan-out of weights over real gRPC on loopback (docs/weight_sync.md "Relays").

Replicas relay what they receive to the next receiver, chunk by chunk, so the learner sends
each byte about once; each receiver still checks every chunk against the learner's digests and
the whole stream's checksum, a dead relay costs its children a resumed stream, and relays ask
for the same bearer token as the learner.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from services.common.weight_sync import WeightSyncClient, WeightSyncError, WeightSyncServer
from services.common.weight_sync.client import RELAY_FAILOVERS
from services.common.weight_sync.fanout import FanoutPlan
from services.common.weight_sync.relay import WeightRelay
from tests.conftest import import_or_skip

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64 << 10


def weights(version: int, kib: int = 1024) -> dict[str, torch.Tensor]:
    """Every element is the version (a mix of versions shows), in two dtypes and a small
    tensor that shares a chunk with its neighbours."""
    return {
        "a": torch.full((kib << 8,), float(version)),  # kib KiB of float32
        "b": torch.full((1001,), float(version), dtype=torch.bfloat16),
        "c": torch.full((kib << 7,), float(version)),
    }


def assert_version(tensors: dict[str, torch.Tensor], version: int) -> None:
    assert set(tensors) == {"a", "b", "c"}
    for name, tensor in tensors.items():
        assert bool((tensor == version).all()), name
    assert tensors["b"].dtype == torch.bfloat16


def stream_bytes(server: WeightSyncServer) -> int:
    """Serialized bytes of one full fetch of what `server` serves (to compare bytes_sent)."""
    snapshot = server._current
    return sum(len(m) for m in server._encode_chunks(snapshot))


def relay_client(learner: WeightSyncServer, relay: WeightRelay | None, **kw) -> WeightSyncClient:
    kw.setdefault("timeout_s", 10)
    kw.setdefault("fetch_timeout_s", 60)
    return WeightSyncClient(learner.address, tune_malloc=False, relays=True, relay=relay, **kw)


def fetch_all(clients: list[WeightSyncClient], version: int | None = None) -> list[object]:
    """Fetch on every client at once (threads); returns (version, tensors) or the exception."""
    results: list[object] = [None] * len(clients)

    def run(i: int) -> None:
        try:
            results[i] = clients[i].fetch(version)
        except Exception as exc:  # noqa: BLE001 - reported through results
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_plan_is_a_chain_and_reroutes_around_a_failed_relay():
    plan = FanoutPlan(fanout=1)
    assert plan.locate(1, "a", "A") == ""  # the first receiver: the learner
    assert plan.locate(1, "b", "B") == "A"
    assert plan.locate(1, "c", "C") == "B"
    assert plan.locate(1, "leaf", "") == "C"  # no relay of its own: can only be a leaf
    assert plan.locate(1, "d", "D") == ""  # C is full (one child), A and B too: a new chain
    assert plan.locate(1, "c", "C", failed=["B"]) == "A"  # B died: C re-attaches upstream
    plan.locate(1, "b", done=True)
    assert plan.locate(1, "e", "E") == "D"  # the earliest with room (B died, C and the leaf fill A and C)
    assert plan.locate(2, "a", "A") == ""  # a new version starts a new list
    tree = FanoutPlan(fanout=2)
    # a binary tree filled level by level: A feeds B and C, B feeds D and E, C feeds F
    assert [tree.locate(1, x, x.upper()) for x in "abcdef"] == ["", "A", "A", "B", "B", "C"]
    off = FanoutPlan(enabled=False)
    assert [off.locate(1, x, x.upper()) for x in "abc"] == ["", "", ""]


def test_a_version_reaches_every_relay_with_one_copy_from_the_learner():
    learner = WeightSyncServer(chunk_bytes=CHUNK).start()
    relays = [WeightRelay().start() for _ in range(4)]
    clients = [relay_client(learner, r) for r in relays]
    try:
        learner.publish(weights(1), 1)
        one_copy = stream_bytes(learner)
        results = fetch_all(clients)
        for result in results:
            assert not isinstance(result, Exception), result
            version, tensors = result
            assert version == 1
            assert_version(tensors, 1)
        # Each receiver had exactly one source, and the learner sent about one copy.
        members = learner.fanout.snapshot()["members"]
        parents = sorted(m["parent"] for m in members.values())
        assert parents.count("") == 1, members
        assert all(m["done"] for m in members.values())
        assert learner.bytes_sent <= 1.05 * one_copy, (learner.bytes_sent, one_copy)
        assert sum(r.server.bytes_sent for r in relays) >= 2.9 * one_copy
        # A second version goes the same way, and a late receiver is served by a relay.
        learner.publish(weights(2), 2)
        sent_before = learner.bytes_sent
        results = fetch_all(clients)
        assert all(r[0] == 2 for r in results)
        late = relay_client(learner, None)
        version, tensors = late.fetch()
        assert version == 2
        assert_version(tensors, 2)
        assert learner.bytes_sent - sent_before <= 1.05 * stream_bytes(learner)
        late.close()
    finally:
        for c in clients:
            c.close()
        for r in relays:
            r.stop()
        learner.stop(0)


def test_direct_pull_when_relays_are_off():
    learner = WeightSyncServer(chunk_bytes=CHUNK, relay=False).start()
    relays = [WeightRelay().start() for _ in range(3)]
    clients = [relay_client(learner, r) for r in relays]
    try:
        learner.publish(weights(1, kib=256), 1)
        results = fetch_all(clients)
        assert all(r[0] == 1 for r in results), results
        assert learner.bytes_sent >= 2.9 * stream_bytes(learner)  # every receiver from it
        assert all(r.server.bytes_sent == 0 for r in relays)
    finally:
        for c in clients:
            c.close()
        for r in relays:
            r.stop()
        learner.stop(0)


RELAY_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from services.common.weight_sync import WeightSyncClient
    from services.common.weight_sync.relay import WeightRelay
    relay = WeightRelay(token={token!r}).start()
    print(relay.address, flush=True)
    # A slow receiver (and so a slow relay): 40 ms per message.
    client = WeightSyncClient({learner!r}, token={token!r}, relays=True, relay=relay,
                              tune_malloc=False, pace=lambda n: time.sleep(0.04))
    client.fetch()
    print("done", flush=True)
    time.sleep(60)
""")


def start_relay_process(learner: WeightSyncServer, token: str | None) -> tuple[subprocess.Popen, str]:
    code = RELAY_CHILD.format(root=str(ROOT), token=token, learner=learner.address)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    address = proc.stdout.readline().strip()
    assert address, "the relay process did not start"
    return proc, address


def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_relay_killed_mid_stream_costs_its_children_a_resume():
    learner = WeightSyncServer(chunk_bytes=CHUNK).start()
    proc = None
    mine = [WeightRelay().start() for _ in range(2)]
    clients = [relay_client(learner, r) for r in mine]
    try:
        learner.publish(weights(3), 3)  # 1.5 MiB: 25 chunks, ~1 s through the slow relay
        one_copy = stream_bytes(learner)
        proc, address = start_relay_process(learner, None)
        wait_for(lambda: any(m["relay"] == address for m in
                             learner.fanout.snapshot()["members"].values()))
        failovers = RELAY_FAILOVERS.labels("unavailable")._value.get()
        results: list[object] = []
        fetchers = threading.Thread(target=lambda: results.extend(fetch_all(clients)))
        fetchers.start()
        # One of mine reads from the slow relay, the other from that one (a chain, whichever
        # asked first): kill the relay mid-stream.
        wait_for(lambda: len(learner.fanout.snapshot()["members"]) == 3)
        parents = {m["relay"]: m["parent"]
                   for m in learner.fanout.snapshot()["members"].values()}
        child = next(r for r in mine if parents[r.address] == address)
        grandchild = next(r for r in mine if r is not child)
        assert parents[grandchild.address] == child.address
        wait_for(lambda: child._buffer is not None and child._buffer.available > 3 * CHUNK)
        assert child._buffer.available < learner._current.manifest.total_bytes
        proc.send_signal(signal.SIGKILL)
        fetchers.join(timeout=60)
        assert len(results) == 2
        for result in results:
            assert not isinstance(result, Exception), result
            version, tensors = result
            assert version == 3
            assert_version(tensors, 3)
        assert RELAY_FAILOVERS.labels("unavailable")._value.get() >= failovers + 1
        # Child 0 went on from where it was: the learner sent the dead relay's part and the
        # rest once, not a whole second copy for each child.
        assert learner.bytes_sent <= 2.05 * one_copy
        snapshot = learner.fanout.snapshot()
        assert address in snapshot["dead"]
        parents = {m["relay"]: m["parent"] for m in snapshot["members"].values()}
        assert parents[child.address] == ""  # went on from the learner
        assert parents[grandchild.address] == child.address  # never noticed: no retry
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        for c in clients:
            c.close()
        for r in mine:
            r.stop()
        learner.stop(0)


def test_a_bad_chunk_from_a_relay_is_detected_and_fetched_again_elsewhere():
    learner = WeightSyncServer(chunk_bytes=CHUNK).start()
    bad = WeightRelay().start()
    good = WeightRelay().start()
    original = bad.server._encode_chunks

    def corrupt(snapshot, *args):
        for i, message in enumerate(original(snapshot, *args)):
            if i == 5:  # a data chunk: flip one payload byte
                message = bytearray(message)
                message[-100] ^= 0x10
                message = bytes(message)
            yield message

    bad.server._encode_chunks = corrupt
    try:
        learner.publish(weights(4), 4)
        with relay_client(learner, bad) as first:
            assert first.fetch()[0] == 4  # the bad relay holds v4 (and serves it corrupted)
        failures = RELAY_FAILOVERS.labels("checksum")._value.get()
        with relay_client(learner, good) as child:
            version, tensors = child.fetch()
        assert version == 4
        assert_version(tensors, 4)
        assert RELAY_FAILOVERS.labels("checksum")._value.get() == failures + 1
        assert bad.address in learner.fanout.snapshot()["dead"]
        # A relay whose own copy changed after it was verified refuses to forward it.
        good._buffer._regions[0][1][10] ^= 0xFF
        corrupt_before = RELAY_FAILOVERS.labels("corrupt")._value.get()
        with relay_client(learner, None) as leaf:
            version, tensors = leaf.fetch()
        assert_version(tensors, 4)
        assert RELAY_FAILOVERS.labels("corrupt")._value.get() == corrupt_before + 1
    finally:
        bad.stop()
        good.stop()
        learner.stop(0)


def test_without_chunk_digests_a_bad_relay_costs_a_fresh_start_elsewhere():
    """publish_lazy with specs knows no bytes at publish, so its manifest has no chunk digests:
    a bad chunk shows only in the whole stream's checksum, and then the receiver starts over
    from another source instead of resuming on bytes it cannot repair."""
    learner = WeightSyncServer(chunk_bytes=CHUNK).start()
    bad = WeightRelay().start()
    good = WeightRelay().start()
    original = bad.server._encode_chunks

    def corrupt(snapshot, *args):
        for i, message in enumerate(original(snapshot, *args)):
            if i == 3:
                message = bytearray(message)
                message[-7] ^= 0x01
                message = bytes(message)
            yield message

    bad.server._encode_chunks = corrupt
    try:
        source = weights(6, kib=256)
        specs = [(name, t.dtype, t.shape) for name, t in source.items()]
        manifest = learner.publish_lazy(lambda: iter(source.items()), 6, specs=specs)
        assert not manifest.chunk_digests and not manifest.checksum
        with relay_client(learner, bad) as first:
            assert first.fetch()[0] == 6
        failures = RELAY_FAILOVERS.labels("checksum")._value.get()
        sent = learner.bytes_sent
        with relay_client(learner, good) as child:
            version, tensors = child.fetch()
        assert version == 6
        assert_version(tensors, 6)
        assert RELAY_FAILOVERS.labels("checksum")._value.get() == failures + 1
        assert learner.bytes_sent - sent >= 0.95 * stream_bytes(learner)  # a whole new copy
    finally:
        bad.stop()
        good.stop()
        learner.stop(0)


def test_relays_require_the_learners_token():
    learner = WeightSyncServer(chunk_bytes=CHUNK, token="s3cret").start()
    relay = WeightRelay(token="s3cret").start()
    try:
        learner.publish(weights(5, kib=128), 5)
        with relay_client(learner, relay, token="s3cret") as holder:
            assert holder.fetch()[0] == 5
        with WeightSyncClient(relay.address, tune_malloc=False, timeout_s=5) as stranger, \
                pytest.raises(WeightSyncError) as err:
            stranger.fetch(5)
        assert err.value.reason == "auth"
        with WeightSyncClient(relay.address, token="wrong", tune_malloc=False,
                              timeout_s=5) as stranger, pytest.raises(WeightSyncError) as err:
            stranger.fetch(5)
        assert err.value.reason == "auth"
        with WeightSyncClient(relay.address, token="s3cret", tune_malloc=False,
                              timeout_s=5) as friend:
            version, tensors = friend.fetch(5)
        assert version == 5
        assert tensors["a"].shape == (128 << 8,)
    finally:
        relay.stop()
        learner.stop(0)


def test_relays_over_tls_from_the_config_keys(tmp_path):
    """The learner and two relays serve TLS with the files docker-compose.yml's environment
    names (the keys the deploy files set); replicas verify both with the CA (relays by the name
    that environment gives) and still send the token."""
    import_or_skip("cryptography", "the TLS tests make their certificates with it")
    import shutil

    import yaml

    from services.common.config import ConfigError, load_config
    from services.common.weight_sync.settings import (
        relay_plan,
        replica_client,
        server_kwargs,
        start_relay,
    )
    from tests.common.tls_certs import make_certs

    certs = make_certs(tmp_path)  # ca.crt, and a server certificate for 127.0.0.1, localhost
    # the compose secrets' files, here: the CA, and the test's server pair for learner and relay
    files = {"tls-ca": certs["ca"].cert}
    for name in ("learner", "relay"):
        files[f"tls-{name}-cert"] = shutil.copy(certs["server"].cert, tmp_path / f"{name}.crt")
        files[f"tls-{name}-key"] = shutil.copy(certs["server"].key, tmp_path / f"{name}.key")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    environ = {key: str(files.get(value.removeprefix("/run/secrets/"), value))
               for key, value in compose["x-tls-env"].items() if "WEIGHT" in key}
    assert len(environ) == 6, environ  # the learner's three files, the relay's two and its name
    environ["FORAGE_WEIGHT_RELAY_TLS_NAME"] = "localhost"  # what the test certificate names
    cfg = load_config(None, [f"learner.weight_sync_chunk_bytes={CHUNK}",
                             "learner.weight_sync_token=s3cret"], environ=environ)
    half = load_config(None, [f"learner.{k}=x" for k in (
        "weight_sync_tls_cert_file", "weight_sync_tls_key_file", "weight_sync_tls_ca_file")],
        environ={})
    with pytest.raises(ConfigError, match="rollout.weight_relay_tls_cert_file"):
        relay_plan(half.rollout, half.learner)  # relays on, the CA set, no relay certificate
    learner = WeightSyncServer(**server_kwargs(cfg.learner)).start()
    plan = relay_plan(cfg.rollout, cfg.learner)
    relays = [start_relay(plan, "s3cret") for _ in range(2)]
    clients = [replica_client(learner.address, "s3cret", plan, r, tune_malloc=False,
                              timeout_s=10, fetch_timeout_s=60) for r in relays]
    try:
        assert learner.tls is not None and all(r.server.tls is not None for r in relays)
        learner.publish(weights(1, kib=256), 1)
        for result in fetch_all(clients):
            assert not isinstance(result, Exception), result
            assert_version(result[1], 1)
        assert learner.bytes_sent <= 1.05 * stream_bytes(learner)  # the second one via a relay
        with WeightSyncClient(relays[0].address, token="s3cret", tune_malloc=False,
                              timeout_s=5) as plain, pytest.raises(WeightSyncError) as err:
            plain.fetch(1)
        assert "learner.weight_sync_tls_ca_file" in str(err.value)
        # a relay certificate that does not carry the name checked: the relays fail (tls) and
        # the fetch goes on from the learner
        failures = RELAY_FAILOVERS.labels("tls")._value.get()
        with replica_client(learner.address, "s3cret", {**plan, "tls_name": "other.example"},
                            None, tune_malloc=False, timeout_s=10) as late:
            assert_version(late.fetch()[1], 1)
        assert RELAY_FAILOVERS.labels("tls")._value.get() > failures
    finally:
        for c in clients:
            c.close()
        for r in relays:
            r.stop()
        learner.stop(0)


# ----------------------------------------------------------------- configuration


def test_config_keys_set_the_servers_limits_and_the_relay_mode():
    import grpc

    from services.common.config import load_config
    from services.common.proto_gen.forage import weight_sync_pb2 as pb
    from services.common.weight_sync import wire
    from services.common.weight_sync.settings import relay_plan, server_kwargs, start_relay

    default = load_config()
    kwargs = server_kwargs(default.learner)
    server = WeightSyncServer(**kwargs)
    assert (server.max_fetches, server.max_fetches_per_peer) == (14, 7)  # as before
    assert server.fanout.enabled and server.fanout.fanout == 1
    assert relay_plan(default.rollout)["relays"] is True
    server.stop(0)

    cfg = load_config(overrides=[
        "learner.weight_sync_max_fetches=40", "learner.weight_sync_max_fetches_per_peer=1",
        "learner.weight_sync_relay=off", "learner.weight_sync_relay_fanout=3",
        "rollout.weight_relay=off"])
    kwargs = server_kwargs(cfg.learner)
    assert kwargs["max_workers"] == 42  # threads follow the fetch cap
    server = WeightSyncServer(**{**kwargs, "chunk_bytes": CHUNK}).start()
    channel = grpc.insecure_channel(server.address)
    try:
        assert (server.max_fetches, server.max_fetches_per_peer) == (40, 1)
        assert not server.fanout.enabled and server.fanout.fanout == 3
        server.publish(weights(1, kib=4096), 1)
        # One stream from this address that never reads holds the only per-peer slot.
        held = channel.unary_stream(wire.FETCH_METHOD,
                                    request_serializer=pb.FetchRequest.SerializeToString)(
            pb.FetchRequest(), timeout=60)
        wait_for(lambda: len(server._streams) == 1)
        with WeightSyncClient(server.address, tune_malloc=False, timeout_s=0.5) as client, \
                pytest.raises(WeightSyncError) as err:
            client.fetch()
        assert err.value.reason == "busy"
        held.cancel()
        plan = relay_plan(cfg.rollout)
        assert plan["relays"] is False and start_relay(plan, None) is None
    finally:
        channel.close()
        server.stop(0)
