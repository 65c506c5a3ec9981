"""How a service authenticates to Redis and checks its certificate (docs/deploy.md, "Security").

The `redis` config section names an ACL user (`redis.username`, REDIS_USERNAME) and a file
that holds its password (`redis.passfile`, REDIS_PASSWORD_FILE: a Kubernetes Secret or compose
secret mounted as a file), so the password is never in argv (`ps`), the environment, the
config (`forage config show`), a log line or a metric. A password in `redis.url` still works
(redis://user:password@host:6379/0) and is hidden wherever the URL is shown. A `rediss://` URL
speaks TLS and verifies the server's certificate against `redis.tls_ca_file` (else the
system's CAs); `tls_cert_file` and `tls_key_file` are the client's, for a server that asks.

`connection_options` turns the section into redis-py keyword arguments for `from_url`; the URL's
own user and password, when it has them, win (redis-py's rule).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


class RedisAuthConfigError(ValueError):
    """The credentials or TLS files the config names cannot be used (a missing or empty
    password file, TLS files with a plain redis:// URL)."""


def read_passfile(path: str) -> str:
    """The password in `path`: its first line, without the line break (`echo pw > file` and
    a Kubernetes Secret key both work). A missing, unreadable or empty file is an error naming
    it; the password itself never appears in a message."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RedisAuthConfigError(
            f"redis.passfile (REDIS_PASSWORD_FILE) {path} does not exist: mount the password "
            "file there (`forage redis acl --out DIR` writes one per role)") from None
    except OSError as exc:
        raise RedisAuthConfigError(
            f"redis.passfile (REDIS_PASSWORD_FILE) {path} cannot be read: "
            f"{exc.strerror or type(exc).__name__}") from None
    password = text.splitlines()[0].strip() if text.strip() else ""
    if not password:
        raise RedisAuthConfigError(f"redis.passfile (REDIS_PASSWORD_FILE) {path} is empty")
    return password


def is_tls_url(url: str) -> bool:
    return urlsplit(url).scheme.lower() == "rediss"


def connection_options(cfg: Any, url: str) -> dict[str, Any]:
    """redis-py keyword arguments for `url` from a `redis` config section (read by attribute:
    `username`, `passfile`, `tls_ca_file`, `tls_cert_file`, `tls_key_file`)."""
    options: dict[str, Any] = {}
    username = getattr(cfg, "username", None)
    passfile = getattr(cfg, "passfile", None)
    if username:
        options["username"] = username
    if passfile:
        options["password"] = read_passfile(passfile)
    tls = {name: getattr(cfg, name, None) for name in ("tls_ca_file", "tls_cert_file",
                                                       "tls_key_file")}
    if not is_tls_url(url):
        named = [f"redis.{name}" for name, value in tls.items() if value]
        if named:
            raise RedisAuthConfigError(
                f"{', '.join(named)} set but redis.url is not rediss://: use rediss://HOST:PORT "
                "for TLS, or unset them")
        return options
    if bool(tls["tls_cert_file"]) != bool(tls["tls_key_file"]):
        raise RedisAuthConfigError("redis.tls_cert_file and redis.tls_key_file go together "
                                   "(the client certificate and its key)")
    for name, value in tls.items():
        if value and not Path(value).is_file():
            raise RedisAuthConfigError(f"redis.{name} {value} does not exist")
    options["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    options["ssl_check_hostname"] = True
    if tls["tls_ca_file"]:
        options["ssl_ca_certs"] = tls["tls_ca_file"]
    if tls["tls_cert_file"]:
        options["ssl_certfile"] = tls["tls_cert_file"]
        options["ssl_keyfile"] = tls["tls_key_file"]
    return options
