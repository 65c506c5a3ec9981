"""The streams of docs/architecture.md over redis.asyncio: `RedisStreams`' methods as coroutines.

Only the I/O differs from the sync class; keys, the publish script, reply parsing, the reclaim
split, dead-letter fields and the retry schedule are the shared helpers of `streams`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import redis
import redis.asyncio as aioredis

from services.common.streams import (
    ACKED,
    BACKPRESSURE_WAIT,
    CONSUMER_GROUPS,
    DEAD,
    DEAD_LETTERS,
    DELIVERED,
    MAX_DELIVERIES_REASON,
    PUBLISHED,
    RETRYABLE,
    TRIMMED_REASON,
    BackpressureTimeout,
    StreamMessage,
    StreamsBase,
    backoff_delay,
    chunks,
    dead_fields,
    default_group,
    full_message,
    group_backlog,
    group_last_delivered,
    is_nogroup,
    lease_interval,
    new_messages,
    parse_autoclaim,
    parse_dead,
    parse_publish_reply,
    parse_read,
    parse_renewal,
    pending_counts,
    split_claimed,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger("forage.streams")

T = TypeVar("T")


class AsyncRedisStreams(StreamsBase):
    """`RedisStreams` for asyncio services; same arguments, same semantics."""

    _client_class = aioredis.Redis

    async def _retry(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        s = self.settings
        for attempt in range(s.retry_attempts):
            try:
                return await fn()
            except redis.AuthenticationError:
                raise  # wrong credentials stay wrong: no point retrying them
            except RETRYABLE as exc:
                if attempt + 1 >= s.retry_attempts:
                    raise s.give_up(op, exc) from exc
                delay = backoff_delay(attempt, s.retry_backoff_s, s.retry_backoff_max_s)
                s.retry_log(op, attempt, exc, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    # -------------------------------------------------------------- producing

    async def publish(self, kind: str, payload: bytes) -> str:
        return (await self.publish_many(kind, [payload]))[0]

    async def publish_many(self, kind: str, payloads: list[bytes]) -> list[str]:
        key = self.key(kind)
        group = CONSUMER_GROUPS.get(kind, "")
        ids: list[str] = []
        for batch in chunks(list(payloads), self.settings.stream_maxlen):
            ids.extend(await self._publish_batch(kind, key, group, batch))
        return ids

    async def _publish_batch(
        self, kind: str, key: str, group: str, batch: list[bytes]
    ) -> list[str]:
        s = self.settings
        args = [group, s.stream_maxlen, s.trim, *batch]
        started = time.monotonic()
        delay = 0.01
        warned = False
        while True:
            reply = await self._retry(
                f"publish {key}", lambda: self._publish(keys=[key], args=args)
            )
            added, backlog, ids = parse_publish_reply(reply)
            if added:
                PUBLISHED.labels(kind).inc(len(ids))
                if warned:
                    BACKPRESSURE_WAIT.labels(kind).inc(time.monotonic() - started)
                return ids
            message = full_message(key, backlog, len(batch), s.stream_maxlen, s.backpressure)
            waited = time.monotonic() - started
            if s.backpressure == "fail" or waited >= s.backpressure_timeout_s:
                BACKPRESSURE_WAIT.labels(kind).inc(waited)
                if s.backpressure == "block":
                    message += f"; waited {waited:.1f}s (backpressure_timeout_s)"
                raise BackpressureTimeout(message)
            if not warned:
                log.warning("%s; producer waits", message)
                warned = True
            await asyncio.sleep(min(delay, max(0.0, s.backpressure_timeout_s - waited)))
            delay = min(delay * 2, 0.5)

    # -------------------------------------------------------------- consuming

    async def ensure_group(self, kind: str, group: str | None = None) -> None:
        key, group = self.key(kind), default_group(kind, group)

        async def create() -> None:
            try:
                await self.client.xgroup_create(key, group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

        await self._retry(f"ensure_group {key}", create)
        self._groups_ready.add((key, group))

    async def _with_group(
        self, kind: str, group: str, op: str, fn: Callable[[], Awaitable[T]]
    ) -> T:
        key = self.key(kind)
        if (key, group) not in self._groups_ready:
            await self.ensure_group(kind, group)
        try:
            return await self._retry(op, fn)
        except redis.ResponseError as exc:
            if not is_nogroup(exc):
                raise
            log.warning("group %s on %s is gone (Redis restarted?); creating it again", group, key)
            self._groups_ready.discard((key, group))
            await self.ensure_group(kind, group)
            return await self._retry(op, fn)

    async def consume(
        self,
        kind: str,
        consumer: str,
        *,
        count: int = 16,
        block_ms: int = 1000,
        group: str | None = None,
    ) -> list[StreamMessage]:
        key, group = self.key(kind), default_group(kind, group)
        messages = await self._reclaim(kind, key, group, consumer, count)
        want = count - len(messages)
        if want > 0:
            block = None if messages or block_ms <= 0 else block_ms  # Redis: 0 = forever
            reply = await self._with_group(
                kind, group, f"consume {key}",
                lambda: self.client.xreadgroup(group, consumer, {key: ">"}, count=want,
                                               block=block),
            )
            fresh = new_messages(key, parse_read(reply))
            DELIVERED.labels(kind, "new").inc(len(fresh))
            messages.extend(fresh)
        return messages

    async def _reclaim(
        self, kind: str, key: str, group: str, consumer: str, count: int
    ) -> list[StreamMessage]:
        s = self.settings
        cursor = self._cursors.get((key, group), "0-0")
        reply = await self._with_group(
            kind, group, f"reclaim {key}",
            lambda: self.client.xautoclaim(key, group, consumer, s.min_idle_ms, cursor,
                                           count=count),
        )
        cursor, claimed, deleted, unknown = parse_autoclaim(reply)
        self._cursors[(key, group)] = cursor
        for entry_id in deleted:
            log.error("pending message %s on %s was trimmed before it was acked", entry_id, key)
            await self.dead_letter(kind, StreamMessage(key, entry_id, b"", 0), TRIMMED_REASON,
                                   group=group)
        if unknown:
            log.error("%d pending messages on %s were trimmed before they were acked "
                      "(Redis 6.2 does not say which)", unknown, key)
        if not claimed:
            return []
        ids = [entry_id for entry_id, _ in claimed]

        async def counts() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for entry_id in ids:
                pipe.xpending_range(key, group, entry_id, entry_id, 1)
            return await pipe.execute()

        deliver, dead = split_claimed(
            key, claimed, pending_counts(await self._retry(f"xpending {key}", counts)),
            s.max_deliveries,
        )
        for message in dead:
            log.error(
                "message %s on %s delivered %d times (max %d): dead-lettering",
                message.id, key, message.deliveries, s.max_deliveries,
            )
            await self.dead_letter(kind, message, MAX_DELIVERIES_REASON, group=group)
        if deliver:
            log.info("reclaimed %d messages idle > %.1fs on %s for %s",
                     len(deliver), s.visibility_timeout_s, key, consumer)
        DELIVERED.labels(kind, "reclaimed").inc(len(deliver))
        return deliver

    async def keep_alive(
        self, kind: str, consumer: str, ids: list[str], group: str | None = None
    ) -> int:
        """See `RedisStreams.keep_alive`: renews only the ids `consumer` still owns."""
        return len((await self.renew(kind, consumer, ids, group))[0])

    async def renew(
        self, kind: str, consumer: str, ids: list[str], group: str | None = None
    ) -> tuple[list[str], list[str]]:
        if not ids:
            return [], []
        key, group = self.key(kind), default_group(kind, group)
        reply = await self._retry(
            f"keep_alive {key}",
            lambda: self._keep_alive(keys=[key], args=[group, consumer, *ids]),
        )
        return parse_renewal(reply)

    def lease(
        self, kind: str, consumer: str, ids: list[str], group: str | None = None,
        interval_s: float | None = None,
    ) -> AsyncLease:
        """`async with streams.lease(...) as lease:` — `streams.Lease` as an asyncio task."""
        return AsyncLease(self, kind, consumer, ids, group, interval_s)

    async def ack(self, kind: str, ids: list[str], group: str | None = None) -> int:
        if not ids:
            return 0
        key, group = self.key(kind), default_group(kind, group)
        acked = int(await self._retry(f"ack {key}", lambda: self.client.xack(key, group, *ids)))
        ACKED.labels(kind).inc(acked)
        return acked

    async def dead_letter(
        self, kind: str, message: StreamMessage, reason: str, group: str | None = None
    ) -> None:
        key, group = self.key(kind), default_group(kind, group)
        fields = dead_fields(key, kind, group, message, reason)

        async def write() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.xadd(self.key(DEAD), fields, maxlen=self.settings.trim, approximate=True)
            pipe.xack(key, group, message.id)
            await pipe.execute()

        await self._retry(f"dead_letter {key}", write)
        DEAD_LETTERS.labels(kind).inc()
        log.warning("dead-lettered %s from %s (group %s): %s", message.id, key, group, reason)

    # -------------------------------------------------------------- inspection

    async def lag(self, kind: str, group: str | None = None) -> int:
        key, group = self.key(kind), default_group(kind, group)

        async def read() -> tuple[list[dict], int]:
            xlen = await self.client.xlen(key)
            exists = xlen or await self.client.exists(key)
            return (await self.client.xinfo_groups(key) if exists else []), xlen

        infos, xlen = await self._retry(f"xinfo {key}", read)
        return group_backlog(infos, group, xlen)[1]

    async def last_delivered(self, kind: str, group: str | None = None) -> str | None:
        """See RedisStreams.last_delivered."""
        key, group = self.key(kind), default_group(kind, group)

        async def read() -> list[dict]:
            return await self.client.xinfo_groups(key) if await self.client.exists(key) else []

        try:
            infos = await self._retry(f"xinfo {key}", read)
        except redis.ResponseError:
            return None
        return group_last_delivered(infos, group)

    async def has_entry(self, kind: str, entry_id: str) -> bool:
        """See RedisStreams.has_entry."""
        key = self.key(kind)
        return bool(await self._retry(f"xrange {key}", lambda: self.client.xrange(
            key, min=entry_id, max=entry_id, count=1)))

    async def pending(self, kind: str, group: str | None = None) -> int:
        key, group = self.key(kind), default_group(kind, group)
        try:
            summary = await self._retry(
                f"xpending {key}", lambda: self.client.xpending(key, group)
            )
        except redis.ResponseError as exc:
            if is_nogroup(exc):
                return 0
            raise
        return int(summary["pending"])

    async def dead_letters(self, count: int = 100) -> list[dict]:
        key = self.key(DEAD)
        entries = await self._retry(f"xrange {key}", lambda: self.client.xrange(key, count=count))
        return parse_dead(entries)

    async def close(self) -> None:
        await self.client.aclose()
        if self.server is not None:
            self.server.stop()
            self.server = None

    async def __aenter__(self) -> AsyncRedisStreams:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncLease:
    """`streams.Lease` for asyncio: a task renews the ids until the `async with` block ends."""

    def __init__(
        self, streams: AsyncRedisStreams, kind: str, consumer: str, ids: list[str],
        group: str | None = None, interval_s: float | None = None,
    ) -> None:
        self.streams = streams
        self.kind = kind
        self.consumer = consumer
        self.group = group
        self.interval_s = interval_s or lease_interval(streams.settings.visibility_timeout_s)
        self.lost: set[str] = set()
        self.renewals = 0
        self.ids = list(dict.fromkeys(ids))
        self._task: asyncio.Task | None = None

    def release(self, ids: list[str]) -> None:
        done = set(ids)
        self.ids = [i for i in self.ids if i not in done]

    async def renew_now(self) -> list[str]:
        ids = list(self.ids)
        if not ids:
            return []
        kept, taken = await self.streams.renew(self.kind, self.consumer, ids, self.group)
        self.renewals += 1
        if taken:
            log.warning("lease on %s: %d message(s) were reclaimed by another consumer: %s",
                        self.streams.key(self.kind), len(taken), taken[:5])
            self.lost.update(taken)
        self.release([i for i in ids if i not in kept])
        return kept

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.renew_now()
            except Exception as exc:  # keep renewing; see streams.Lease
                log.warning("lease renewal on %s failed: %s", self.streams.key(self.kind), exc)

    async def __aenter__(self) -> AsyncLease:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
