"""deploy/k8s/multinode-learner: the opt-in Component that runs the learner on several nodes.

Rendered as `kubectl apply -k .` renders the run once the root kustomization.yaml lists the
component (deploy_files.root_with_components; kubectl kustomize where installed, and the
Python renderer, which must agree), then validated strictly like every step. The checks are
what the learner relies on across nodes (tests/learner/test_multinode.py runs it on two
loopback "nodes"): torchrun's node count and ranks per node match the replicas and their GPUs,
the c10d rendezvous is on pod 0's stable name, which the pods publish before they are Ready,
pod 0 sorts first by the address torchrun orders nodes by (so it holds global rank 0, which
serves the weights, and the `learner` Service selects it alone), every pod mounts one shared
checkpoint volume, and nothing else of the run changes.

The pods' launch command runs as the pods run it: Kubernetes' $(VAR) expansion with the pod's
environment, then `sh -c`, then torchrun, two "pods" on loopback with each pod's DNS name
replaced by the loopback address the cluster's DNS would answer. It checks that pod 0 hosts
the c10d rendezvous store because the manifest says so (torchrun's `is_host`), not because
torchrun guessed it from host names: on loopback every name matches the machine, so the guess
would let whichever pod starts first host it, and in a cluster it rests on DNS answering for
pod 0's own name when pod 0 starts.
"""

from __future__ import annotations

import copy
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from services.common.config import load_config
from services.common.ports import free_port
from services.learner.distributed import NODE_RANK_ENV
from tests.process_tree import kill_tree

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/search_r1_nq_hotpotqa.yaml"
STS = "forage-learner"


@pytest.fixture(scope="module")
def variant_root(deploy, tmp_path_factory) -> Path:
    return deploy.root_with_components([deploy.K8S_COMPONENTS["multinode-learner"]],
                                       tmp_path_factory.mktemp("multinode"))


@pytest.fixture(scope="module")
def variant(deploy, variant_root) -> list[dict]:
    """The objects of the run with the component enabled."""
    return deploy.render(variant_root)


def _learner(deploy, objects: list[dict]) -> tuple[dict, dict]:
    sts = deploy.by_kind(objects, "StatefulSet")[STS]
    return sts, sts["spec"]["template"]["spec"]["containers"][0]


def _k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a container's command and args: $(NAME) becomes the variable's
    value when the container defines it and stays as written otherwise, $$ becomes $."""
    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, text)


def _pod_env(container: dict, pod: str, index: int) -> dict[str, str]:
    """The container's environment in pod `pod` (StatefulSet ordinal `index`), in order, each
    value expanded with the ones before it, as the kubelet builds it."""
    fields = {"metadata.name": pod, "metadata.namespace": "forage",
              "metadata.labels['apps.kubernetes.io/pod-index']": str(index)}
    env: dict[str, str] = {}
    for item in container["env"]:
        source = item.get("valueFrom", {})
        if "fieldRef" in source:
            env[item["name"]] = fields[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            env[item["name"]] = "secret-from-the-test"
        else:
            env[item["name"]] = _k8s_expand(item["value"], env)
    return env


def _pod_words(container: dict, pod: str, index: int) -> list[str]:
    """What the pod's container executes: its command and args after Kubernetes' expansion."""
    env = _pod_env(container, pod, index)
    return [_k8s_expand(word, env) for word in container["command"] + container["args"]]


def _launch_script(words: list[str]) -> list[str]:
    """The words of the `sh -c` script that launches torchrun (the shell part before it
    aside), and the container's args it passes on as "$@"."""
    assert words[:2] == ["sh", "-c"] and words[3] == "torchrun", words[:4]
    script = shlex.split(words[2])
    start = script.index("exec")
    assert script[start + 1] == "torchrun"
    return script[start + 2:]


def _torchrun(container: dict, pod: str = f"{STS}-0", index: int = 0):
    """torchrun's arguments in a pod as torchrun itself parses them (the script's own words;
    `is_host`, which the shell fills in, is checked on the running pods)."""
    from torch.distributed.run import get_args_parser

    words = _pod_words(container, pod, index)
    args = _launch_script(words)
    assert args[-1] == "$@"
    return get_args_parser().parse_args(args[:-1] + words[4:])


def test_variant_validates_and_both_renderers_agree(deploy, variant, variant_root):
    assert deploy.k8s_errors(variant) == []
    if deploy.kubectl() is not None:  # `variant` came from kubectl: the Python renderer agrees
        ours = deploy.render_kustomization(variant_root)
        key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
        assert {key(o): o for o in ours} == {key(o): o for o in variant}
    # the shipped root kustomization leaves it off: the single-node learner is the default
    assert "components" not in yaml.safe_load((REPO / "kustomization.yaml").read_text())


def test_only_the_learner_changes(deploy, variant, rendered):
    """Every object of the default run is there unchanged, except the learner StatefulSet and
    the `learner` Service; the component adds the nodes' Service, the checkpoint claim and
    the learner pods' network policy (test_network_policies.py checks what it allows)."""
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    default, multi = {key(o): o for o in rendered}, {key(o): o for o in variant}
    changed = {k for k in default if default[k] != multi.get(k)}
    assert changed == {("StatefulSet", STS), ("Service", "learner")}
    assert set(multi) - set(default) == {("Service", "learner-nodes"),
                                         ("PersistentVolumeClaim", "forage-learner-checkpoints"),
                                         ("NetworkPolicy", "forage-learner-peers")}
    # the learner keeps its image, arguments, probes and mounts; only the launcher differs
    (_, before), (_, after) = _learner(deploy, rendered), _learner(deploy, variant)
    for field in ("image", "args", "startupProbe", "readinessProbe", "livenessProbe",
                  "volumeMounts"):
        assert after[field] == before[field], field
    assert before["command"][-2:] == ["--no-python", "forage"]
    assert _launch_script(after["command"])[-3:] == ["--no-python", "forage", "$@"]


def test_torchrun_spans_the_replicas_with_c10d_on_pod_0(deploy, variant):
    sts, container = _learner(deploy, variant)
    args = _torchrun(container)
    replicas = sts["spec"]["replicas"]
    assert replicas >= 2 and args.nnodes == str(replicas)
    gpus = deploy.pod_gpus(sts["spec"]["template"]["spec"])
    assert int(args.nproc_per_node) == gpus >= 1  # one rank per GPU of the pod
    assert deploy.gpus_reserved(variant)[STS] == replicas * gpus
    assert args.rdzv_backend == "c10d" and args.rdzv_id
    host, port = args.rdzv_endpoint.rsplit(":", 1)
    nodes = deploy.by_kind(variant, "Service")[sts["spec"]["serviceName"]]
    assert host == f"{STS}-0.{nodes['metadata']['name']}"  # pod 0's stable DNS name
    assert nodes["spec"]["clusterIP"] == "None" and nodes["spec"]["publishNotReadyAddresses"]
    [rdzv] = [p for p in nodes["spec"]["ports"] if p["port"] == int(port)]
    assert {"name": rdzv["targetPort"], "containerPort": int(port)} in container["ports"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # all pods join at once
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}  # never two templates mixed
    # the learner's own arguments are the default's: --resume on every restart
    assert container["args"][-1] == "--resume"


def test_pod_0_holds_global_rank_0_and_alone_serves_weights(deploy, variant):
    """c10d numbers the nodes in the order of their --local-addr (as strings): expanded for
    every pod, pod 0's sorts first, for any replica count up to 100. FORAGE_NODE_RANK is the
    pod index, which the learner checks on rank 0; `learner` (the replicas' weight address)
    selects pod 0 only, on the port the config names."""
    sts, container = _learner(deploy, variant)
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env[NODE_RANK_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    for replicas in (2, 3, 10, 11, 100):
        addresses = [_torchrun(container, f"{STS}-{i}", i).local_addr for i in range(replicas)]
        assert addresses[0] == f"{STS}-0.{sts['spec']['serviceName']}"
        assert sorted(addresses)[0] == addresses[0], replicas
    service = deploy.by_kind(variant, "Service")["learner"]
    assert service["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == f"{STS}-0"
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"][
        "labels"].items() | {("statefulset.kubernetes.io/pod-name", f"{STS}-0")}
    cfg = load_config(REPO / CONFIG, environ={})
    assert cfg.learner.weight_sync_host == "learner"
    assert cfg.learner.weight_sync_port in {p["port"] for p in service["spec"]["ports"]}


def test_every_pod_mounts_one_shared_checkpoint_volume(deploy, variant):
    sts, container = _learner(deploy, variant)
    assert "volumeClaimTemplates" not in sts["spec"]  # not a claim per pod
    pod = sts["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    cfg = load_config(REPO / CONFIG, environ={})
    [mount] = [m for m in container["volumeMounts"]
               if Path(cfg.learner.checkpoint_dir).is_relative_to(m["mountPath"])]
    claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
    pvc = deploy.by_kind(variant, "PersistentVolumeClaim")[claim]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert not mount.get("readOnly")


def test_strict_validation_rejects_a_malformed_variant(deploy, variant):
    objects = copy.deepcopy(variant)
    deploy.by_kind(objects, "StatefulSet")[STS]["spec"].update(podManagmentPolicy="Parallel")
    errors = deploy.k8s_errors(objects)
    assert errors and any("podManagmentPolicy" in e for e in errors), errors


# The learner program's stand-in on the pods' PATH (`--no-python forage`): each rank records
# what torchrun gave it, and the words its torchrun (the rank's parent) was started with.
RANK_PROBE = """#!/bin/sh
echo "$FORAGE_NODE_RANK $RANK $GROUP_RANK $MASTER_ADDR" > "$PROBE_OUT/rank-$RANK"
tr '\\0' '\\n' < /proc/$PPID/cmdline > "$PROBE_OUT/torchrun-$FORAGE_NODE_RANK"
"""


def _listener(pids: list[int], port: int) -> int | None:
    for pid in pids:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp")):
                return pid
        except psutil.NoSuchProcess:
            pass
    return None


def test_the_pods_launch_words_make_pod_0_the_rendezvous_host(deploy, variant, tmp_path):
    """Every pod runs the container's command as written (Kubernetes' expansion, sh, real
    torchrun) with the learner program replaced by a probe, pod 1 first. Only pod 0 ever
    listens on the rendezvous port, every pod's torchrun got is_host=1 on pod 0 and 0
    elsewhere, and the rendezvous completes with global rank 0 on pod 0."""
    from torch.distributed.run import get_args_parser

    sts, container = _learner(deploy, variant)
    replicas, nodes = sts["spec"]["replicas"], sts["spec"]["serviceName"]
    nproc = int(_torchrun(container).nproc_per_node)
    # The cluster's DNS, on loopback: each pod's stable name answers with that pod's address,
    # and the rendezvous Service's port is a free one here.
    address = {f"{STS}-{i}.{nodes}": f"127.0.0.{i + 1}" for i in range(replicas)}
    endpoint = _torchrun(container).rdzv_endpoint
    port = free_port()
    names = re.compile("|".join(re.escape(name) + r"\b" for name in address))

    def resolved(word: str) -> str:
        return names.sub(lambda m: address[m.group(0)],
                         word.replace(endpoint, f"{endpoint.rsplit(':', 1)[0]}:{port}"))

    bin_dir, out = tmp_path / "bin", tmp_path / "ranks"
    bin_dir.mkdir()
    out.mkdir()
    (bin_dir / "forage").write_text(RANK_PROBE)
    (bin_dir / "forage").chmod(0o755)
    pods: dict[int, subprocess.Popen] = {}
    logs = {i: tmp_path / f"pod{i}.log" for i in range(replicas)}
    try:
        for i in reversed(range(replicas)):  # the host last: the others must wait for it
            env = {**_pod_env(container, f"{STS}-{i}", i), "PROBE_OUT": str(out),
                   "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
                   "HOME": str(tmp_path), "LOGLEVEL": "INFO"}
            words = [resolved(w) for w in _pod_words(container, f"{STS}-{i}", i)]
            pods[i] = subprocess.Popen(words, env=env, stdout=logs[i].open("w"),
                                       stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 60
            while i and "Starting elastic_operator" not in logs[i].read_text():
                assert pods[i].poll() is None and time.monotonic() < deadline, \
                    logs[i].read_text()[-3000:]
                time.sleep(0.05)
        deadline = time.monotonic() + 60
        while (host := _listener([p.pid for p in pods.values()], port)) is None:
            assert time.monotonic() < deadline, "nothing listens on the rendezvous port"
            time.sleep(0.05)
        assert host == pods[0].pid, "the rendezvous store is not hosted by pod 0"
        codes = {i: pod.wait(timeout=120) for i, pod in pods.items()}
        assert codes == dict.fromkeys(pods, 0), {i: logs[i].read_text()[-3000:] for i in pods}
    finally:
        for pod in pods.values():
            if pod.poll() is None:
                kill_tree(pod)
    parser = get_args_parser()
    for i in range(replicas):
        words = (out / f"torchrun-{i}").read_text().split("\n")
        args = parser.parse_args(words[words.index("--nnodes=2"):-1])
        assert f"is_host={int(i == 0)}" in args.rdzv_conf.split(","), (i, args.rdzv_conf)
    ranks = {int(f.name.split("-")[1]): f.read_text().split() for f in out.glob("rank-*")}
    assert sorted(ranks) == list(range(replicas * nproc))
    assert ranks[0] == ["0", "0", "0", address[f"{STS}-0.{nodes}"]]  # pod 0, group rank 0
    for rank, (pod, _, group, _) in ranks.items():
        assert pod == group == str(rank // nproc), (rank, ranks[rank])
