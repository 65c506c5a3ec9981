"""Deploy files: schema-valid, consistent with each other and with the run config.

No Docker engine, cluster or GPU is needed. docker-compose.yml (alone and with each GPU layout
file) is validated against the compose-spec JSON schema; the objects each Kubernetes step
creates (`kubectl apply -k` of deploy/k8s/data-loader or deploy/k8s/single-node, of
deploy/k8s/index, then of the root) are rendered (kubectl kustomize, or the Python renderer in
deploy_files.py) and validated against the Kubernetes JSON schemas in strict mode. Each validation has a negative
twin that mutates a copy, so a check that cannot fail would show. The rehearsals that run the
commands are in test_rehearsal.py.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.cli import COMMAND_GROUPS
from services.common.config import RunConfig, load_config
from tests.suite_rules import missing_tool, require_tool

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/search_r1_nq_hotpotqa.yaml"
CONTAINER_CONFIG = "/config/search_r1_nq_hotpotqa.yaml"
# compose service -> (Kubernetes kind, workload name); the Job is deploy/k8s/index's, the rest
# are the run's (the root kustomization)
WORKLOADS = {
    "retriever-index": ("Job", "forage-index"),
    "retriever": ("Deployment", "forage-retriever"),
    "rollout": ("Deployment", "forage-rollout"),
    "scorer": ("Deployment", "forage-scorer"),
    "learner": ("StatefulSet", "forage-learner"),
}
# GPU layouts: node size -> {service: GPU ids}; services that share a GPU are listed in SHARED.
LAYOUTS = {
    4: {"retriever-index": ["0"], "retriever": ["0"], "rollout": ["1"], "learner": ["2", "3"]},
    1: {"retriever-index": ["0"], "retriever": [], "rollout": ["0"], "learner": ["0"]},
    2: {"retriever-index": ["0"], "retriever": ["0"], "rollout": ["0"], "learner": ["1"]},
    8: {"retriever-index": ["0"], "retriever": ["0"], "rollout": ["1"], "rollout-2": ["2"],
        "rollout-3": ["3"], "learner": ["4", "5", "6", "7"]},
}
SHARED = {1: {"0": {"rollout", "learner"}}, 2: {"0": {"retriever", "rollout"}}}


def _config() -> RunConfig:
    return load_config(REPO / CONFIG, environ={})


def _layout_files(deploy, gpus: int) -> tuple[Path, ...]:
    return (deploy.COMPOSE_FILE,) if gpus == 4 else (deploy.COMPOSE_FILE, deploy.LAYOUTS[gpus])


def _forage_services(model: dict) -> dict[str, dict]:
    return {n: s for n, s in model["services"].items() if str(s.get("image", "")).startswith("forage:")}


def _argv(service: dict, deploy) -> list[str]:
    target = service["build"]["target"]
    return list(service.get("entrypoint") or deploy.image_entrypoint(target)) + service["command"]


def _container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def _workloads(steps) -> list[dict]:
    """The objects of the index step and the run: every WORKLOADS entry is among them."""
    return steps["index"] + steps["run"]


# ------------------------------------------------------------------ schema validation

@pytest.mark.parametrize("gpus", [4, 1, 2, 8])
def test_compose_files_validate_against_the_compose_spec(deploy, gpus):
    model = deploy.compose_model(*_layout_files(deploy, gpus), env=deploy.USER_ENV)
    assert deploy.schema_errors(model, deploy.compose_schema()) == []


@pytest.mark.parametrize("mutate, expected", [
    (lambda m: m["services"]["rollout"].update(comand=["x"]), "comand"),
    (lambda m: m["services"]["learner"]["healthcheck"].update(start_period=["30m"]),
     "start_period"),
    (lambda m: m["services"]["retriever"]["deploy"]["resources"]["reservations"]["devices"][0]
     .update(device_ids="0"), "device_ids"),
])
def test_compose_schema_rejects_a_malformed_copy(deploy, mutate, expected):
    model = deploy.compose_model(env=deploy.USER_ENV)
    mutate(model)
    errors = deploy.schema_errors(model, deploy.compose_schema())
    assert errors and any(expected in e for e in errors), errors


def test_rendered_kubernetes_objects_validate_strictly(deploy, rendered, steps):
    kinds = {o["kind"] for o in rendered}
    assert {"ConfigMap", "PersistentVolumeClaim", "Deployment", "StatefulSet", "Service",
            "ScaledObject"} <= kinds
    assert deploy.k8s_errors(rendered) == []
    for step, objects in steps.items():
        assert objects and deploy.k8s_errors(objects) == [], step


@pytest.mark.parametrize("mutate, expected", [
    (lambda c: c.update(arg=["x"]), "arg"),                          # unknown field (strict)
    (lambda c: c["ports"][0].update(containerPort="8000"), "containerPort"),
    (lambda c: c["startupProbe"].update(failureThreshold="lots"), "failureThreshold"),
])
def test_kubernetes_validation_rejects_a_malformed_copy(deploy, rendered, mutate, expected):
    objects = copy.deepcopy(rendered)
    mutate(_container(deploy.by_kind(objects, "Deployment")["forage-retriever"]))
    errors = deploy.k8s_errors(objects)
    assert errors and any(expected in e for e in errors), errors


# ------------------------------------------------------------------ kustomize

def test_python_renderer_matches_kubectl(deploy):
    assert deploy.configmap_hash("x", {"a": "b"}) == "4h2mbtbbt6"  # kubectl kustomize v5.5
    if deploy.kubectl() is None:
        pytest.skip("no kubectl here: the Python renderer is used alone")
    for directory in deploy.K8S_STEPS.values():
        ours = deploy.render_kustomization(directory)
        theirs = deploy.kubectl_kustomize(directory)
        key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
        assert {key(o): o for o in ours} == {key(o): o for o in theirs}


def test_config_generator_must_sit_at_the_root(deploy, tmp_path):
    """kustomize refuses a generator file outside its directory: why kustomization.yaml is at
    the repository root rather than in deploy/k8s."""
    inner = tmp_path / "repo" / "deploy" / "k8s"
    shutil.copytree(REPO / "deploy" / "k8s", inner)
    shutil.copytree(REPO / "configs", tmp_path / "repo" / "configs")
    spec = yaml.safe_load((inner / "kustomization.yaml").read_text())
    spec["configMapGenerator"] = [{"name": "forage-config",
                                   "files": ["../../configs/search_r1_nq_hotpotqa.yaml"]}]
    (inner / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(ValueError, match="load restrictor"):
        deploy.render_kustomization(inner)
    if deploy.kubectl() is not None:
        with pytest.raises(RuntimeError, match="security|not in or below|outside"):
            deploy.kubectl_kustomize(inner)


def test_configmap_is_the_compose_config_at_the_same_path(deploy, rendered, steps):
    (configmap,) = deploy.by_kind(rendered, "ConfigMap").values()
    assert configmap["metadata"]["name"].startswith("forage-config-")
    assert configmap["data"] == {Path(CONFIG).name: (REPO / CONFIG).read_text()}
    for kind, name in WORKLOADS.values():
        pod = deploy.by_kind(_workloads(steps), kind)[name]["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = {m["mountPath"]: m["name"] for m in _container({"spec": {"template": {
            "spec": pod}}})["volumeMounts"]}
        if "/config" in mounts:
            assert volumes[mounts["/config"]]["configMap"]["name"] == configmap["metadata"]["name"]


# ------------------------------------------------------------------ compose == kubernetes

def test_compose_and_kubernetes_run_the_same_commands(deploy, steps):
    services = deploy.compose_model(env=deploy.USER_ENV)["services"]
    for service, (kind, name) in WORKLOADS.items():
        compose = services[service]
        container = _container(deploy.by_kind(_workloads(steps), kind)[name])
        k8s_argv = list(container.get("command") or deploy.image_entrypoint(
            compose["build"]["target"])) + container["args"]
        assert k8s_argv == _argv(compose, deploy), service
        assert container["image"] == compose["image"], service
        # the same variables; a secret comes from the user's .env in compose, a Secret in k8s
        k8s_env = {e["name"]: e.get("value", "<secret>") for e in container.get("env", [])}
        compose_env = {k: ("<secret>" if k == "FORAGE_WEIGHT_SYNC_TOKEN" else str(v))
                       for k, v in compose["environment"].items()}
        assert k8s_env == compose_env, service
        assert _argv(compose, deploy)[_argv(compose, deploy).index("forage") + 1] in COMMAND_GROUPS


def test_every_forage_command_parses_and_names_the_shared_config(deploy):
    for gpus in LAYOUTS:
        model = deploy.compose_model(*_layout_files(deploy, gpus), env=deploy.USER_ENV)
        for name, service in _forage_services(model).items():
            argv = _argv(service, deploy)
            args = argv[argv.index("forage") + 1:]
            if args[:2] == ["retriever", "build-index"]:
                continue
            assert args[args.index("--config") + 1] == CONTAINER_CONFIG, name
            overrides = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
            load_config(REPO / CONFIG, overrides, environ={})  # keys exist and are well-typed


def test_config_addresses_match_services_ports_and_probes(deploy, rendered):
    cfg = _config()
    services = deploy.compose_model(env=deploy.USER_ENV)["services"]
    k8s_services = deploy.by_kind(rendered, "Service")
    listeners = {  # config host:port -> compose service
        ("redis", 6379): "redis",
        ("retriever", cfg.retriever.port): "retriever",
        (cfg.learner.weight_sync_host, cfg.learner.weight_sync_port): "learner",
    }
    assert cfg.redis.url == "redis://redis:6379/0"
    assert cfg.retriever.url == f"http://retriever:{cfg.retriever.port}/retrieve"
    for (host, port), service in listeners.items():
        assert host == service and service in services
        assert port in {p["port"] for p in k8s_services[host]["spec"]["ports"]}, host
    assert k8s_services["learner"]["spec"]["clusterIP"] == "None"  # headless
    assert deploy.by_kind(rendered, "StatefulSet")["forage-learner"]["spec"]["serviceName"] == \
        "learner"
    ports = {"retriever": [cfg.retriever.port], "rollout": [cfg.rollout.metrics_port],
             "scorer": [cfg.scorer.port],
             "learner": [cfg.learner.weight_sync_port, cfg.learner.metrics_port]}
    health = {"retriever": cfg.retriever.port, "rollout": cfg.rollout.metrics_port,
              "scorer": cfg.scorer.port, "learner": cfg.learner.metrics_port}
    for service, expected in ports.items():
        compose = services[service]
        exposed = {int(p) for p in compose.get("expose", [])} | {
            int(str(p).rsplit(":", 1)[-1]) for p in compose.get("ports", [])}
        assert set(expected) <= exposed, service
        assert f"127.0.0.1:{health[service]}/healthz" in compose["healthcheck"]["test"][-1]
        kind, workload = WORKLOADS[service]
        container = _container(deploy.by_kind(rendered, kind)[workload])
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert set(expected) == set(named.values()), service
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert named[get["port"]] == health[service] and get["path"] == "/healthz"
        annotations = deploy.by_kind(rendered, kind)[workload]["spec"]["template"]["metadata"][
            "annotations"]
        assert int(annotations["prometheus.io/port"]) == health[service]
    scrape = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    targets = {job["job_name"]: [t for g in job.get("static_configs", []) for t in g["targets"]]
               + [f"{n}:{d['port']}" for d in job.get("dns_sd_configs", []) for n in d["names"]]
               for job in scrape["scrape_configs"]}
    for service, port in health.items():
        assert targets[service] == [f"{service}:{port}"]


def test_listeners_bind_every_interface_in_the_deploy_config():
    """Defect 5: each service's HTTP listeners bind the address in its config section; the
    deploy config sets 0.0.0.0 for all of them (a loopback bind is unreachable from the
    kubelet's probes, Prometheus and the other containers)."""
    cfg = _config()
    for section in ("retriever", "rollout", "scorer", "learner"):
        assert getattr(cfg, section).host == "0.0.0.0", section
    for section in ("retriever", "rollout", "scorer", "learner"):
        assert getattr(RunConfig(), section).host == "127.0.0.1", section  # local default


# ------------------------------------------------------------------ GPUs, data, users

@pytest.mark.parametrize("gpus", sorted(LAYOUTS))
def test_gpu_layout_places_each_service_on_its_own_gpus(deploy, gpus):
    services = deploy.compose_model(*_layout_files(deploy, gpus), env=deploy.USER_ENV)["services"]
    placed = {n: deploy.device_ids(s) for n, s in services.items() if deploy.gpu_requests(s)
              or n in LAYOUTS[gpus]}
    assert placed == LAYOUTS[gpus]
    for name, service in services.items():
        for request in deploy.gpu_requests(service):
            assert "count" not in request and request["device_ids"], name  # explicit ids only
    used: dict[str, set[str]] = {}
    for name, ids in placed.items():
        if name != "retriever-index":  # one-shot, done before the GPU's owner starts
            for gpu in ids:
                used.setdefault(gpu, set()).add(name)
    assert sorted(used, key=int) == [str(i) for i in range(gpus)]  # every GPU used, none extra
    for gpu, names in used.items():
        assert len(names) == 1 or names == SHARED[gpus][gpu], (gpu, names)
    learner = services["learner"]
    entry = learner.get("entrypoint") or ["forage"]
    nproc = [a.split("=", 1)[1] for a in entry if a.startswith("--nproc-per-node=")]
    ranks = int(nproc[0]) if entry[0] == "torchrun" else 1
    assert ranks == len(deploy.device_ids(learner))  # one rank per GPU the learner holds


def test_layout_rollout_replicas_repeat_the_rollout_service(deploy):
    services = deploy.compose_model(deploy.COMPOSE_FILE, deploy.LAYOUTS[8], env=deploy.USER_ENV)["services"]
    base = {k: v for k, v in services["rollout"].items() if k != "deploy"}
    for name in ("rollout-2", "rollout-3"):
        replica = {k: v for k, v in services[name].items() if k not in ("deploy", "networks")}
        assert replica == base, name
        assert services[name]["networks"]["default"]["aliases"] == ["rollout"]


def test_every_service_mounts_the_paths_its_config_names(deploy):
    """Defect 6: the scorer read its tokenizer from /data without a /data mount."""
    cfg = _config()
    data_paths = [cfg.model.path, cfg.retriever.index_dir, *cfg.data.train_files]
    assert all(p.startswith("/data/") for p in data_paths)
    model = deploy.compose_model(env=deploy.USER_ENV)
    for name, service in _forage_services(model).items():
        targets = {str(v).split(":")[1] for v in service["volumes"]}
        needs = {"/data"} if name == "retriever-index" else {"/config", "/data"}
        assert needs <= targets, name
    learner = model["services"]["learner"]
    assert "forage-checkpoints:/checkpoints" in learner["volumes"]
    assert cfg.learner.checkpoint_dir == "/checkpoints" and cfg.run_dir.startswith("/checkpoints")
    # only the index build writes to ./data; ./data is a bind mount, not an unfilled volume
    for name, service in _forage_services(model).items():
        data = next(v for v in service["volumes"] if str(v).split(":")[1] == "/data")
        assert data.startswith("./data:"), name
        assert data.endswith(":ro") == (name != "retriever-index"), name


def test_pods_run_as_the_image_user_with_writable_volumes(deploy, rendered, steps):
    assert "USER 1000:1000" in (REPO / "deploy" / "Dockerfile").read_text()
    pods = [(o["metadata"]["name"], o["spec"]["template"]["spec"]) for o in _workloads(steps)
            if o["kind"] in ("Deployment", "StatefulSet", "Job") and o["metadata"]["name"] !=
            "forage-redis"]
    loader = deploy.by_kind(steps["data-loader"], "Pod")
    pods.append(("forage-data-loader", loader["forage-data-loader"]["spec"]))
    for name, pod in pods:
        context = pod["securityContext"]
        assert context["runAsUser"] == 1000 and context["fsGroup"] == 1000, name
        for container in pod["containers"]:
            if container["image"].startswith("forage:"):
                env = {e["name"]: e.get("value") for e in container.get("env", [])}
                assert name == "forage-data-loader" or env.get("HF_HUB_OFFLINE") == "1", name
    claims = deploy.by_kind(steps["data-loader"], "PersistentVolumeClaim")
    assert "forage-data" in claims
    assert loader["forage-data-loader"]["spec"]["volumes"][0]["persistentVolumeClaim"][
        "claimName"] == "forage-data"
    job = deploy.by_kind(steps["index"], "Job")["forage-index"]["spec"]["template"]["spec"]
    assert not job["containers"][0]["volumeMounts"][0].get("readOnly")
    retriever = deploy.by_kind(rendered, "Deployment")["forage-retriever"]["spec"]["template"]
    wait = retriever["spec"]["initContainers"][0]["command"][-1]
    assert "/data/index/manifest.json" in wait  # the file a finished build writes last


def test_slow_starts_are_not_killed(deploy, rendered):
    """Healthchecks and probes allow minutes of index/model loading."""
    services = deploy.compose_model(env=deploy.USER_ENV)["services"]
    minutes = {"retriever": 10, "rollout": 10, "learner": 10, "scorer": 2}
    for name, least in minutes.items():
        period = services[name]["healthcheck"]["start_period"]
        assert period.endswith("m") and int(period[:-1]) >= least, name
        probe = _container(deploy.by_kind(rendered, WORKLOADS[name][0])[WORKLOADS[name][1]])[
            "startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= least * 60, name


def test_images_and_environment_download_nothing(deploy):
    text = (REPO / "deploy" / "Dockerfile").read_text()
    stages = text.split("\nFROM ")[1:]
    assert len(stages) == 2 and all("HF_HUB_OFFLINE=1" in s for s in stages)
    for name, service in _forage_services(deploy.compose_model(env=deploy.USER_ENV)).items():
        assert service["environment"]["HF_HUB_OFFLINE"] == "1", name


def test_weight_sync_token_is_required_and_reaches_both_sides(deploy, rendered):
    """Issue 14 item 6: the weight server is authenticated by default. Compose refuses to start
    without the token (named in the error); the learner and every rollout replica, in compose
    and in Kubernetes, get it from the environment, which the config loader reads."""
    with pytest.raises(deploy.MissingVariable, match="FORAGE_WEIGHT_SYNC_TOKEN"):
        deploy.compose_model(env={})
    for gpus in LAYOUTS:
        services = deploy.compose_model(*_layout_files(deploy, gpus), env=deploy.USER_ENV)[
            "services"]
        parties = [n for n in services if n == "learner" or n.startswith("rollout")]
        assert len(parties) >= 2, gpus
        for name in parties:
            env = {k: str(v) for k, v in services[name]["environment"].items()}
            cfg = load_config(None, environ=env)
            assert cfg.learner.weight_sync_token == deploy.USER_ENV["FORAGE_WEIGHT_SYNC_TOKEN"]
    for kind, name in (("StatefulSet", "forage-learner"), ("Deployment", "forage-rollout")):
        env = _container(deploy.by_kind(rendered, kind)[name])["env"]
        token = next(e for e in env if e["name"] == "FORAGE_WEIGHT_SYNC_TOKEN")
        assert token["valueFrom"]["secretKeyRef"] == {"name": "forage-weight-sync",
                                                      "key": "token"}, name


def test_dockerignore_keeps_the_context_small_but_complete():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "runs", "data", "**/__pycache__", ".pytest_cache"} <= ignored
    copied = [line.split()[1:-1] for line in (REPO / "deploy" / "Dockerfile").read_text()
              .splitlines() if line.startswith("COPY ")]
    for sources in copied:
        for source in sources:
            assert source not in ignored and (REPO / source).exists(), source


def test_dockerfile_targets_and_pinned_bases(deploy):
    text = (REPO / "deploy/Dockerfile").read_text()
    bases = [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]
    assert bases and all(":" in base and not base.endswith(":latest") for base in bases)
    images = {s.get("image") for s in deploy.compose_model(env=deploy.USER_ENV)["services"].values()}
    assert {"forage:cpu", "forage:gpu"} <= images
    assert deploy.image_entrypoint("cpu") == deploy.image_entrypoint("gpu") == ["forage"]


def test_rollout_autoscaler_targets_the_rollout_deployment(deploy, rendered):
    # the default (KEDA) and the alternative (prometheus-adapter HPA) scale the same Deployment
    scaled = deploy.by_kind(rendered, "ScaledObject")["forage-rollout"]
    hpa = yaml.safe_load((deploy.K8S_ROOT / "deploy" / "k8s" / "rollout-hpa.yaml").read_text())
    for target in (scaled["spec"]["scaleTargetRef"], hpa["spec"]["scaleTargetRef"]):
        assert target.get("kind", "Deployment") == "Deployment"
        assert target["name"] in deploy.by_kind(rendered, "Deployment")
    rollout = _container(deploy.by_kind(rendered, "Deployment")["forage-rollout"])
    assert rollout["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_services_select_pods_on_declared_ports(deploy, rendered):
    workloads = {**deploy.by_kind(rendered, "Deployment"),
                 **deploy.by_kind(rendered, "StatefulSet")}
    for name, service in deploy.by_kind(rendered, "Service").items():
        selector = service["spec"]["selector"]
        matches = [w for w in workloads.values()
                   if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert matches, f"Service {name} selects no pods"
        port_names = {p.get("name") for w in matches
                      for c in w["spec"]["template"]["spec"]["containers"]
                      for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"{name}: targetPort {port['targetPort']}"


def test_docker_compose_config_validates(deploy):
    docker = require_tool("docker", "make test installs Debian's docker.io as root")
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        missing_tool("the docker client has no compose plugin (make test installs it as root)")
    for extra in ([], ["-f", "deploy/compose/gpus-8.yml"]):
        result = subprocess.run([docker, "compose", "-f", "docker-compose.yml", *extra, "config",
                                 "--quiet"], capture_output=True, text=True, cwd=REPO,
                                env={**os.environ, **deploy.USER_ENV})
        assert result.returncode == 0, result.stderr


def test_bind_mount_sources_exist(deploy):
    """Every bind mount names a file or folder of the repository (./data is the user's)."""
    for gpus in LAYOUTS:
        model = deploy.compose_model(*_layout_files(deploy, gpus), env=deploy.USER_ENV)
        for name, service in model["services"].items():
            for volume in service.get("volumes", []):
                source = str(volume).split(":")[0]
                if source.startswith(".") and source != "./data":
                    assert (REPO / source).exists(), f"{name}: {source} missing"
                elif not source.startswith((".", "/")):
                    assert source in model["volumes"], f"{name}: volume {source} undeclared"


def test_redis_keeps_its_append_only_file_on_a_volume(deploy, rendered):
    """A restarted Redis pod must find its AOF (streams, consumer groups, the published
    version): /data is a ReadWriteOnce claim, and the Deployment recreates rather than rolls."""
    redis = next(o for o in rendered if o["kind"] == "Deployment"
                 and o["metadata"]["name"] == "forage-redis")
    spec = redis["spec"]["template"]["spec"]
    container = next(c for c in spec["containers"] if c["name"] == "redis")
    assert "--appendonly" in container["args"]
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/data"]
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    claim = volume["persistentVolumeClaim"]["claimName"]
    pvc = next(o for o in rendered if o["kind"] == "PersistentVolumeClaim"
               and o["metadata"]["name"] == claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert redis["spec"]["strategy"]["type"] == "Recreate"


@pytest.mark.parametrize("layout", [None, "cpu", 1, 2, 8])
def test_every_built_service_names_a_dockerfile_that_exists(deploy, layout):
    """`docker compose -f docker-compose.yml -f LAYOUT build` builds every service with a
    `build:` section: each must name a context and Dockerfile that exist, relative to the
    project directory (the first file's folder). deploy/compose/cpu.yml once gave its `data`
    service `build: {target: cpu}` alone, so Compose looked for ./Dockerfile."""
    files = [deploy.COMPOSE_FILE]
    if layout == "cpu":
        files.append(REPO / "deploy" / "compose" / "cpu.yml")
    elif layout is not None:
        files.append(deploy.LAYOUTS[layout])
    services = deploy.compose_model(*files, env=deploy.USER_ENV)["services"]
    built = {name: s["build"] for name, s in services.items() if "build" in s}
    assert built
    for name, build in built.items():
        context = REPO / build.get("context", ".")
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        assert dockerfile.is_file(), f"{name}: docker compose build looks for {dockerfile}"
