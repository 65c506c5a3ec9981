"""Kubernetes start-up: the steps of docs/deploy.md, their GPUs, and who waits for whom.

The objects each step creates are rendered as in test_manifests.py (the `steps` fixture):
1. deploy/k8s/data-loader (the data volume ReadWriteMany), or deploy/k8s/single-node (the same
   with the volume ReadWriteOnce, for a one-node cluster);
2. deploy/k8s/index: the index build, a Job, which completes before
3. the run, `kubectl apply -k .` at the repository root.
A pod's GPU is reserved from the moment it is scheduled, for its effective request (the larger
of its app containers' sum and its largest init container), so a pod waiting in an init
container holds its GPU. The tests check that nothing holds a GPU through the build, that each
step fits the compose file's 4-GPU node, and they run the init containers' own commands as
local processes: the retriever's index check fails at once without an index, and the rollout
and learner pods wait for a retriever that answers /healthz, however long that takes.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from services.common.config import load_config
from services.common.ports import free_port as _free_port

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/search_r1_nq_hotpotqa.yaml"
CONTAINER_CONFIG = "/config/search_r1_nq_hotpotqa.yaml"
BIN = Path(sys.executable).parent
# compose service -> the Kubernetes workload that runs it, and the step that creates it
WORKLOADS = {"retriever-index": ("index", "forage-index"), "retriever": ("run", "forage-retriever"),
             "rollout": ("run", "forage-rollout"), "learner": ("run", "forage-learner")}
WORKLOAD_KINDS = ("Pod", "Deployment", "StatefulSet", "Job")


def _workloads(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in WORKLOAD_KINDS}


def _env() -> dict[str, str]:
    return {"PATH": f"{BIN}:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}


# ------------------------------------------------------------------ GPUs

def test_each_step_fits_the_4_gpu_node_and_the_build_holds_the_only_gpu(deploy, steps):
    """The build reserves one GPU and runs alone; the run needs the compose file's 4-GPU layout
    (retriever 1, one rollout replica 1, learner 2) and nothing more, so no pod of it is
    Pending on a 4-GPU node; step 1 reserves none."""
    services = deploy.compose_model(env=deploy.USER_ENV)["services"]
    layout = {name: len(deploy.device_ids(services[name])) for name in WORKLOADS}
    assert layout == {"retriever-index": 1, "retriever": 1, "rollout": 1, "learner": 2}
    expected: dict[str, dict[str, int]] = {}
    for service, (step, workload) in WORKLOADS.items():
        expected.setdefault(step, {})[workload] = layout[service]
    for step, objects in steps.items():
        reserved = deploy.gpus_reserved(objects)
        assert reserved == expected.get(step, {}), step
        assert sum(reserved.values()) <= 4, step


def test_the_run_builds_no_index_and_the_retriever_does_not_wait_for_one(deploy, steps,
                                                                         tmp_path):
    """Nothing of the run waits for the build (hours) with a GPU: the build is not part of the
    run, and the retriever's init containers check for the index and fail at once without it,
    saying which step builds it; with the index's manifest.json they pass."""
    for name, workload in _workloads(steps["run"]).items():
        pod = deploy.pod_spec(workload)
        for container in pod.get("initContainers", []) + pod["containers"]:
            assert "build-index" not in container.get("args", []), name
    assert any("build-index" in c.get("args", []) for w in _workloads(steps["index"]).values()
               for c in deploy.pod_spec(w)["containers"])
    retriever = deploy.pod_spec(_workloads(steps["run"])["forage-retriever"])
    checks = retriever.get("initContainers", [])
    assert checks
    index_dir = load_config(REPO / CONFIG, environ={}).retriever.index_dir
    assert index_dir.startswith("/data/")
    data = tmp_path / "data"
    data.mkdir()

    def run_checks() -> list[subprocess.CompletedProcess]:
        results = []
        for check in checks:
            argv = [arg.replace("/data/", f"{data}/") for arg in check["command"]
                    + check.get("args", [])]
            try:
                results.append(subprocess.run(argv, capture_output=True, text=True, timeout=10,
                                              env=_env()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"init container {check['name']} still waits after 10 s: the "
                            "retriever pod would hold its GPU through the index build")
        return results

    failed = [r for r in run_checks() if r.returncode != 0]
    assert failed, "the retriever starts without an index"
    message = failed[0].stdout + failed[0].stderr
    assert "kubectl apply -k deploy/k8s/index" in message, message
    assert (REPO / "deploy" / "k8s" / "index" / "kustomization.yaml").exists()
    manifest = data / Path(index_dir).relative_to("/data") / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text("{}")
    assert [r.returncode for r in run_checks()] == [0] * len(checks)


# ------------------------------------------------------------------ rollout and learner wait

class _Retriever:
    """A stand-in retriever: /healthz answers 503 (index loading) `loading` times, then 200."""

    def __init__(self, port: int, loading: int) -> None:
        self.hits: list[int] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                status = 503 if len(outer.hits) < loading else 200
                outer.hits.append(status)
                if self.path != "/healthz":
                    status = 404
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_rollout_and_learner_wait_for_a_retriever_that_can_search(deploy, rendered, tmp_path):
    """Each rollout and learner pod starts only once the retriever answers /healthz (200 only
    with the index loaded) at the run config's retriever address: an init container, in the
    pod's own image, reading the generated ConfigMap. Run here against a stand-in retriever: it
    waits while nothing listens (and says so), keeps waiting through a 503, then exits 0."""
    (configmap,) = deploy.by_kind(rendered, "ConfigMap").values()
    waits = {}
    for name in ("forage-rollout", "forage-learner"):
        pod = deploy.pod_spec(_workloads(rendered)[name])
        inits = pod.get("initContainers", [])
        assert len(inits) == 1, f"{name}: no init container gates it on the retriever"
        (wait,) = inits
        assert wait["image"] == pod["containers"][0]["image"], name
        volumes = {v["name"]: v for v in pod["volumes"]}
        (mount,) = wait["volumeMounts"]
        assert mount["mountPath"] == "/config" and mount.get("readOnly"), name
        assert volumes[mount["name"]]["configMap"]["name"] == configmap["metadata"]["name"], name
        waits[name] = wait["command"] + wait.get("args", [])
    assert waits["forage-rollout"] == waits["forage-learner"]
    argv = waits["forage-rollout"]
    assert argv[-1] == CONTAINER_CONFIG
    retriever = deploy.by_kind(rendered, "Service")["retriever"]
    cfg = load_config(REPO / CONFIG, environ={})
    assert cfg.retriever.url.startswith(f"http://retriever:{retriever['spec']['ports'][0]['port']}/")
    probe = _workloads(rendered)["forage-retriever"]["spec"]["template"]["spec"]["containers"][0][
        "readinessProbe"]
    assert probe["httpGet"]["path"] == "/healthz"

    port = _free_port()
    raw = yaml.safe_load(configmap["data"][Path(CONTAINER_CONFIG).name])
    raw["retriever"]["url"] = f"http://127.0.0.1:{port}/retrieve"
    local_config = tmp_path / "config.yaml"
    local_config.write_text(yaml.safe_dump(raw))
    log = tmp_path / "wait.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv[:-1] + [str(local_config)], stdout=out,
                                stderr=subprocess.STDOUT, env=_env(), cwd=tmp_path)
    retriever_up = None
    try:
        deadline = time.monotonic() + 20
        while "waiting for the retriever" not in log.read_text():
            assert proc.poll() is None, f"exited {proc.returncode} with no retriever:\n" \
                                        f"{log.read_text()}"
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        time.sleep(1.0)
        assert proc.poll() is None, log.read_text()  # still waiting, no give-up
        retriever_up = _Retriever(port, loading=1)
        assert proc.wait(timeout=20) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if retriever_up is not None:
            retriever_up.close()
    assert retriever_up.hits[:2] == [503, 200]  # waited through the index load
    assert "retriever ready" in log.read_text()


# ------------------------------------------------------------------ storage variants

def test_single_node_variant_only_makes_the_data_volume_read_write_once(deploy, steps):
    """deploy/k8s/single-node is step 1 with the data volume ReadWriteOnce and nothing else
    changed. The index build and the run only name the claim (so they are the same after either
    step 1); every pod that mounts it is one of theirs or the loader."""
    multi, single = steps["data-loader"], steps["single-node"]
    claims = {step: deploy.by_kind(objects, "PersistentVolumeClaim").get("forage-data")
              for step, objects in steps.items()}
    assert claims["data-loader"]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claims["single-node"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claims["index"] is None and claims["run"] is None
    as_multi = copy.deepcopy(single)
    deploy.by_kind(as_multi, "PersistentVolumeClaim")["forage-data"]["spec"]["accessModes"] = [
        "ReadWriteMany"]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(as_multi, key=key) == sorted(multi, key=key)
    for step in ("index", "run"):
        mounting = [name for name, w in _workloads(steps[step]).items() if any(
            (v.get("persistentVolumeClaim") or {}).get("claimName") == "forage-data"
            for v in deploy.pod_spec(w).get("volumes", []))]
        assert mounting, step
        assert all(o["metadata"].get("namespace") == "forage" for o in steps[step]), step


def test_every_pod_uses_its_image_and_the_run_config(deploy, steps, rendered):
    """In every step, each container of a pod (init containers too) runs the pod's image, so a
    GPU node pulls only forage:gpu and a CPU pod only forage:cpu; the pods that mount /config
    mount the ConfigMap generated from the compose file's config."""
    (configmap,) = deploy.by_kind(rendered, "ConfigMap").values()
    assert configmap["data"] == {Path(CONFIG).name: (REPO / CONFIG).read_text()}
    for step, objects in steps.items():
        for name, workload in _workloads(objects).items():
            pod = deploy.pod_spec(workload)
            image = pod["containers"][0]["image"]
            if not image.startswith("forage:"):
                continue  # redis and its exporter
            assert image == ("forage:gpu" if deploy.pod_gpus(pod) else "forage:cpu"), name
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for container in pod.get("initContainers", []) + pod["containers"]:
                assert container["image"] == image, (step, name, container["name"])
                for mount in container.get("volumeMounts", []):
                    if mount["mountPath"] == "/config":
                        assert volumes[mount["name"]]["configMap"]["name"] == \
                            configmap["metadata"]["name"], (step, name, container["name"])


def test_the_deploy_guide_applies_the_steps_in_order():
    """docs/deploy.md: step 1 (either variant), the index build waited for, then the run."""
    text = (REPO / "docs" / "deploy.md").read_text()
    section = text[text.index("## Kubernetes, step by step"):]
    order = [section.index(command) for command in (
        "kubectl apply -k deploy/k8s/data-loader",
        "kubectl apply -k deploy/k8s/index",
        "kubectl -n forage wait --for=condition=complete",
        "kubectl apply -k .`")]
    assert order == sorted(order)
    assert "kubectl apply -k deploy/k8s/single-node" in section
