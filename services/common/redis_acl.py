"""Redis ACL users, one per role, each allowed only what its service does (docs/deploy.md,
"Security").

`ROLES` is the one table: per role, the commands it may run on which keys of the run's
namespace. It is built from the stream wiring in services/common/streams.py (`CONSUMER_GROUPS`
says who reads each stream, `PRODUCERS` below who writes it), so a service that starts reading
or writing another stream changes its permissions here in one place. `render_acl` turns it into
a Redis 7 ACL file (`aclfile`); `forage redis acl --out DIR` writes that file with a fresh
random password per role (hashed in the file, plain in `DIR/<role>.password` for the service).

The rules use Redis 7 selectors, `(~key +command ...)`: a command is allowed on a key only
when one selector grants both, so a replica that consumes `prompts` (XREADGROUP writes to the
group) still cannot XADD to it, and DEL is allowed on heartbeat keys only. Commands run inside
a Lua script are checked against the same rules, so EVAL opens nothing new. No role gets
FLUSHALL, FLUSHDB, CONFIG, KEYS, DEBUG, SHUTDOWN, ACL or MODULE, and the `default` user (a
client that does not authenticate) is switched off.

Everything here is pure.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from services.common.streams import CONSUMER_GROUPS, DEAD, STREAM_KINDS

# Who writes each stream (CONSUMER_GROUPS says who reads it): the learner issues prompt groups,
# a replica publishes trajectories, the scorer scored ones.
PRODUCERS = {"prompts": "learner", "rollouts": "rollout", "scored": "scorer"}

# What every client does on connecting (redis-py, go-redis): authenticate, name itself, ping.
# Not CLIENT SETINFO: Redis 7.0 does not know it (an ACL file naming it does not load), and the
# clients ignore its refusal on 7.2.
CONNECTION = ("auth", "hello", "ping", "select", "quit", "reset", "client|setname",
              "client|getname", "client|id")
# MULTI/EXEC (dead-lettering writes the dead entry and acks the source in one transaction)
# and loading the streams' Lua scripts; the commands a script runs are checked one by one.
TRANSACTIONS = ("multi", "exec", "discard")
SCRIPT_LOAD = ("script|load",)
SCRIPTS = ("evalsha", "eval")

# Consuming a stream in a consumer group: read, reclaim, renew a lease (a Lua script of
# XPENDING + XCLAIM), ack, create the group after a restart, and measure the backlog.
CONSUME = ("xreadgroup", "xautoclaim", "xclaim", "xpending", "xack", "xgroup|create",
           "xinfo|groups", "xlen", "exists", *SCRIPTS)
# Publishing with backpressure: one Lua script that reads the backlog and XADDs (XTRIM in it
# runs on Redis 6.2 only, which has no consumer-group lag: not granted, Redis 7 is required).
PRODUCE = ("xadd", "xlen", "xinfo|groups", "xpending", "exists", *SCRIPTS)
# Reading a stream's backlog only (metrics, the autoscaler).
BACKLOG = ("xlen", "xinfo|groups", "xpending", "exists")
# Never granted to anyone; `render_acl` refuses a table that would.
FORBIDDEN = frozenset({"flushall", "flushdb", "config", "keys", "debug", "shutdown", "acl",
                       "module", "save", "bgsave", "bgrewriteaof", "replicaof", "slaveof",
                       "migrate", "restore", "sync", "psync", "failover", "monitor",
                       "client|kill", "script|flush", "function"})


@dataclass(frozen=True)
class Grant:
    """`commands` on the keys `keys` (patterns below the namespace: `prompts`,
    `heartbeat:rollout:*`); `read_only` grants read access to the keys only (`%R~`)."""

    keys: tuple[str, ...]
    commands: tuple[str, ...]
    read_only: bool = False


@dataclass(frozen=True)
class Role:
    """One ACL user: what it is for, keyless commands, per-key grants, pub/sub channels."""

    name: str
    purpose: str
    grants: tuple[Grant, ...] = ()
    commands: tuple[str, ...] = ()  # keyless, beyond CONNECTION
    channels: tuple[str, ...] = ()  # patterns below the namespace

    def all_commands(self) -> set[str]:
        return set(CONNECTION) | set(self.commands) | {c for g in self.grants for c in g.commands}


def _stream_grants(role: str) -> tuple[Grant, ...]:
    """The stream grants of a service role, from who consumes (CONSUMER_GROUPS) and who
    produces (PRODUCERS) each stream; every service dead-letters what it cannot handle."""
    grants = []
    for kind in STREAM_KINDS:
        commands: tuple[str, ...] = ()
        if CONSUMER_GROUPS[kind] == role:
            commands += CONSUME
        if PRODUCERS[kind] == role:
            commands += PRODUCE
        if commands:
            grants.append(Grant((kind,), tuple(dict.fromkeys(commands))))
    grants.append(Grant((DEAD,), ("xadd",)))
    return tuple(grants)


ROLES: tuple[Role, ...] = (
    Role(
        "learner", "issues prompt groups, consumes scored trajectories, trims the streams, "
        "announces policy versions",
        grants=(
            *_stream_grants("learner"),
            # It creates every stream's group at start (a fresh Redis), reads the backlog of
            # each for its metrics, checks an issued group is still there (XRANGE), and it
            # alone may trim.
            Grant(STREAM_KINDS, ("xgroup|create", "xtrim", "xrange", *BACKLOG)),
            Grant((DEAD,), ("xtrim",)),
            Grant(("weights:version",), ("get", "set")),
        ),
        commands=(*TRANSACTIONS, *SCRIPT_LOAD, "publish"),
        channels=("weights",),
    ),
    Role(
        "rollout", "consumes prompt groups, publishes trajectories and its heartbeat",
        grants=(
            *_stream_grants("rollout"),
            Grant(("heartbeat:rollout:*",), ("set", "del")),
            Grant(("weights:version",), ("get",), read_only=True),
        ),
        commands=(*TRANSACTIONS, *SCRIPT_LOAD, "subscribe", "unsubscribe"),
        channels=("weights",),
    ),
    Role(
        "scorer", "consumes trajectories, publishes scored trajectories",
        grants=_stream_grants("scorer"),
        commands=(*TRANSACTIONS, *SCRIPT_LOAD),
    ),
    Role(
        "exporter", "the Prometheus Redis exporter: server statistics, no keys",
        commands=("info", "slowlog|get", "slowlog|len", "latency|latest",
                  "latency|histogram", "dbsize"),
    ),
    Role(
        "autoscaler", "KEDA's Redis Streams scaler: the prompts backlog, read only",
        grants=(Grant(("prompts",), BACKLOG, read_only=True),),
    ),
    Role(
        "operator", "`forage eval --namespace` (evaluation groups through the replicas, read "
        "back in a consumer group of its own) and `forage streams dead`",
        grants=(
            Grant(("prompts",), PRODUCE),
            Grant(("rollouts",), (*CONSUME, "xgroup|destroy")),
            Grant((DEAD,), ("xrange", "xrevrange", "xlen")),
            Grant(("heartbeat:rollout:*",), ("get",), read_only=True),
        ),
        commands=(*SCRIPT_LOAD, "scan"),
    ),
)
ROLE_NAMES = tuple(role.name for role in ROLES)


def role(name: str) -> Role:
    for candidate in ROLES:
        if candidate.name == name:
            return candidate
    raise ValueError(f"no Redis role {name!r}; the roles are {', '.join(ROLE_NAMES)}")


def escape_glob(text: str) -> str:
    """`text` matched literally in a Redis glob pattern (a namespace may hold `*` or `[`)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _key(namespace: str, pattern: str) -> str:
    return f"{escape_glob(namespace)}:{pattern}"


def _commands(commands: tuple[str, ...] | set[str]) -> str:
    return " ".join(f"+{c}" for c in sorted(set(commands)))


def password_hash(password: str) -> str:
    """The form Redis keeps in an ACL file (`#<sha256 hex>`): the file holds no password."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def new_password() -> str:
    """256 random bits, hex: nothing to escape in a URL, a file or an environment variable."""
    return secrets.token_hex(32)


def role_line(spec: Role, namespace: str, password_hashed: str | None) -> str:
    """One `user` line. Without a password hash the user is written `off` (a reviewable copy
    of the rules that lets no one in)."""
    forbidden = spec.all_commands() & FORBIDDEN
    if forbidden:
        raise ValueError(f"role {spec.name} would get {sorted(forbidden)}, which no role may have")
    auth = f"on {password_hashed}" if password_hashed else "off"
    parts = [f"user {spec.name} reset {auth} resetchannels"]
    parts += [f"&{_key(namespace, c)}" for c in spec.channels]
    parts.append("-@all " + _commands(set(CONNECTION) | set(spec.commands)))
    for grant in spec.grants:
        keys = " ".join(f"{'%R' if grant.read_only else ''}~{_key(namespace, k)}"
                        for k in grant.keys)
        parts.append(f"({keys} {_commands(grant.commands)})")
    return " ".join(parts)


def render_acl(namespace: str, hashes: dict[str, str] | None = None) -> str:
    """The ACL file for a run's namespace: the `default` user off, then one user per role
    (`hashes`: role -> `password_hash(...)`; a role without one is written `off`)."""
    if not namespace:
        raise ValueError("the namespace is empty (redis.namespace)")
    hashes = hashes or {}
    unknown = set(hashes) - set(ROLE_NAMES)
    if unknown:
        raise ValueError(f"no Redis role {sorted(unknown)}; the roles are {', '.join(ROLE_NAMES)}")
    # An ACL file has no comments: Redis refuses to load any line that is not a user.
    lines = ["user default reset off resetchannels -@all"]
    lines += [role_line(spec, namespace, hashes.get(spec.name)) for spec in ROLES]
    return "\n".join(lines) + "\n"


def without_passwords(acl_text: str) -> str:
    """An ACL file with each `on #<hash>` written `off`: what `render_acl` gives without
    hashes, so a generated file can be compared with the reviewed rules."""
    out = []
    for line in acl_text.splitlines():
        words = line.split(" ")
        if line.startswith("user ") and "on" in words:
            at = words.index("on")
            if at + 1 < len(words) and words[at + 1].startswith("#"):
                words[at:at + 2] = ["off"]
        out.append(" ".join(words))
    return "\n".join(out) + "\n"
