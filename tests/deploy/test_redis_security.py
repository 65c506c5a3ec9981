"""Redis's users in the deploy files (docs/deploy.md, "Security"): Redis loads the ACL file
`forage redis acl` writes, and every workload that talks to Redis gets its own role's user name
and only that role's password file, from the compose secrets or the Secret forage-redis, in
every compose layout and in the rendered Kubernetes objects. The checks return problems, and
each has a negative twin on a mutated copy. The roles' behaviour on a real Redis is tested in
tests/common/test_redis_acl.py."""

from __future__ import annotations

import copy
from pathlib import Path

from services.common.cli_redis import ACL_FILE, secret_files
from services.common.config import load_config
from services.common.redis_acl import ROLE_NAMES, render_acl

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "search_r1_nq_hotpotqa.yaml"
SECRET_DIR = "/run/secrets"
# the files `forage redis acl --out DIR` writes (what compose and the Secret may name)
GENERATED = set(secret_files("ns", dict.fromkeys(ROLE_NAMES, "pw")))


def compose_problems(model: dict, deploy) -> list[str]:
    problems = []
    secrets = model.get("secrets", {})
    for name, spec in secrets.items():
        if name.startswith("tls-"):  # `forage tls certs`'s files: tests/deploy/test_tls_deploy.py
            continue
        if Path(spec["file"]).name not in GENERATED:
            problems.append(f"secret {name}: {spec['file']} is not a file forage redis acl writes")
    redis = model["services"]["redis"]
    command = redis["command"]
    if "--aclfile" not in command or (
            command[command.index("--aclfile") + 1] != f"{SECRET_DIR}/redis-acl"):
        problems.append("redis: not started with --aclfile /run/secrets/redis-acl")
    if Path(secrets.get("redis-acl", {}).get("file", "")).name != ACL_FILE:
        problems.append(f"secret redis-acl is not {ACL_FILE}")
    exporter = model["services"]["redis-exporter"]
    env = exporter.get("environment", {})
    redis_secrets = [s for s in exporter.get("secrets", []) if s.startswith("redis-")]
    if (env.get("REDIS_USER"), env.get("REDIS_PASSWORD_FILE"), redis_secrets) != (
            "exporter", f"{SECRET_DIR}/redis-exporter", ["redis-exporter"]):
        problems.append("redis-exporter: not the exporter user with its own password file")
    for name, service in model["services"].items():
        role = deploy.forage_role(deploy.compose_argv(service))
        env = service.get("environment", {}) or {}
        given = [s for s in service.get("secrets", []) if s.startswith("redis-")]
        if role is None:
            if env.get("REDIS_USERNAME") or (given and name not in ("redis", "redis-exporter")):
                problems.append(f"{name}: does not talk to Redis but gets Redis credentials")
            continue
        if (env.get("REDIS_USERNAME"), env.get("REDIS_PASSWORD_FILE"), given) != (
                role, f"{SECRET_DIR}/redis-{role}", [f"redis-{role}"]):
            problems.append(f"{name}: not user {role} with only its own password file")
        elif Path(secrets[f"redis-{role}"]["file"]).name != f"{role}.password":
            problems.append(f"{name}: secret redis-{role} is not {role}.password")
    return problems


def k8s_problems(objects: list[dict], deploy) -> list[str]:
    problems = []
    # a Secret volume or a projected one (forage-redis's keys with forage-tls's)
    for where, container, env, secrets in deploy.workload_containers(objects, SECRET_DIR):
        items = secrets.get("forage-redis", {})
        if set(secrets) - {"forage-redis", "forage-tls"} or not set(items) <= GENERATED:
            problems.append(f"{where}: mounts {sorted(secrets)} keys {sorted(items)} "
                            "forage redis acl does not write")
        role = deploy.forage_role(deploy.container_argv(container))
        if container["name"] == "redis":
            args = container["args"]
            if items != {ACL_FILE: "redis-acl"} or args[args.index("--aclfile") + 1] != (
                    f"{SECRET_DIR}/redis-acl"):
                problems.append(f"{where}: not started with the Secret's {ACL_FILE}")
        elif container["name"] == "exporter":
            if (env.get("REDIS_USER"), items) != ("exporter", {"exporter.json":
                                                               "redis-exporter"}):
                problems.append(f"{where}: not the exporter user with its own password")
        elif role is not None and container["name"] == role:
            if (env.get("REDIS_USERNAME"), env.get("REDIS_PASSWORD_FILE"), items) != (
                    role, f"{SECRET_DIR}/redis-{role}", {f"{role}.password": f"redis-{role}"}):
                problems.append(f"{where}: not user {role} with only its own password file")
        elif items or env.get("REDIS_USERNAME"):
            problems.append(f"{where}: does not talk to Redis but gets Redis credentials")
    for obj in objects:
        if obj["kind"] == "TriggerAuthentication":
            refs = {r["parameter"]: (r["name"], r["key"]) for r in obj["spec"]["secretTargetRef"]
                    if r["name"] == "forage-redis"}  # forage-tls's: test_tls_deploy.py
            if refs != {"username": ("forage-redis", "autoscaler.username"),
                        "password": ("forage-redis", "autoscaler.password")}:
                problems.append(f"TriggerAuthentication {obj['metadata']['name']}: {refs}")
        if obj["kind"] == "ScaledObject":
            for trigger in obj["spec"]["triggers"]:
                if trigger.get("authenticationRef", {}).get("name") != "forage-redis-autoscaler":
                    problems.append(f"ScaledObject trigger {trigger['name']}: no Redis user")
    return problems


def test_compose_gives_each_service_only_its_own_redis_user(deploy):
    layouts = [(), (deploy.LAYOUTS[1],), (deploy.LAYOUTS[2],), (deploy.LAYOUTS[8],),
               (REPO / "deploy" / "compose" / "cpu.yml",)]
    for extra in layouts:
        model = deploy.compose_model(deploy.COMPOSE_FILE, *extra, env=deploy.USER_ENV)
        assert compose_problems(model, deploy) == [], extra
    model = deploy.compose_model(env=deploy.USER_ENV)
    swapped = copy.deepcopy(model)
    swapped["services"]["rollout"]["secrets"] = ["redis-learner"]
    anonymous = copy.deepcopy(model)
    anonymous["services"]["redis"]["command"] = ["redis-server"]
    assert any("rollout" in p for p in compose_problems(swapped, deploy))
    assert any("--aclfile" in p for p in compose_problems(anonymous, deploy))


def test_kubernetes_gives_each_pod_only_its_own_redis_user(deploy, rendered):
    assert k8s_problems(rendered, deploy) == []
    bad = copy.deepcopy(rendered)
    scorer = deploy.by_kind(bad, "Deployment")["forage-scorer"]
    (volume,) = [v for v in deploy.pod_spec(scorer)["volumes"] if v["name"] == "secrets"]
    redis_source = volume["projected"]["sources"][0]["secret"]
    assert redis_source["name"] == "forage-redis"
    redis_source["items"][0]["key"] = "learner.password"
    assert any("forage-scorer" in p for p in k8s_problems(bad, deploy))


def test_reviewed_rules_are_what_the_generator_writes_for_the_deploy_config():
    """deploy/redis/roles.acl shows what each role may do; it must be what `forage redis acl`
    writes (users off, no passwords) for the namespace of the shipped config."""
    namespace = load_config(CONFIG, environ={}).redis.namespace
    assert (REPO / "deploy" / "redis" / "roles.acl").read_text() == render_acl(namespace), (
        "regenerate: forage redis acl --config configs/search_r1_nq_hotpotqa.yaml "
        "> deploy/redis/roles.acl")
