"""Redis notice of a new policy version, so replicas fetch at once instead of on the next poll.

The learner calls `notify_new_version` after `publish`: it records the version under
`{ns}:weights:version` (a late replica reads it at start) and publishes it on the pub/sub
channel `{ns}:weights`. Pub/sub is fire-and-forget, so replicas still poll `GetVersion` now and
then; the notice only shortens the wait. The payload is the version as a decimal string.
"""

from __future__ import annotations

import time

import redis


def version_key(namespace: str) -> str:
    return f"{namespace}:weights:version"


def version_channel(namespace: str) -> str:
    return f"{namespace}:weights"


def notify_new_version(redis_client: redis.Redis, namespace: str, version: int) -> None:
    redis_client.set(version_key(namespace), int(version))
    redis_client.publish(version_channel(namespace), str(int(version)))


def _as_int(value: object) -> int | None:
    try:
        return int(value.decode() if isinstance(value, bytes) else value)  # type: ignore[arg-type]
    except (TypeError, ValueError, AttributeError):
        return None


class VersionListener:
    """Waits for version notices newer than the last one it returned."""

    def __init__(self, redis_client: redis.Redis, namespace: str, seen: int = 0) -> None:
        self._client = redis_client
        self._namespace = namespace
        self.seen = seen
        self._pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(version_channel(namespace))

    def latest(self) -> int:
        """The last version the learner announced (0 if none), from the key."""
        return _as_int(self._client.get(version_key(self._namespace))) or 0

    def wait(self, timeout_s: float = 1.0) -> int | None:
        """A version newer than `seen` announced by now or within `timeout_s`, else None."""
        deadline = time.monotonic() + timeout_s
        newest = self.latest()  # covers notices sent before we subscribed
        while newest <= self.seen:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            message = self._pubsub.get_message(timeout=remaining)
            if message and message.get("type") == "message":
                newest = max(newest, _as_int(message.get("data")) or 0)
        self.seen = newest
        return newest

    def close(self) -> None:
        self._pubsub.close()
