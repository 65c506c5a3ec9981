"""Streams against the real Redis: round trips, delivery counts, dead letters, backpressure."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from services.common.config import load_config
from services.common.streams import (
    CONSUMER_GROUPS,
    MAX_DELIVERIES_REASON,
    STREAM_KINDS,
    BackpressureTimeout,
    RedisStreams,
    StreamMessage,
)


@pytest.fixture()
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def make(client, namespace, **kw) -> RedisStreams:
    return RedisStreams(client, namespace, **kw)


def test_keys_and_groups(client, namespace):
    s = make(client, namespace)
    assert [s.key(k) for k in STREAM_KINDS] == [f"{namespace}:{k}" for k in STREAM_KINDS]
    assert s.key("dead") == f"{namespace}:dead"
    with pytest.raises(ValueError, match="unknown stream kind"):
        s.key("nope")
    for kind, group in CONSUMER_GROUPS.items():
        s.ensure_group(kind)
        s.ensure_group(kind)  # idempotent
        names = [g["name"].decode() for g in client.xinfo_groups(s.key(kind))]
        assert names == [group]


def test_publish_consume_ack_round_trip(client, namespace):
    s = make(client, namespace)
    s.ensure_group("rollouts")
    payloads = [bytes([i]) * (i + 1) for i in range(10)]
    ids = s.publish_many("rollouts", payloads[:9])
    ids.append(s.publish("rollouts", payloads[9]))
    assert len(ids) == len(set(ids)) == 10
    assert s.lag("rollouts") == 10 and s.pending("rollouts") == 0

    first = s.consume("rollouts", "a", count=4, block_ms=100)
    assert [m.payload for m in first] == payloads[:4]
    assert [m.id for m in first] == ids[:4]
    assert all(m.deliveries == 1 and m.stream == s.key("rollouts") for m in first)
    assert s.pending("rollouts") == 4 and s.lag("rollouts") == 10

    rest = s.consume("rollouts", "b", count=100, block_ms=100)
    assert [m.payload for m in rest] == payloads[4:]
    assert s.ack("rollouts", [m.id for m in first + rest]) == 10
    assert s.ack("rollouts", [first[0].id]) == 0  # a second ack acks nothing
    assert s.ack("rollouts", []) == 0
    assert s.pending("rollouts") == 0 and s.lag("rollouts") == 0
    assert s.consume("rollouts", "a", count=4, block_ms=50) == []


def test_consume_creates_missing_group_and_blocks_until_data(client, namespace):
    s = make(client, namespace)
    got: list[StreamMessage] = []
    reader = threading.Thread(
        target=lambda: got.extend(s.consume("scored", "l", count=5, block_ms=3000))
    )
    reader.start()
    time.sleep(0.3)
    make(redis.Redis(connection_pool=client.connection_pool), namespace).publish("scored", b"x")
    reader.join(5)
    assert [m.payload for m in got] == [b"x"]
    assert s.pending("scored", group="learner") == 1


def test_other_group_sees_everything(client, namespace):
    s = make(client, namespace)
    s.ensure_group("scored")
    s.ensure_group("scored", group="audit")
    s.publish_many("scored", [b"1", b"2"])
    assert len(s.consume("scored", "l", count=10, block_ms=50)) == 2
    audit = s.consume("scored", "x", count=10, block_ms=50, group="audit")
    assert [m.payload for m in audit] == [b"1", b"2"]
    assert s.ack("scored", [m.id for m in audit], group="audit") == 2
    assert s.pending("scored") == 2 and s.pending("scored", group="audit") == 0


def test_reclaim_counts_deliveries_then_dead_letters(client, namespace):
    s = make(client, namespace, visibility_timeout_s=0.5, max_deliveries=3)
    s.ensure_group("prompts")
    [mid] = s.publish_many("prompts", [b"poison"])
    seen = []
    for consumer in ("a", "b", "c"):
        [m] = s.consume("prompts", consumer, count=1, block_ms=50)
        seen.append(m.deliveries)
        assert m.id == mid
        # not acked: the consumer "crashed"; before the timeout nobody gets it
        assert s.consume("prompts", "other", count=1, block_ms=0) == []
        time.sleep(0.55)
    assert seen == [1, 2, 3]
    assert s.consume("prompts", "d", count=1, block_ms=50) == []  # 4th delivery: dead instead
    assert s.pending("prompts") == 0 and s.lag("prompts") == 0
    [dead] = s.dead_letters()
    assert dead["id"] == mid and dead["payload"] == b"poison"
    assert dead["reason"] == MAX_DELIVERIES_REASON
    assert dead["deliveries"] == 4
    assert dead["stream"] == s.key("prompts") and dead["group"] == "rollout"
    assert abs(dead["ts"] - time.time()) < 60


def test_explicit_dead_letter_keeps_reason_and_acks(client, namespace):
    s = make(client, namespace)
    s.ensure_group("rollouts")
    s.publish_many("rollouts", [b"\xc1garbage", b"fine"])
    bad, good = s.consume("rollouts", "scorer-1", count=2, block_ms=50)
    s.dead_letter("rollouts", bad, "not a msgpack payload: unpack(b) received extra data")
    assert s.pending("rollouts") == 1  # the poison one is acked, the good one still pending
    [dead] = s.dead_letters()
    assert dead["payload"] == b"\xc1garbage"
    assert dead["reason"].startswith("not a msgpack payload")
    assert dead["kind"] == "rollouts" and dead["group"] == "scorer" and dead["deliveries"] == 1
    assert s.ack("rollouts", [good.id]) == 1


def test_keep_alive_prevents_reclaim_without_counting(client, namespace):
    s = make(client, namespace, visibility_timeout_s=0.6)
    s.ensure_group("prompts")
    s.publish("prompts", b"long job")
    [m] = s.consume("prompts", "slow", count=1, block_ms=50)
    for _ in range(3):
        time.sleep(0.2)
        assert s.keep_alive("prompts", "slow", [m.id]) == 1
        assert s.consume("prompts", "thief", count=1, block_ms=1) == []
    time.sleep(0.65)
    [again] = s.consume("prompts", "thief", count=1, block_ms=1)
    assert again.id == m.id and again.deliveries == 2


def test_backpressure_fail_names_stream_and_size(client, namespace):
    s = make(client, namespace, stream_maxlen=5, backpressure="fail")
    s.publish_many("prompts", [b"x"] * 5)  # no group yet: XLEN counts
    with pytest.raises(BackpressureTimeout, match=rf"{namespace}:prompts holds 5 .*stream_maxlen=5"):
        s.publish("prompts", b"y")
    s.ensure_group("prompts")
    got = s.consume("prompts", "r", count=2, block_ms=50)
    with pytest.raises(BackpressureTimeout):  # delivered but pending still counts
        s.publish("prompts", b"y")
    s.ack("prompts", [m.id for m in got])
    s.publish_many("prompts", [b"y", b"z"])  # exactly at the cap again
    with pytest.raises(BackpressureTimeout):
        s.publish("prompts", b"w")
    assert s.lag("prompts") == 5


def test_backpressure_block_waits_for_consumer_then_times_out(client, namespace):
    s = make(client, namespace, stream_maxlen=4, backpressure="block", backpressure_timeout_s=5)
    s.ensure_group("rollouts")
    s.publish_many("rollouts", [b"a"] * 4)

    def drain() -> None:
        time.sleep(0.5)
        consumer = make(redis.Redis(connection_pool=client.connection_pool), namespace)
        msgs = consumer.consume("rollouts", "c", count=2, block_ms=50)
        consumer.ack("rollouts", [m.id for m in msgs])

    thread = threading.Thread(target=drain)
    thread.start()
    started = time.monotonic()
    s.publish_many("rollouts", [b"b", b"c"])
    waited = time.monotonic() - started
    thread.join()
    assert 0.4 < waited < 4.5
    assert s.lag("rollouts") == 4

    quick = make(client, namespace, stream_maxlen=4, backpressure_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(BackpressureTimeout, match="waited"):
        quick.publish("rollouts", b"d")
    assert 0.25 < time.monotonic() - started < 3


def test_batch_larger_than_cap_is_split_not_refused(client, namespace):
    s = make(client, namespace, stream_maxlen=3, backpressure="block", backpressure_timeout_s=5)
    s.ensure_group("scored")
    done: list[str] = []

    def drain() -> None:
        consumer = make(redis.Redis(connection_pool=client.connection_pool), namespace)
        seen = 0
        deadline = time.monotonic() + 5
        while seen < 7 and time.monotonic() < deadline:
            msgs = consumer.consume("scored", "c", count=3, block_ms=100)
            seen += consumer.ack("scored", [m.id for m in msgs])

    thread = threading.Thread(target=drain)
    thread.start()
    done = s.publish_many("scored", [str(i).encode() for i in range(7)])
    thread.join()
    assert len(done) == 7 and done == sorted(done, key=lambda i: tuple(map(int, i.split("-"))))


def test_trim_bound_never_drops_unconsumed(client, namespace):
    cap = 50
    s = make(client, namespace, stream_maxlen=cap, backpressure="fail")
    s.ensure_group("rollouts")
    received = []
    for round_ in range(12):  # 600 entries through a stream trimmed at ~100
        s.publish_many("rollouts", [f"{round_}-{i}".encode() for i in range(cap)])
        msgs = s.consume("rollouts", "c", count=cap, block_ms=50)
        assert s.ack("rollouts", [m.id for m in msgs]) == cap
        received += [m.payload for m in msgs]
    assert received == [f"{r}-{i}".encode() for r in range(12) for i in range(cap)]
    assert client.xlen(s.key("rollouts")) <= 2 * cap + 100  # ~ trimming: whole nodes


def test_from_config_uses_namespace_and_limits(redis_url, namespace):
    cfg = load_config(overrides=[
        f"redis.url={redis_url}", f"redis.namespace={namespace}", "redis.stream_maxlen=2",
        "redis.backpressure=fail", "redis.max_deliveries=5", "redis.retry_attempts=2",
    ])
    with RedisStreams.from_config(cfg.redis) as s:
        assert s.server is None  # a named Redis is never embedded
        assert s.key("prompts") == f"{namespace}:prompts"
        assert s.settings.max_deliveries == 5 and s.settings.retry_attempts == 2
        s.publish_many("prompts", [b"1", b"2"])
        with pytest.raises(BackpressureTimeout):
            s.publish("prompts", b"3")


def test_bad_settings_are_refused(client):
    with pytest.raises(ValueError, match="backpressure"):
        RedisStreams(client, backpressure="drop")
    with pytest.raises(ValueError, match="max_deliveries"):
        RedisStreams(client, max_deliveries=0)


def test_pure_helpers():
    from services.common.streams import (
        backoff_delay,
        chunks,
        parse_autoclaim,
        pending_counts,
        split_claimed,
    )

    assert [backoff_delay(k, 0.1, 1.0) for k in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert [len(c) for c in chunks([b"x"] * 7, 3)] == [3, 3, 1]
    # Redis 7: (cursor, entries, deleted ids); Redis 6.2: nil entries, no third element.
    r7 = [b"0-0", [(b"1-0", {b"payload": b"a"})], [b"0-5"]]
    assert parse_autoclaim(r7) == ("0-0", [("1-0", {b"payload": b"a"})], ["0-5"], 0)
    r62 = [b"3-0", [(None, None), (b"2-0", {b"payload": b"b"})]]
    assert parse_autoclaim(r62) == ("3-0", [("2-0", {b"payload": b"b"})], [], 1)
    counts = pending_counts([[{"message_id": b"1-0", "times_delivered": 4}], []])
    deliver, dead = split_claimed("k", [("1-0", {b"payload": b"a"}), ("2-0", {})], counts, 3)
    assert [(m.id, m.deliveries) for m in dead] == [("1-0", 4)]
    # An entry without a payload field says so (None), so its dead-letter reason can.
    assert [(m.id, m.payload, m.deliveries) for m in deliver] == [("2-0", None, 1)]
