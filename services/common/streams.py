"""Redis streams between the services (docs/architecture.md), synchronous API; docs/streams.md.

Delivery is at least once. A consumer reads in its consumer group and acks after its output is
written; a message left pending by a dead consumer is reclaimed (XAUTOCLAIM) once it has been
idle for `visibility_timeout_s`; a message delivered more than `max_deliveries` times, or one a
consumer cannot decode, goes to `{ns}:dead` with the reason. Nothing is dropped silently.

Producers apply backpressure: the check "unconsumed entries + new ones <= stream_maxlen" and
the XADDs run in one Lua script, so it is exact even with many producers. XADD also trims at
`MAXLEN ~ 2*stream_maxlen`; since backpressure keeps the unconsumed entries below
`stream_maxlen`, the trim only ever removes entries every group has already read.

The pure parts (keys, the Lua script, reply parsing, the reclaim split, the retry schedule)
live here and are shared by `streams_async.AsyncRedisStreams`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from prometheus_client import Counter

if TYPE_CHECKING:
    from services.common.config.redis import RedisSection
    from services.common.redis_server import RedisServer

log = logging.getLogger("forage.streams")

STREAM_KINDS = ("prompts", "rollouts", "scored")
DEAD = "dead"
CONSUMER_GROUPS = {"prompts": "rollout", "rollouts": "scorer", "scored": "learner"}
PAYLOAD_FIELD = b"payload"
# XADD trims at MAXLEN ~ TRIM_FACTOR * stream_maxlen: a memory bound that backpressure keeps
# above every unconsumed entry.
TRIM_FACTOR = 2
MAX_DELIVERIES_REASON = "max deliveries exceeded"
TRIMMED_REASON = "trimmed from the stream before it was acked"

# Errors worth retrying: the connection dropped, timed out, or Redis is still loading.
RETRYABLE = (redis.ConnectionError, redis.TimeoutError)

PUBLISHED = Counter("forage_streams_published_total", "entries added", ["stream"])
DELIVERED = Counter(
    "forage_streams_delivered_total", "entries handed to consumers", ["stream", "source"]
)
ACKED = Counter("forage_streams_acked_total", "entries acked", ["stream"])
DEAD_LETTERS = Counter("forage_streams_dead_letters_total", "entries dead-lettered", ["stream"])
BACKPRESSURE_WAIT = Counter(
    "forage_streams_backpressure_wait_seconds_total", "time producers waited on a full stream",
    ["stream"],
)
RETRIES = Counter("forage_streams_connection_retries_total", "retried operations", ["op"])


class BackpressureTimeout(RuntimeError):
    """A stream is over its bound: the producer waited too long, or the mode is "fail"."""


class StreamConnectionError(redis.ConnectionError):
    """Redis stayed unreachable through every retry of one operation."""


@dataclass
class StreamMessage:
    stream: str  # the stream key, e.g. "forage:prompts"
    id: str
    # None when the entry has no `payload` field (written by something other than publish);
    # the codec says so in the dead-letter reason instead of "empty payload".
    payload: bytes | None
    deliveries: int  # 1 on first delivery; XPENDING's count after a reclaim


# ------------------------------------------------------------------ pure helpers

# Atomic backpressure check + XADD. KEYS[1] = stream; ARGV = group, cap, trim bound, payloads.
# Returns {1, backlog, id, ...} when the payloads were added, {0, backlog} when they do not fit.
# Backlog = entries not yet acked by the measured group: lag + pending from XINFO GROUPS
# (Redis >= 7, bounded by XLEN), else (Redis 6.2 has no lag) XLEN after trimming exactly the
# entries every group has acked. With no group yet, all of XLEN.
PUBLISH_LUA = r"""
local key = KEYS[1]
local want = ARGV[1]
local cap = tonumber(ARGV[2])
local trim = ARGV[3]
local n = #ARGV - 3

local function parse_id(id)
  local dash = string.find(id, '-', 1, true)
  return tonumber(string.sub(id, 1, dash - 1)), tonumber(string.sub(id, dash + 1))
end
local function id_less(a, b)
  local am, as = parse_id(a)
  local bm, bs = parse_id(b)
  return am < bm or (am == bm and as < bs)
end

local xlen = redis.call('XLEN', key)
local backlog = xlen
if xlen > 0 then
  local groups = redis.call('XINFO', 'GROUPS', key)
  local found, chosen, worst, any_nil = false, nil, nil, false
  for _, raw in ipairs(groups) do
    local g = {}
    for i = 1, #raw, 2 do g[raw[i]] = raw[i + 1] end
    local b = nil
    if type(g['lag']) == 'number' then b = math.min(g['lag'] + g['pending'], xlen) end
    if g['name'] == want then found, chosen = true, b end
    if b == nil then any_nil = true elseif worst == nil or b > worst then worst = b end
  end
  local needs_fallback = (found and chosen == nil) or ((not found) and any_nil)
  if #groups > 0 then
    if needs_fallback then
      -- No lag (Redis 6.2): drop what every group has acked, then count what is left.
      local safe = nil
      for _, raw in ipairs(groups) do
        local g = {}
        for i = 1, #raw, 2 do g[raw[i]] = raw[i + 1] end
        local bound
        if g['pending'] > 0 then
          bound = redis.call('XPENDING', key, g['name'])[2]
        else
          local ms, seq = parse_id(g['last-delivered-id'])
          bound = string.format('%.0f-%.0f', ms, seq + 1)
        end
        if safe == nil or id_less(bound, safe) then safe = bound end
      end
      redis.call('XTRIM', key, 'MINID', safe)
      backlog = redis.call('XLEN', key)
    elseif found then
      backlog = chosen
    else
      backlog = worst
    end
  end
end
if backlog + n > cap then
  return {0, backlog}
end
local out = {1, backlog}
for i = 4, #ARGV do
  out[#out + 1] = redis.call('XADD', key, 'MAXLEN', '~', trim, '*', 'payload', ARGV[i])
end
return out
"""


# Lease renewal: reset the idle time of the ids this consumer still owns (XCLAIM ... JUSTID
# does not count a delivery), atomically with the ownership check, so a renewal can never take
# a message back from a consumer that reclaimed it. KEYS[1] = stream; ARGV = group, consumer,
# ids. Returns {renewed ids, ids another consumer owns}; acked ids are in neither.
KEEP_ALIVE_LUA = r"""
local kept, taken = {}, {}
for i = 3, #ARGV do
  local entry = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)[1]
  if entry then
    if entry[2] == ARGV[2] then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
      kept[#kept + 1] = ARGV[i]
    else
      taken[#taken + 1] = ARGV[i]
    end
  end
end
return {kept, taken}
"""


def parse_renewal(reply: list[Any]) -> tuple[list[str], list[str]]:
    kept, taken = reply
    return [text(i) for i in kept or []], [text(i) for i in taken or []]


def lease_interval(visibility_timeout_s: float) -> float:
    """How often a lease renews: three times per visibility timeout, so two renewals in a row
    can fail (a Redis blip, a long GC pause) before another consumer may reclaim."""
    return max(0.05, visibility_timeout_s / 3)


def parse_stream_id(entry_id: str) -> tuple[int, int]:
    """A stream entry id `ms-seq` as a pair that orders like Redis orders ids."""
    ms, _, seq = str(entry_id).partition("-")
    return int(ms), int(seq or 0)


def delivered(entry_id: str, last_delivered_id: str | None) -> bool:
    """Whether a consumer group whose last-delivered-id is `last_delivered_id` has handed the
    entry `entry_id` to one of its consumers (ids only grow, and a group reads in id order)."""
    if last_delivered_id is None:
        return False
    return parse_stream_id(entry_id) <= parse_stream_id(last_delivered_id)


def stream_key(namespace: str, kind: str) -> str:
    if kind not in STREAM_KINDS and kind != DEAD:
        raise ValueError(f"unknown stream kind {kind!r}; expected one of {STREAM_KINDS + (DEAD,)}")
    return f"{namespace}:{kind}"


def default_group(kind: str, group: str | None) -> str:
    if group is not None:
        return group
    if kind not in CONSUMER_GROUPS:
        raise ValueError(f"stream kind {kind!r} has no consumer group; name one")
    return CONSUMER_GROUPS[kind]


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def chunks(payloads: list[bytes], size: int) -> Iterator[list[bytes]]:
    """Batches no larger than the cap: a batch bigger than the cap could never fit."""
    for start in range(0, len(payloads), size):
        yield payloads[start : start + size]


def parse_publish_reply(reply: list[Any]) -> tuple[bool, int, list[str]]:
    return bool(int(reply[0])), int(reply[1]), [text(i) for i in reply[2:]]


def full_message(key: str, backlog: int, n: int, cap: int, mode: str) -> str:
    return (
        f"stream {key} holds {backlog} unconsumed entries; {n} more would exceed "
        f"redis.stream_maxlen={cap} (backpressure={mode})"
    )


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Delay before retry `attempt` (0-based): base * 2**attempt, capped."""
    return min(max_s, base_s * (2**attempt))


def is_nogroup(exc: BaseException) -> bool:
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("NOGROUP")


def parse_autoclaim(reply: list[Any]) -> tuple[str, list[tuple[str, dict]], list[str], int]:
    """XAUTOCLAIM's reply as (next cursor, live entries, ids trimmed away, unknown trimmed).

    Redis 7 lists the ids of pending entries that were trimmed (and drops them from the PEL);
    Redis 6.2 returns a nil entry instead, whose id is lost: only counted.
    """
    cursor = text(reply[0])
    entries: list[tuple[str, dict]] = []
    unknown = 0
    for entry_id, fields in reply[1] or []:
        if entry_id is None:
            unknown += 1
        else:
            entries.append((text(entry_id), fields or {}))
    deleted = [text(i) for i in reply[2]] if len(reply) > 2 and reply[2] else []
    return cursor, entries, deleted, unknown


def parse_read(reply: Any) -> list[tuple[str, dict]]:
    """XREADGROUP's reply for one stream as (id, fields) pairs."""
    out: list[tuple[str, dict]] = []
    if not reply:
        return out
    if isinstance(reply, dict):  # RESP3
        streams = reply.values()
    else:
        streams = [entries for _, entries in reply]
    for entries in streams:
        for entry in entries:
            if isinstance(entry[1], list) and entry[1] and isinstance(entry[1][0], list):
                entry = (entry[0], entry[1][0])  # RESP3 nests the fields
            out.append((text(entry[0]), entry[1] or {}))
    return out


def split_claimed(
    key: str, claimed: list[tuple[str, dict]], counts: dict[str, int], max_deliveries: int
) -> tuple[list[StreamMessage], list[StreamMessage]]:
    """Reclaimed entries as (to deliver, to dead-letter for too many deliveries)."""
    deliver: list[StreamMessage] = []
    dead: list[StreamMessage] = []
    for entry_id, fields in claimed:
        message = StreamMessage(
            stream=key,
            id=entry_id,
            payload=fields.get(PAYLOAD_FIELD),
            deliveries=counts.get(entry_id, 1),
        )
        (dead if message.deliveries > max_deliveries else deliver).append(message)
    return deliver, dead


def new_messages(key: str, entries: list[tuple[str, dict]]) -> list[StreamMessage]:
    return [
        StreamMessage(stream=key, id=i, payload=f.get(PAYLOAD_FIELD), deliveries=1)
        for i, f in entries
    ]


def pending_counts(replies: list[Any]) -> dict[str, int]:
    """Per-id delivery counts from one `XPENDING key group id id 1` reply per id."""
    counts: dict[str, int] = {}
    for reply in replies:
        for item in reply or []:
            counts[text(item["message_id"])] = int(item["times_delivered"])
    return counts


def dead_fields(
    key: str, kind: str, group: str, message: StreamMessage, reason: str
) -> dict[str, Any]:
    return {
        "stream": key,
        "kind": kind,
        "group": group,
        "id": message.id,
        "payload": b"" if message.payload is None else message.payload,
        "reason": reason,
        "deliveries": str(message.deliveries),
        "ts": f"{time.time():.3f}",
    }


def parse_dead(entries: list[tuple[Any, dict]]) -> list[dict]:
    out = []
    for dead_id, fields in entries:
        get = {text(k): v for k, v in fields.items()}
        out.append(
            {
                "dead_id": text(dead_id),
                "stream": text(get.get("stream", b"")),
                "kind": text(get.get("kind", b"")),
                "group": text(get.get("group", b"")),
                "id": text(get.get("id", b"")),
                "payload": bytes(get.get("payload", b"")),
                "reason": text(get.get("reason", b"")),
                "deliveries": int(get.get("deliveries", 0)),
                "ts": float(get.get("ts", 0.0)),
            }
        )
    return out


def group_backlog(infos: list[dict], group: str, xlen: int) -> tuple[bool, int]:
    """(group exists, lag + pending) from XINFO GROUPS; XLEN bounds a lag that overcounts."""
    for info in infos:
        if text(info["name"]) == group:
            lag = info.get("lag")
            if lag is None:
                return True, xlen
            return True, min(int(lag) + int(info["pending"]), xlen)
    return False, xlen


@dataclass(frozen=True)
class Settings:
    """Everything both APIs need besides the client, validated once."""

    namespace: str = "forage"
    stream_maxlen: int = 100_000
    backpressure: str = "block"
    backpressure_timeout_s: float = 300.0
    visibility_timeout_s: float = 120.0
    max_deliveries: int = 3
    retry_attempts: int = 8
    retry_backoff_s: float = 0.1
    retry_backoff_max_s: float = 5.0

    def __post_init__(self) -> None:
        if self.backpressure not in ("block", "fail"):
            raise ValueError(f"backpressure must be 'block' or 'fail', got {self.backpressure!r}")
        if self.stream_maxlen < 1 or self.max_deliveries < 1 or self.retry_attempts < 1:
            raise ValueError("stream_maxlen, max_deliveries and retry_attempts must be >= 1")

    @property
    def trim(self) -> int:
        return TRIM_FACTOR * self.stream_maxlen

    @property
    def min_idle_ms(self) -> int:
        return max(0, int(self.visibility_timeout_s * 1000))

    def retry_log(self, op: str, attempt: int, exc: BaseException, delay: float) -> None:
        RETRIES.labels(op).inc()
        log.warning(
            "redis %s failed (%s: %s); retry %d/%d in %.2fs",
            op, type(exc).__name__, exc, attempt + 1, self.retry_attempts - 1, delay,
        )

    def give_up(self, op: str, exc: BaseException) -> StreamConnectionError:
        log.error("redis %s failed %d times; giving up: %s", op, self.retry_attempts, exc)
        return StreamConnectionError(
            f"redis {op}: no connection after {self.retry_attempts} attempts ({exc})"
        )


def settings_from_config(cfg: RedisSection) -> dict[str, Any]:
    return {
        "namespace": cfg.namespace,
        "stream_maxlen": cfg.stream_maxlen,
        "backpressure": cfg.backpressure,
        "backpressure_timeout_s": cfg.backpressure_timeout_s,
        "visibility_timeout_s": cfg.visibility_timeout_s,
        "max_deliveries": cfg.max_deliveries,
        "retry_attempts": cfg.retry_attempts,
        "retry_backoff_s": cfg.retry_backoff_s,
        "retry_backoff_max_s": cfg.retry_backoff_max_s,
    }


def resolve_server(cfg: RedisSection) -> RedisServer:
    """The Redis a config points at: redis.url, REDIS_URL, the default, or an embedded one."""
    from services.common.redis_server import DEFAULT_URL, ensure_redis

    url = cfg.url or os.environ.get("REDIS_URL")
    return ensure_redis(url, allow_embedded=cfg.embedded,
                        options=auth_options(cfg, url or DEFAULT_URL))


def auth_options(cfg: RedisSection, url: str) -> dict[str, Any]:
    """Credentials and TLS for `url` (services/common/redis_connect.py)."""
    from services.common.redis_connect import connection_options

    return connection_options(cfg, url)


def connect(cfg: RedisSection, client_class: Any = redis.Redis) -> tuple[Any, RedisServer]:
    """A client of the Redis `cfg` names (credentials and TLS included; an embedded server
    needs neither) and that server."""
    server = resolve_server(cfg)
    options = {} if server.embedded else auth_options(cfg, server.url)
    return client_class.from_url(server.url, **client_options(cfg), **options), server


def client_options(cfg: RedisSection) -> dict[str, Any]:
    return {
        "socket_connect_timeout": 5.0,
        "socket_timeout": cfg.socket_timeout_s,
        "health_check_interval": 30,
    }


T = TypeVar("T")


# ------------------------------------------------------------------ sync API


_S = TypeVar("_S", bound="StreamsBase")


def group_last_delivered(infos: list[dict], group: str) -> str | None:
    """`group`'s last-delivered-id in an XINFO GROUPS reply (None: no such group)."""
    for info in infos:
        if text(info["name"]) == group:
            return text(info["last-delivered-id"])
    return None


class StreamsBase:
    """State and configuration shared by the sync and asyncio stream classes.

    Subclasses set `_client_class` (redis.Redis or redis.asyncio.Redis) and implement the I/O;
    everything here is plain state, so the two APIs cannot drift apart in how they are built.
    """

    _client_class: Any = redis.Redis

    def __init__(
        self,
        client: Any,
        namespace: str = "forage",
        *,
        stream_maxlen: int = 100_000,
        backpressure: str = "block",
        backpressure_timeout_s: float = 300.0,
        visibility_timeout_s: float = 120.0,
        max_deliveries: int = 3,
        retry_attempts: int = 8,
        retry_backoff_s: float = 0.1,
        retry_backoff_max_s: float = 5.0,
        server: RedisServer | None = None,
    ) -> None:
        self.client = client
        self.settings = Settings(
            namespace, stream_maxlen, backpressure, backpressure_timeout_s,
            visibility_timeout_s, max_deliveries, retry_attempts, retry_backoff_s,
            retry_backoff_max_s,
        )
        self.namespace = namespace
        self.server = server  # an embedded server this object started, stopped by close()
        self._publish = client.register_script(PUBLISH_LUA)
        self._keep_alive = client.register_script(KEEP_ALIVE_LUA)
        self._groups_ready: set[tuple[str, str]] = set()
        self._cursors: dict[tuple[str, str], str] = {}

    @classmethod
    def from_config(cls: type[_S], redis_cfg: RedisSection) -> _S:
        client, server = connect(redis_cfg, cls._client_class)
        return cls(
            client, **settings_from_config(redis_cfg), server=server if server.embedded else None
        )

    def key(self, kind: str) -> str:
        return stream_key(self.namespace, kind)


class RedisStreams(StreamsBase):
    """The four streams of one namespace over a redis-py client."""

    _client_class = redis.Redis

    # -------------------------------------------------------------- plumbing

    def _retry(self, op: str, fn: Callable[[], T]) -> T:
        s = self.settings
        for attempt in range(s.retry_attempts):
            try:
                return fn()
            except redis.AuthenticationError:
                raise  # wrong credentials stay wrong: no point retrying them
            except RETRYABLE as exc:
                if attempt + 1 >= s.retry_attempts:
                    raise s.give_up(op, exc) from exc
                delay = backoff_delay(attempt, s.retry_backoff_s, s.retry_backoff_max_s)
                s.retry_log(op, attempt, exc, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    # -------------------------------------------------------------- producing

    def publish(self, kind: str, payload: bytes) -> str:
        return self.publish_many(kind, [payload])[0]

    def publish_many(self, kind: str, payloads: list[bytes]) -> list[str]:
        """Add payloads in order; blocks (or fails) while the stream is over its bound."""
        key = self.key(kind)
        group = CONSUMER_GROUPS.get(kind, "")
        ids: list[str] = []
        for batch in chunks(list(payloads), self.settings.stream_maxlen):
            ids.extend(self._publish_batch(kind, key, group, batch))
        return ids

    def _publish_batch(self, kind: str, key: str, group: str, batch: list[bytes]) -> list[str]:
        s = self.settings
        args = [group, s.stream_maxlen, s.trim, *batch]
        started = time.monotonic()
        delay = 0.01
        warned = False
        while True:
            reply = self._retry(f"publish {key}", lambda: self._publish(keys=[key], args=args))
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
            time.sleep(min(delay, max(0.0, s.backpressure_timeout_s - waited)))
            delay = min(delay * 2, 0.5)

    # -------------------------------------------------------------- consuming

    def ensure_group(self, kind: str, group: str | None = None) -> None:
        key, group = self.key(kind), default_group(kind, group)

        def create() -> None:
            try:
                self.client.xgroup_create(key, group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

        self._retry(f"ensure_group {key}", create)
        self._groups_ready.add((key, group))

    def _with_group(self, kind: str, group: str, op: str, fn: Callable[[], T]) -> T:
        """Run fn; a group lost with a restarted, empty Redis is created again, once."""
        key = self.key(kind)
        if (key, group) not in self._groups_ready:
            self.ensure_group(kind, group)
        try:
            return self._retry(op, fn)
        except redis.ResponseError as exc:
            if not is_nogroup(exc):
                raise
            log.warning("group %s on %s is gone (Redis restarted?); creating it again", group, key)
            self._groups_ready.discard((key, group))
            self.ensure_group(kind, group)
            return self._retry(op, fn)

    def consume(
        self,
        kind: str,
        consumer: str,
        *,
        count: int = 16,
        block_ms: int = 1000,
        group: str | None = None,
    ) -> list[StreamMessage]:
        """Reclaimed messages first (idle past the visibility timeout), then new ones."""
        key, group = self.key(kind), default_group(kind, group)
        messages = self._reclaim(kind, key, group, consumer, count)
        want = count - len(messages)
        if want > 0:
            block = None if messages or block_ms <= 0 else block_ms  # Redis: 0 = forever
            reply = self._with_group(
                kind, group, f"consume {key}",
                lambda: self.client.xreadgroup(group, consumer, {key: ">"}, count=want,
                                               block=block),
            )
            fresh = new_messages(key, parse_read(reply))
            DELIVERED.labels(kind, "new").inc(len(fresh))
            messages.extend(fresh)
        return messages

    def _reclaim(
        self, kind: str, key: str, group: str, consumer: str, count: int
    ) -> list[StreamMessage]:
        s = self.settings
        cursor = self._cursors.get((key, group), "0-0")
        reply = self._with_group(
            kind, group, f"reclaim {key}",
            lambda: self.client.xautoclaim(key, group, consumer, s.min_idle_ms, cursor,
                                           count=count),
        )
        cursor, claimed, deleted, unknown = parse_autoclaim(reply)
        self._cursors[(key, group)] = cursor
        self._report_trimmed(kind, key, group, deleted, unknown)
        if not claimed:
            return []
        ids = [entry_id for entry_id, _ in claimed]

        def counts() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for entry_id in ids:
                pipe.xpending_range(key, group, entry_id, entry_id, 1)
            return pipe.execute()

        deliver, dead = split_claimed(
            key, claimed, pending_counts(self._retry(f"xpending {key}", counts)),
            s.max_deliveries,
        )
        for message in dead:
            log.error(
                "message %s on %s delivered %d times (max %d): dead-lettering",
                message.id, key, message.deliveries, s.max_deliveries,
            )
            self.dead_letter(kind, message, MAX_DELIVERIES_REASON, group=group)
        if deliver:
            log.info("reclaimed %d messages idle > %.1fs on %s for %s",
                     len(deliver), s.visibility_timeout_s, key, consumer)
        DELIVERED.labels(kind, "reclaimed").inc(len(deliver))
        return deliver

    def _report_trimmed(
        self, kind: str, key: str, group: str, deleted: list[str], unknown: int
    ) -> None:
        """Pending entries that a trim removed: recorded in the dead stream, never silent."""
        for entry_id in deleted:
            log.error("pending message %s on %s was trimmed before it was acked", entry_id, key)
            message = StreamMessage(key, entry_id, b"", 0)
            self.dead_letter(kind, message, TRIMMED_REASON, group=group)
        if unknown:
            log.error("%d pending messages on %s were trimmed before they were acked "
                      "(Redis 6.2 does not say which)", unknown, key)

    def keep_alive(
        self, kind: str, consumer: str, ids: list[str], group: str | None = None
    ) -> int:
        """Reset the idle time of messages `consumer` is still working on, so none is reclaimed.

        Only ids `consumer` still owns are renewed (one Lua script: an id another consumer has
        reclaimed stays theirs); it does not count a delivery. Returns how many were renewed.
        Work that may outlast the visibility timeout holds a `lease` instead of calling this.
        """
        return len(self.renew(kind, consumer, ids, group)[0])

    def renew(
        self, kind: str, consumer: str, ids: list[str], group: str | None = None
    ) -> tuple[list[str], list[str]]:
        """`keep_alive`, returning (ids renewed, ids another consumer owns now)."""
        if not ids:
            return [], []
        key, group = self.key(kind), default_group(kind, group)
        reply = self._retry(
            f"keep_alive {key}",
            lambda: self._keep_alive(keys=[key], args=[group, consumer, *ids]),
        )
        return parse_renewal(reply)

    def lease(
        self, kind: str, consumer: str, ids: list[str], group: str | None = None,
        interval_s: float | None = None,
    ) -> Lease:
        """A started `Lease` on `ids`: use as `with streams.lease(...) as lease: work()`."""
        return Lease(self, kind, consumer, ids, group, interval_s).start()

    def ack(self, kind: str, ids: list[str], group: str | None = None) -> int:
        if not ids:
            return 0
        key, group = self.key(kind), default_group(kind, group)
        acked = int(self._retry(f"ack {key}", lambda: self.client.xack(key, group, *ids)))
        ACKED.labels(kind).inc(acked)
        return acked

    def dead_letter(
        self, kind: str, message: StreamMessage, reason: str, group: str | None = None
    ) -> None:
        """Record the message and the reason in {ns}:dead and ack it, in one MULTI."""
        key, group = self.key(kind), default_group(kind, group)
        fields = dead_fields(key, kind, group, message, reason)

        def write() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.xadd(self.key(DEAD), fields, maxlen=self.settings.trim, approximate=True)
            pipe.xack(key, group, message.id)
            pipe.execute()

        self._retry(f"dead_letter {key}", write)
        DEAD_LETTERS.labels(kind).inc()
        log.warning("dead-lettered %s from %s (group %s): %s", message.id, key, group, reason)

    # -------------------------------------------------------------- inspection

    def _group_backlog(self, kind: str, group: str | None) -> tuple[bool, int]:
        key, group = self.key(kind), default_group(kind, group)

        def read() -> tuple[list[dict], int]:
            xlen = self.client.xlen(key)
            return (self.client.xinfo_groups(key) if xlen or self.client.exists(key) else []), xlen

        infos, xlen = self._retry(f"xinfo {key}", read)
        return group_backlog(infos, group, xlen)

    def lag(self, kind: str, group: str | None = None) -> int:
        """Entries the group has not acked yet: undelivered + pending (all of XLEN if no group)."""
        return self._group_backlog(kind, group)[1]

    def last_delivered(self, kind: str, group: str | None = None) -> str | None:
        """The consumer group's last-delivered-id: every entry at or before it has been handed
        to a consumer (`delivered`). None when the stream or the group does not exist. The
        learner starts a group's clock from this (a replica took it), without any mark from
        the replicas."""
        key, group = self.key(kind), default_group(kind, group)

        def read() -> list[dict]:
            return self.client.xinfo_groups(key) if self.client.exists(key) else []

        try:
            infos = self._retry(f"xinfo {key}", read)
        except redis.ResponseError:
            return None
        return group_last_delivered(infos, group)

    def has_entry(self, kind: str, entry_id: str) -> bool:
        """Whether the stream still holds the entry (a Redis that restarted empty lost it)."""
        key = self.key(kind)
        return bool(self._retry(f"xrange {key}", lambda: self.client.xrange(
            key, min=entry_id, max=entry_id, count=1)))

    def pending(self, kind: str, group: str | None = None) -> int:
        key, group = self.key(kind), default_group(kind, group)
        try:
            summary = self._retry(f"xpending {key}", lambda: self.client.xpending(key, group))
        except redis.ResponseError as exc:
            if is_nogroup(exc):
                return 0
            raise
        return int(summary["pending"])

    def dead_letters(self, count: int = 100) -> list[dict]:
        key = self.key(DEAD)
        return parse_dead(self._retry(f"xrange {key}", lambda: self.client.xrange(key, count=count)))

    def close(self) -> None:
        self.client.close()
        if self.server is not None:
            self.server.stop()
            self.server = None

    def __enter__(self) -> RedisStreams:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Lease:
    """Keeps the messages a consumer works on from being reclaimed while it works.

    A daemon thread renews the ids every `interval_s` (default: a third of the visibility
    timeout) until `stop()`; `release(ids)` drops ids once they are acked or dead-lettered.
    Without it, work longer than `visibility_timeout_s` is reclaimed by another consumer and
    done twice. `lost` collects ids found owned by someone else (this consumer stalled past the
    timeout, e.g. SIGSTOP): at-least-once delivery still holds, the work may be repeated.
    A renewal that fails (Redis unreachable through every retry) is logged and tried again at
    the next tick; the worker itself notices an unreachable Redis on its next call.
    """

    def __init__(
        self, streams: RedisStreams, kind: str, consumer: str, ids: list[str],
        group: str | None = None, interval_s: float | None = None,
    ) -> None:
        self.streams = streams
        self.kind = kind
        self.consumer = consumer
        self.group = group
        self.interval_s = interval_s or lease_interval(streams.settings.visibility_timeout_s)
        self.lost: set[str] = set()
        self.renewals = 0
        self._ids = list(dict.fromkeys(ids))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Lease:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"lease-{self.kind}",
                                            daemon=True)
            self._thread.start()
        return self

    def add(self, ids: list[str]) -> None:
        """Lease more ids (a replica that takes new groups while it works on others)."""
        with self._lock:
            held = set(self._ids)
            self._ids.extend(i for i in dict.fromkeys(ids) if i not in held)

    def release(self, ids: list[str]) -> None:
        done = set(ids)
        with self._lock:
            self._ids = [i for i in self._ids if i not in done]

    @property
    def ids(self) -> list[str]:
        with self._lock:
            return list(self._ids)

    def renew_now(self) -> list[str]:
        """Renew once; returns the ids renewed (acked ones drop out silently)."""
        ids = self.ids
        if not ids:
            return []
        kept, taken = self.streams.renew(self.kind, self.consumer, ids, self.group)
        self.renewals += 1
        if taken:
            log.warning("lease on %s: %d message(s) were reclaimed by another consumer while "
                        "this one worked on them (stalled past visibility_timeout_s?): %s",
                        self.streams.key(self.kind), len(taken), taken[:5])
            self.lost.update(taken)
        self.release([i for i in ids if i not in kept])
        return kept

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.renew_now()
            except Exception as exc:  # keep renewing: a lapse here means work done twice
                log.warning("lease renewal on %s failed: %s", self.streams.key(self.kind), exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))

    def __enter__(self) -> Lease:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
