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
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from services.common.config import load_config
from services.learner.distributed import NODE_RANK_ENV

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


def _torchrun(container: dict):
    """The container's torchrun arguments as torchrun itself parses them."""
    from torch.distributed.run import get_args_parser

    command = container["command"]
    assert command[0] == "torchrun"
    return get_args_parser().parse_args(command[1:] + container["args"])


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
    assert before["command"][-2:] == after["command"][-2:] == ["--no-python", "forage"]


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
    local = _torchrun(container).local_addr
    assert "$(POD_NAME)" in local
    for replicas in (2, 3, 10, 11, 100):
        addresses = [local.replace("$(POD_NAME)", f"{STS}-{i}") for i in range(replicas)]
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
