"""AsyncRedisStreams: the same behaviour as RedisStreams, through redis.asyncio."""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest
import redis
import redis.asyncio as aioredis

from services.common.config import load_config
from services.common.redis_server import start_embedded_redis
from services.common.streams import (
    MAX_DELIVERIES_REASON,
    BackpressureTimeout,
    RedisStreams,
    StreamConnectionError,
)
from services.common.streams_async import AsyncRedisStreams


def run(coro):
    return asyncio.run(coro)


def public(cls) -> set[str]:
    return {n for n, v in vars(cls).items() if not n.startswith("_") and callable(v)}


def test_same_public_methods_and_signatures():
    assert public(AsyncRedisStreams) == public(RedisStreams)
    for name in public(RedisStreams) - {"from_config"}:
        sync_sig = inspect.signature(getattr(RedisStreams, name))
        async_sig = inspect.signature(getattr(AsyncRedisStreams, name))
        assert list(sync_sig.parameters) == list(async_sig.parameters), name
        if name not in ("key", "lease"):  # lease returns an async context manager
            assert inspect.iscoroutinefunction(getattr(AsyncRedisStreams, name)), name


def test_round_trip_reclaim_and_dead_letter(redis_url, namespace):
    async def body() -> None:
        s = AsyncRedisStreams(aioredis.Redis.from_url(redis_url), namespace,
                              visibility_timeout_s=0.2, max_deliveries=2)
        await s.ensure_group("rollouts")
        ids = await s.publish_many("rollouts", [b"a", b"b", b"c"])
        assert await s.lag("rollouts") == 3
        assert await s.last_delivered("rollouts") == "0-0"
        first = await s.consume("rollouts", "x", count=2, block_ms=50)
        assert [m.payload for m in first] == [b"a", b"b"] and [m.id for m in first] == ids[:2]
        assert await s.last_delivered("rollouts") == ids[1]  # the group's clock source
        assert await s.has_entry("rollouts", ids[2]) and not await s.has_entry("rollouts", "1-1")
        assert await s.last_delivered("prompts") is None  # no such stream
        assert await s.ack("rollouts", [first[0].id]) == 1
        assert await s.pending("rollouts") == 1
        await asyncio.sleep(0.25)
        second = await s.consume("rollouts", "y", count=5, block_ms=50)
        assert [(m.payload, m.deliveries) for m in second] == [(b"b", 2), (b"c", 1)]
        await s.ack("rollouts", [second[1].id])
        await asyncio.sleep(0.25)
        assert await s.consume("rollouts", "z", count=5, block_ms=50) == []
        [dead] = await s.dead_letters()
        assert (dead["id"], dead["reason"], dead["deliveries"]) == (
            ids[1], MAX_DELIVERIES_REASON, 3)
        assert await s.lag("rollouts") == 0
        await s.publish("scored", b"q")
        [m] = await s.consume("scored", "l", count=1, block_ms=50)
        await s.dead_letter("scored", m, "unknown schema 'x'")
        assert (await s.dead_letters())[-1]["reason"] == "unknown schema 'x'"
        assert await s.pending("scored") == 0
        await s.close()

    run(body())


def test_async_backpressure(redis_url, namespace):
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        s = AsyncRedisStreams(client, namespace, stream_maxlen=3, backpressure_timeout_s=5)
        await s.ensure_group("prompts")
        await s.publish_many("prompts", [b"1", b"2", b"3"])
        fail = AsyncRedisStreams(client, namespace, stream_maxlen=3, backpressure="fail")
        with pytest.raises(BackpressureTimeout, match="holds 3"):
            await fail.publish("prompts", b"4")

        async def drain() -> None:
            await asyncio.sleep(0.4)
            msgs = await s.consume("prompts", "r", count=1, block_ms=50)
            await s.ack("prompts", [m.id for m in msgs])

        started = time.monotonic()
        _, ids = await asyncio.gather(drain(), s.publish_many("prompts", [b"4"]))
        assert len(ids) == 1 and time.monotonic() - started > 0.35
        await client.aclose()

    run(body())


def test_async_from_config_and_give_up(redis_url, namespace):
    async def body() -> None:
        cfg = load_config(overrides=[f"redis.url={redis_url}", f"redis.namespace={namespace}"])
        async with AsyncRedisStreams.from_config(cfg.redis) as s:
            assert await s.publish("prompts", b"x")
            assert await s.lag("prompts") == 1

        server = start_embedded_redis()
        s = AsyncRedisStreams(aioredis.Redis.from_url(server.url, socket_connect_timeout=0.5),
                              namespace, retry_attempts=2, retry_backoff_s=0.01)
        server.stop()
        with pytest.raises(StreamConnectionError, match="no connection after 2"):
            await s.publish("prompts", b"x")
        with pytest.raises(redis.ConnectionError):
            await s.lag("prompts")
        await s.close()

    run(body())
