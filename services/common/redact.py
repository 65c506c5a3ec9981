"""Hiding secrets wherever a config or a URL leaves the process: `forage config show`, the
run's saved config.yaml, trackers (wandb, MLflow), the HTML report, error messages and logs.

A run config can hold a weight-sync token, a Redis URL with a password, MCP servers' HTTP
headers and environment, vLLM's `hf_token`. What is hidden:

- the value of a key named like a secret (`token`, `password`, `secret`, `api_key`,
  `authorization`, `cookie`, `credentials`, ...: whole words of the key, so `tokenizer_path`
  and `max_tokens` are not), and every value of an MCP server's `headers`, except a value
  that only names environment variables (`Bearer ${MCP_TOKEN}`: the secret is not in it);
- a URL's password (`redis://user:***@host:6379/0`: the user and host stay, they are what
  one debugs with), a user name standing alone before the `@` (`https://***@host`, where
  tokens go), and secret-named query parameters (`?token=***`).

Everything here is pure; the saved config carries `***` where a secret was, and
`placeholders` finds them again when such a config is loaded (services/common/config), so a
redacted value is never taken for the real one: `forage up` hands its children the real
values in the environment (`secret_leaves` -> FORAGE_CONFIG_SECRETS), and anyone else loading a
saved config is told which secret to pass again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

PLACEHOLDER = "***"

# A key is secret when one of its words (split at _ - . and camelCase) is one of these, or
# when two neighbouring words make one (api key, access key, private key).
_SECRET_WORDS = frozenset({
    "token", "password", "passwd", "pwd", "passphrase", "secret", "secrets", "apikey",
    "authorization", "auth", "cookie", "cookies", "credential", "credentials",
})
_SECRET_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"),
                           ("session", "key"), ("signing", "key")})
# Mappings whose every value is a secret, whatever its name (an MCP server's HTTP headers:
# Authorization, X-Api-Key, a tenant id...).
_SECRET_MAPPINGS = frozenset({"headers"})
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
_ENV_REFERENCE = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")
_AUTH_SCHEME = re.compile(r"^(?:bearer|basic|token)?$", re.IGNORECASE)

# scheme://userinfo@ : the userinfo runs to the last '@' before the host's end (an unescaped
# '@' in a password is taken as redis-py and urllib take it).
_URL_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)([^\s/?#@]*(?:@[^\s/?#@]*)*)@")
_QUERY_PARAM = re.compile(r"([?&;])([^=&#\s]+)=([^&#\s]*)")
_QUERY_SECRET_NAMES = frozenset({"key", "sig", "signature"})

Path = tuple[str | int, ...]


def key_words(name: str) -> list[str]:
    """`weight_sync_token` -> [weight, sync, token]; `X-Api-Key` -> [x, api, key]."""
    return [w.lower() for w in _WORD.findall(str(name))]


def is_secret_key(name: Any) -> bool:
    """Whether a config key (or header, environment variable, query parameter) names a
    secret: `weight_sync_token`, `GITHUB_TOKEN`, `hf_token`, `password`, `X-Api-Key`;
    not `tokenizer_path`, `max_tokens_per_turn` or `headers` itself."""
    words = key_words(name)
    if any(w in _SECRET_WORDS for w in words):
        return True
    return any(pair in _SECRET_PAIRS for pair in zip(words, words[1:], strict=False))


def _redact_userinfo(match: re.Match[str]) -> str:
    scheme, userinfo = match.group(1), match.group(2)
    if not userinfo:
        return match.group(0)
    user, colon, _password = userinfo.partition(":")
    if colon:  # user:password -> the user stays
        return f"{scheme}{user}:{PLACEHOLDER}@"
    return f"{scheme}{PLACEHOLDER}@"  # a name alone before '@' is where tokens go


def _redact_query(match: re.Match[str]) -> str:
    sep, name, value = match.groups()
    if value and (is_secret_key(name) or name.lower() in _QUERY_SECRET_NAMES):
        return f"{sep}{name}={PLACEHOLDER}"
    return match.group(0)


def redact_text(text: str) -> str:
    """`text` with every URL's password (and secret query parameters) hidden:
    `cannot reach redis://user:pw@host:6379/0` -> `cannot reach redis://user:***@host:6379/0`."""
    if "://" not in text:
        return text
    text = _URL_USERINFO.sub(_redact_userinfo, text)
    if "?" in text:
        text = _QUERY_PARAM.sub(_redact_query, text)
    return text


def redact_url(url: str | None) -> str | None:
    """One URL, its password hidden: `redis://user:pw@host:6379/0` ->
    `redis://user:***@host:6379/0` (None stays None)."""
    return None if url is None else redact_text(url)


def _names_env_only(value: str) -> bool:
    """`Bearer ${MCP_TOKEN}`: a header value that only names where its secret is."""
    return bool(_ENV_REFERENCE.search(value)) and bool(
        _AUTH_SCHEME.match(_ENV_REFERENCE.sub("", value).strip()))


def _redact_leaf(value: Any, secret: bool, in_headers: bool) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if secret:
        if in_headers and isinstance(value, str) and _names_env_only(value):
            return value
        if value == "":
            return value
        return PLACEHOLDER
    if isinstance(value, str):
        return redact_text(value)
    return value


def _walk(value: Any, path: Path, secret: bool, in_headers: bool,
          hidden: list[tuple[Path, Any]] | None) -> Any:
    if isinstance(value, Mapping):
        out = {}
        for key, child in value.items():
            headers = str(key).lower() in _SECRET_MAPPINGS
            out[key] = _walk(child, (*path, key), secret or headers or is_secret_key(key),
                             in_headers or headers, hidden)
        return out
    if isinstance(value, list | tuple):
        return [_walk(child, (*path, i), secret, in_headers, hidden)
                for i, child in enumerate(value)]
    shown = _redact_leaf(value, secret, in_headers)
    if hidden is not None and shown != value:
        hidden.append((path, value))
    return shown


def redact(config: Any) -> Any:
    """A copy of `config` (mappings, lists, scalars) with its secrets replaced by `***`:
    secret-named keys' values (leaves only: a mapping keeps its keys), header values, and
    the credentials in every URL."""
    return _walk(config, (), False, False, None)


def secret_leaves(config: Any) -> list[tuple[Path, Any]]:
    """(path, real value) of every leaf `redact` changes: what a process reading the redacted
    config needs to get back (`restore`)."""
    hidden: list[tuple[Path, Any]] = []
    _walk(config, (), False, False, hidden)
    return hidden


def _is_placeholder(value: Any, secret: bool) -> bool:
    if not isinstance(value, str) or PLACEHOLDER not in value:
        return False
    if secret:
        return value == PLACEHOLDER
    for match in _URL_USERINFO.finditer(value):
        user, colon, password = match.group(2).partition(":")
        if (colon and password == PLACEHOLDER) or (not colon and user == PLACEHOLDER):
            return True
    return any(v == PLACEHOLDER and (is_secret_key(n) or n.lower() in _QUERY_SECRET_NAMES)
               for _, n, v in _QUERY_PARAM.findall(value))


def placeholders(config: Any) -> list[Path]:
    """Paths of the leaves that hold a redacted secret (`***` where a secret goes, a URL with
    `:***@`): a config saved redacted, loaded again."""
    found: list[Path] = []

    def visit(value: Any, path: Path, secret: bool) -> None:
        if isinstance(value, Mapping):
            for key, child in value.items():
                visit(child, (*path, key), secret or str(key).lower() in _SECRET_MAPPINGS
                      or is_secret_key(key))
        elif isinstance(value, list | tuple):
            for i, child in enumerate(value):
                visit(child, (*path, i), secret)
        elif _is_placeholder(value, secret):
            found.append(path)

    visit(config, (), False)
    return found


def restore(config: dict[str, Any], leaves: list[tuple[Path, Any]]) -> list[Path]:
    """Put real values back, in place, where `config` holds the redacted form of one of
    `leaves` (from `secret_leaves`); returns the paths restored. A leaf is only put back where
    the config still holds exactly what redacting it gives, so a value the user set since
    (another URL, a new token) is never replaced."""
    done = []
    for path, real in leaves:
        parent: Any = config
        try:
            for part in path[:-1]:
                parent = parent[part]
            current = parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue
        if current == _redacted_at(config, path, real):
            parent[path[-1]] = real
            done.append(path)
    return done


def _redacted_at(config: Any, path: Path, real: Any) -> Any:
    """What `redact` writes for `real` at `path` of `config`."""
    secret = in_headers = False
    node = config
    for part in path:
        if isinstance(node, Mapping):
            headers = str(part).lower() in _SECRET_MAPPINGS
            secret = secret or headers or is_secret_key(part)
            in_headers = in_headers or headers
        node = node[part] if isinstance(node, Mapping | list) else None
    return _redact_leaf(real, secret, in_headers)


def scrub(text: str, config: Any) -> str:
    """`text` (an error message) with the secrets of `config` and URL credentials hidden."""
    for _path, value in secret_leaves(config):
        if isinstance(value, str) and len(value) >= 4:
            text = text.replace(value, redact_text(value) if "://" in value else PLACEHOLDER)
    return redact_text(text)


def dotted(path: Path) -> str:
    """("rollout", "mcp_servers", 0, "headers", "Authorization") ->
    `rollout.mcp_servers[0].headers.Authorization`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
