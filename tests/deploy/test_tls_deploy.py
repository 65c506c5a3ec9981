"""TLS in the deploy files (docs/deploy.md, "Security"): in every compose layout and in the
rendered Kubernetes objects, Redis listens with TLS only, every Forage service dials it with
rediss:// and the CA, the weight sync serves and checks certificates, the exporter and KEDA
dial with the CA, and each container gets only the TLS files it reads, the files
`forage tls certs` writes. deploy/compose/no-tls.yml turns all of it off and needs none of the
files. The certificates name what the layouts dial. The checks return problems; a layout
without TLS (no-tls.yml, or a mutated copy) must show them. The TLS itself, on real servers,
runs in test_rehearsal.py and test_compose_up.py."""

from __future__ import annotations

import copy
from pathlib import Path
from urllib.parse import urlsplit

from services.common.cli_redis import EXPORTER_ADDRESSES
from services.common.cli_tls import AUTOSCALER_FILE, cert_files
from services.common.config import load_config
from services.common.tls_certs import CA_FILE, RELAY_NAME, certificate_names

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "search_r1_nq_hotpotqa.yaml"
CPU = REPO / "deploy" / "compose" / "cpu.yml"
NO_TLS = REPO / "deploy" / "compose" / "no-tls.yml"
SECRET_DIR = "/run/secrets"
# file in /run/secrets (compose secret name) -> the file of `forage tls certs --out DIR`
TLS_FILES = {"tls-ca": CA_FILE, "tls-redis-cert": "redis.crt", "tls-redis-key": "redis.key",
             "tls-learner-cert": "learner.crt", "tls-learner-key": "learner.key",
             "tls-relay-cert": "relay.crt", "tls-relay-key": "relay.key"}
# what each container reads: least privilege, a server's key only where it serves
READS = {"redis": {"tls-ca", "tls-redis-cert", "tls-redis-key"}, "exporter": {"tls-ca"},
         "learner": {"tls-ca", "tls-learner-cert", "tls-learner-key"},
         "rollout": {"tls-ca", "tls-relay-cert", "tls-relay-key"}, "scorer": {"tls-ca"}}
# the environment every Forage container that talks to Redis gets (services/common/config)
TLS_ENV = {
    "REDIS_URL": "rediss://redis:6379/0",
    "REDIS_TLS_CA_FILE": f"{SECRET_DIR}/tls-ca",
    "FORAGE_WEIGHT_SYNC_TLS_CA_FILE": f"{SECRET_DIR}/tls-ca",
    "FORAGE_WEIGHT_SYNC_TLS_CERT_FILE": f"{SECRET_DIR}/tls-learner-cert",
    "FORAGE_WEIGHT_SYNC_TLS_KEY_FILE": f"{SECRET_DIR}/tls-learner-key",
    "FORAGE_WEIGHT_RELAY_TLS_CERT_FILE": f"{SECRET_DIR}/tls-relay-cert",
    "FORAGE_WEIGHT_RELAY_TLS_KEY_FILE": f"{SECRET_DIR}/tls-relay-key",
    "FORAGE_WEIGHT_RELAY_TLS_NAME": RELAY_NAME,
}
REDIS_TLS_ARGS = {"--port": "0", "--tls-port": "6379",
                  "--tls-cert-file": f"{SECRET_DIR}/tls-redis-cert",
                  "--tls-key-file": f"{SECRET_DIR}/tls-redis-key",
                  "--tls-ca-cert-file": f"{SECRET_DIR}/tls-ca"}
TLS_PROBE = f"redis-cli --tls --cacert {SECRET_DIR}/tls-ca ping"


def _redis_problems(where: str, args: list[str], probe: list[str]) -> list[str]:
    flags = {f: args[args.index(f) + 1] if f in args[:-1] else None for f in REDIS_TLS_ARGS}
    problems = [] if flags == REDIS_TLS_ARGS else [f"{where}: not TLS-only: {flags}"]
    if TLS_PROBE not in " ".join(probe):
        problems.append(f"{where}: its check does not dial TLS with the CA")
    return problems


def _exporter_problems(where: str, env: dict[str, str]) -> list[str]:
    address = env.get("REDIS_ADDR", "")
    if (urlsplit(address).scheme, env.get("REDIS_EXPORTER_TLS_CA_CERT_FILE")) != (
            "rediss", f"{SECRET_DIR}/tls-ca") or address not in EXPORTER_ADDRESSES:
        return [f"{where}: does not dial {address} with TLS and the CA (or its password file "
                "has no entry for it)"]
    return []


def _client_problems(where: str, role: str | None, env: dict[str, str],
                     files: set[str]) -> list[str]:
    problems = []
    wanted = READS.get(role or "", set())
    if files != wanted:
        problems.append(f"{where}: TLS files {sorted(files)}, not {sorted(wanted)}")
    if role in READS and role not in ("redis", "exporter") and (
            {k: env.get(k) for k in TLS_ENV} != TLS_ENV):
        problems.append(f"{where}: not the TLS environment (rediss://, the CA, the weight "
                        "sync's files)")
    return problems


def _secret_name(entry) -> str:
    return entry if isinstance(entry, str) else entry["source"]


def compose_problems(model: dict, deploy) -> list[str]:
    problems = []
    for name, spec in model.get("secrets", {}).items():
        if name.startswith("tls-") and Path(spec["file"]).name != TLS_FILES.get(name):
            problems.append(f"secret {name}: {spec['file']} is not what forage tls certs writes")
    services = model["services"]
    redis = services["redis"]
    problems += _redis_problems("redis", redis["command"], redis["healthcheck"]["test"])
    problems += _exporter_problems("redis-exporter", services["redis-exporter"]["environment"])
    for name, service in services.items():
        role = {"redis": "redis", "redis-exporter": "exporter"}.get(
            name, deploy.forage_role(deploy.compose_argv(service)))
        files = {_secret_name(s) for s in service.get("secrets", [])
                 if _secret_name(s).startswith("tls-")}
        problems += _client_problems(name, role, service.get("environment") or {}, files)
    return problems


def k8s_problems(objects: list[dict], deploy) -> list[str]:
    problems = []
    for where, container, env, secrets in deploy.workload_containers(objects, SECRET_DIR):
        tls = secrets.get("forage-tls", {})
        wrong = {k: p for k, p in tls.items() if TLS_FILES.get(p) != k}
        if wrong:
            problems.append(f"{where}: forage-tls keys at the wrong paths: {wrong}")
        role = {"redis": "redis", "exporter": "exporter"}.get(
            container["name"], deploy.forage_role(deploy.container_argv(container)))
        problems += _client_problems(where, role, env, set(tls.values()))
        if role == "redis":
            probe = container["readinessProbe"]["exec"]["command"]
            problems += _redis_problems(where, container["args"], probe)
        elif role == "exporter":
            problems += _exporter_problems(where, env)
    auths = deploy.by_kind(objects, "TriggerAuthentication")
    for name, auth in auths.items():
        refs = {r["parameter"]: (r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]}
        if (refs.get("tls"), refs.get("ca")) != (("forage-tls", AUTOSCALER_FILE),
                                                 ("forage-tls", CA_FILE)):
            problems.append(f"TriggerAuthentication {name}: KEDA does not dial with TLS and "
                            "the CA")
    for scaled in deploy.by_kind(objects, "ScaledObject").values():
        for trigger in scaled["spec"]["triggers"]:
            if trigger.get("authenticationRef", {}).get("name") not in auths or (
                    "enableTLS" in trigger["metadata"]):
                problems.append(f"ScaledObject trigger {trigger['name']}: not the TLS "
                                "TriggerAuthentication")
    return problems


def _layouts(deploy) -> list[tuple[Path, ...]]:
    return [(), (deploy.LAYOUTS[1],), (deploy.LAYOUTS[2],), (deploy.LAYOUTS[8],), (CPU,)]


def test_every_compose_layout_speaks_tls_only(deploy):
    for extra in _layouts(deploy):
        model = deploy.compose_model(deploy.COMPOSE_FILE, *extra, env=deploy.USER_ENV)
        assert compose_problems(model, deploy) == [], extra
    plain = deploy.compose_model(deploy.COMPOSE_FILE, CPU, NO_TLS, env=deploy.USER_ENV)
    said = "\n".join(compose_problems(plain, deploy))
    for service in ("redis:", "its check", "redis-exporter:", "rollout:", "scorer:",
                    "learner:"):
        assert service in said, (service, said)
    leaky = deploy.compose_model(env=deploy.USER_ENV)
    leaky["services"]["scorer"]["secrets"].append("tls-learner-key")
    assert any("scorer: TLS files" in p for p in compose_problems(leaky, deploy))


def test_no_tls_override_turns_tls_off_and_needs_no_certificates(deploy):
    """The laptop's way: Redis plain, the services on the run config's redis://, no TLS file
    named anywhere, so compose needs no ./secrets/tls."""
    for extra in [(), (CPU,)]:
        model = deploy.compose_model(deploy.COMPOSE_FILE, *extra, NO_TLS, env=deploy.USER_ENV)
        for name, service in model["services"].items():
            assert not [s for s in service.get("secrets", []) if _secret_name(s).startswith(
                "tls-")], name
            assert "tls" not in " ".join(map(str, service.get("command") or [])), name
            if deploy.forage_role(deploy.compose_argv(service)):
                env = {k: str(v) for k, v in service["environment"].items()}
                cfg = load_config(CONFIG, environ=env)
                assert cfg.redis.url == "redis://redis:6379/0" and not cfg.redis.tls_ca_file
                assert not cfg.learner.weight_sync_tls_ca_file, name
                assert not cfg.rollout.weight_relay_tls_cert_file, name
        assert model["services"]["redis-exporter"]["environment"]["REDIS_ADDR"] in (
            EXPORTER_ADDRESSES)


def test_every_kubernetes_pod_speaks_tls_only(deploy, rendered):
    assert k8s_problems(rendered, deploy) == []
    bad = copy.deepcopy(rendered)
    (redis,) = deploy.pod_spec(deploy.by_kind(bad, "Deployment")["forage-redis"])["containers"][:1]
    redis["args"].remove("--port")
    scorer = deploy.pod_spec(deploy.by_kind(bad, "Deployment")["forage-scorer"])
    (volume,) = [v for v in scorer["volumes"] if v["name"] == "secrets"]
    volume["projected"]["sources"] = volume["projected"]["sources"][:1]  # no forage-tls
    (auth,) = deploy.by_kind(bad, "TriggerAuthentication").values()
    auth["spec"]["secretTargetRef"] = auth["spec"]["secretTargetRef"][:2]
    said = "\n".join(k8s_problems(bad, deploy))
    for where in ("forage-redis/redis: not TLS-only", "forage-scorer/scorer: TLS files",
                  "TriggerAuthentication"):
        assert where in said, (where, said)


def test_certificates_name_what_the_layouts_dial(deploy, rendered):
    files, _ = cert_files()
    names = {server: certificate_names(files[f"{server}.crt"])
             for server in ("redis", "learner", "relay")}
    model = deploy.compose_model(env=deploy.USER_ENV)
    env = {k: str(v) for k, v in model["services"]["rollout"]["environment"].items()}
    cfg = load_config(CONFIG, environ=env)
    assert urlsplit(cfg.redis.url).hostname in names["redis"]
    assert cfg.learner.weight_sync_host in names["learner"]
    assert cfg.rollout.weight_relay_tls_name in names["relay"]
    exporter = urlsplit(model["services"]["redis-exporter"]["environment"]["REDIS_ADDR"])
    assert exporter.hostname in names["redis"]
    for scaled in deploy.by_kind(rendered, "ScaledObject").values():
        for trigger in scaled["spec"]["triggers"]:
            assert trigger["metadata"]["address"].rsplit(":", 1)[0] in names["redis"]
    pod = deploy.pod_spec(deploy.by_kind(rendered, "Deployment")["forage-redis"])
    (exporter_container,) = [c for c in pod["containers"] if c["name"] == "exporter"]
    address = {e["name"]: e["value"] for e in exporter_container["env"]}["REDIS_ADDR"]
    assert urlsplit(address).hostname in names["redis"]
