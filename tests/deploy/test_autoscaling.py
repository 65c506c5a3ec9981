"""The rollout autoscaler: KEDA's Redis Streams scaler on the prompts stream (the default,
deploy/k8s/rollout-keda.yaml) and the prometheus-adapter HPA (the alternative,
deploy/k8s/rollout-hpa.yaml).

The ScaledObject is validated strictly against KEDA's own published CRD schema (vendored), its
trigger metadata against the parameters KEDA's redis-streams scaler reads, and its stream,
group and address against the run config. Then its rule runs on a real Redis: the metrics it
names are read as KEDA reads them (XINFO GROUPS lag and XPENDING of the `rollout` group) while
Forage's own stream code publishes a step's groups and a replica takes its share, and the
replicas the rule asks for must follow the work without pinning the maximum.

The bound on replicas is the cluster's: each replica takes a GPU, and with the run's other pods
the most the autoscaler may ask for must fit the cluster docs/deploy.md says the run needs. The
rule's own tests raise the bound as docs/deploy.md tells a user with more GPUs to.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import redis
import yaml

from services.common.config import load_config
from services.common.streams import CONSUMER_GROUPS, RedisStreams, stream_key

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "search_r1_nq_hotpotqa.yaml"
HPA_FILE = REPO / "deploy" / "k8s" / "rollout-hpa.yaml"
DEPLOY_DOC = REPO / "docs" / "deploy.md"
ROLLOUT = "forage-rollout"
# A cluster with GPUs for several replicas, for the rule's tests (the shipped bound is 1).
LARGER_CLUSTER_GPUS = 8
# The trigger metadata KEDA v2.20.2's redis-streams scaler reads (pkg/scalers/
# redis_streams_scaler.go and the connection fields of redis_scaler.go); anything else is
# ignored by KEDA, so a typo would silently change the rule.
REDIS_STREAMS_KEYS = {
    "stream", "consumerGroup", "pendingEntriesCount", "streamLength", "lagCount",
    "activationLagCount", "databaseIndex", "enableTLS", "address", "addresses", "host", "hosts",
    "port", "ports", "username", "password", "sentinelUsername", "sentinelPassword",
    "sentinelMaster", "unsafeSsl",
}


@pytest.fixture(scope="module")
def scaled(rendered):
    (obj,) = [o for o in rendered if o["kind"] == "ScaledObject"]
    return obj


def documented_cluster_gpus() -> int:
    """The GPUs docs/deploy.md says the Kubernetes run needs ("What the cluster needs")."""
    (gpus,) = re.findall(r"GPUs for the run: (\d+)", DEPLOY_DOC.read_text())
    return int(gpus)


def gpu_budget(deploy, rendered) -> tuple[int, int]:
    """(GPUs one rollout pod requests, GPUs the run's other pods request together)."""
    rollout = deploy.pod_gpus(deploy.pod_spec(deploy.by_kind(rendered, "Deployment")[ROLLOUT]))
    others = sum(n for name, n in deploy.gpus_reserved(rendered).items() if name != ROLLOUT)
    return rollout, others


@pytest.fixture(scope="module")
def scaled_larger(deploy, rendered, scaled):
    """The ScaledObject with maxReplicaCount set as docs/deploy.md says for a cluster of
    LARGER_CLUSTER_GPUS: its GPUs minus the other pods' (each replica takes one)."""
    rollout, others = gpu_budget(deploy, rendered)
    obj = copy.deepcopy(scaled)
    obj["spec"]["maxReplicaCount"] = (LARGER_CLUSTER_GPUS - others) // rollout
    return obj


@pytest.fixture(scope="module")
def run_config():
    return load_config(CONFIG, environ={})


def replica_capacity(cfg) -> int:
    """Groups one replica plays at once (services/rollout/worker.py's rule)."""
    return cfg.rollout.groups_per_batch or max(1, cfg.rollout.max_batch_size
                                                  // max(1, cfg.data.n_samples))


def test_scaled_object_validates_against_kedas_schema_strictly(deploy, scaled):
    assert deploy.k8s_errors([scaled]) == []
    for mutate, expected in [
        (lambda o: o["spec"].update(maxReplicas=4), "maxReplicas"),          # the HPA's name
        (lambda o: o["spec"]["advanced"]["scalingModifiers"].update(metricType="Bogus"),
         "Bogus"),
        (lambda o: o["spec"]["triggers"][0].update(metadata={"lagCount": 204}), "204"),
    ]:
        broken = copy.deepcopy(scaled)
        mutate(broken)
        errors = deploy.k8s_errors([broken])
        assert errors and any(expected in e for e in errors), errors


def test_scaled_object_targets_the_unpinned_rollout_deployment(deploy, rendered, scaled):
    rollout = deploy.by_kind(rendered, "Deployment")["forage-rollout"]
    target = scaled["spec"]["scaleTargetRef"]
    assert target["name"] == "forage-rollout" and target.get("kind", "Deployment") == "Deployment"
    assert "replicas" not in rollout["spec"], "kubectl apply would reset the autoscaled count"
    assert not deploy.by_kind(rendered, "HorizontalPodAutoscaler"), "two autoscalers"


def test_triggers_read_the_runs_prompts_stream_from_kedas_namespace(scaled, run_config,
                                                                     keda_rule):
    triggers = {t["name"]: t for t in scaled["spec"]["triggers"]}
    assert set(keda_rule.formula_terms(scaled)) == set(triggers)
    capacity = replica_capacity(run_config)
    url = redis.connection.parse_url(run_config.redis.url)
    namespace = yaml.safe_load((REPO / "kustomization.yaml").read_text())["namespace"]
    kinds = set()
    for trigger in triggers.values():
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams"
        assert set(meta) <= REDIS_STREAMS_KEYS, set(meta) - REDIS_STREAMS_KEYS
        assert meta["stream"] == stream_key(run_config.redis.namespace, "prompts")
        assert meta["consumerGroup"] == CONSUMER_GROUPS["prompts"]
        # KEDA's operator runs in its own namespace: a bare service name would not resolve.
        assert meta["address"] == (f"{url['host']}.{namespace}.svc.cluster.local:"
                                   f"{url.get('port', 6379)}")
        kind = "lag" if "lagCount" in meta else "pending"
        kinds.add(kind)
        assert int(meta["lagCount" if kind == "lag" else "pendingEntriesCount"]) == capacity
    assert kinds == {"lag", "pending"}  # waiting for a replica, and being played
    assert float(scaled["spec"]["advanced"]["scalingModifiers"]["target"]) == capacity


def test_the_replica_bound_fits_the_documented_cluster(deploy, rendered, scaled, run_config,
                                                      keda_rule):
    """At its bound, the autoscaler's replicas and the run's other pods request every GPU of
    the cluster docs/deploy.md describes and no more (a replica past it stays Pending, or
    makes a cluster autoscaler buy a GPU node); so does the HPA alternative. A training step's
    groups ask for more replicas than that, and get the bound."""
    gpus = documented_cluster_gpus()
    rollout, others = gpu_budget(deploy, rendered)
    assert rollout >= 1 and others >= 1
    hpa = yaml.safe_load(HPA_FILE.read_text())
    for bound in (scaled["spec"]["maxReplicaCount"], hpa["spec"]["maxReplicas"]):
        assert bound * rollout + others == gpus, (bound, rollout, others, gpus)
    (lag,) = [t["name"] for t in scaled["spec"]["triggers"] if "lagCount" in t["metadata"]]
    step = {name: 0 for name in keda_rule.formula_terms(scaled)}
    step[lag] = run_config.learner.train_batch_size
    wanted = keda_rule.desired_replicas(scaled, step)
    assert wanted * rollout + others <= gpus, wanted


def test_prometheus_adapter_alternative_validates_and_uses_the_same_target(deploy, run_config):
    hpa = yaml.safe_load(HPA_FILE.read_text())
    hpa["metadata"]["namespace"] = "forage"
    assert deploy.k8s_errors([hpa]) == []
    (metric,) = hpa["spec"]["metrics"]
    assert float(metric["external"]["target"]["averageValue"]) == replica_capacity(run_config)


def test_the_rule_follows_the_work_on_a_real_stream(redis_url, namespace, scaled_larger,
                                                    run_config, keda_rule):
    """A step's groups are published by Forage's stream code, replicas take their share, and
    the lag / pending KEDA reads give the replicas the formula asks for (on a cluster with
    GPUs for them)."""
    scaled = scaled_larger
    triggers = {t["name"]: t["metadata"] for t in scaled["spec"]["triggers"]}
    capacity = replica_capacity(run_config)
    client = redis.Redis.from_url(redis_url)
    streams = RedisStreams(client, namespace, stream_maxlen=10_000)
    key = stream_key(namespace, "prompts")

    def keda_metrics() -> dict[str, int]:
        return keda_rule.trigger_metrics(client, scaled, key)

    desired_replicas = keda_rule.desired_replicas

    try:
        groups = run_config.learner.train_batch_size  # one step's prompt groups
        streams.ensure_group("prompts")
        streams.publish_many("prompts", [b"g%d" % i for i in range(groups)])
        queued = desired_replicas(scaled, keda_metrics())
        assert queued == math.ceil(groups / capacity)
        assert queued < scaled["spec"]["maxReplicaCount"], "a step's groups pin the maximum"

        taken = streams.consume("prompts", "replica-0", count=capacity, block_ms=0)
        assert len(taken) == capacity
        assert keda_metrics() == {name: capacity if "pendingEntriesCount" in meta
                                  else groups - capacity for name, meta in triggers.items()}
        assert desired_replicas(scaled, keda_metrics()) == queued  # taken work still counts

        streams.ack("prompts", [m.id for m in taken])
        rest = streams.consume("prompts", "replica-1", count=groups, block_ms=0)
        streams.ack("prompts", [m.id for m in rest])
        assert sum(keda_metrics().values()) == 0
        assert desired_replicas(scaled, keda_metrics()) == scaled["spec"]["minReplicaCount"]
    finally:
        streams.close()


def test_the_hpa_behaviour_holds_replicas_through_the_window_then_drops_one_per_period(
        scaled_larger, run_config, keda_rule):
    """The manifest's behaviour, at 1/60 of real time (on a cluster with GPUs for 3 replicas):
    a burst scales up at once; when the work goes, the count holds for the scale-down window
    and then falls one pod per period."""
    scaled = scaled_larger
    spec = scaled["spec"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    window = behavior["stabilizationWindowSeconds"] / 60
    period = behavior["policies"][0]["periodSeconds"] / 60
    capacity = replica_capacity(run_config)
    (lag,) = [t["name"] for t in spec["triggers"] if "lagCount" in t["metadata"]]
    (pending,) = [t["name"] for t in spec["triggers"] if "pendingEntriesCount" in t["metadata"]]
    scaler = keda_rule.Autoscaler(scaled, replicas=1, time_scale=1 / 60)
    assert scaler.poll(0.0, {lag: 2 * capacity, pending: capacity}) == 3
    idle = {lag: 0, pending: 0}
    assert scaler.poll(window - 0.1, idle) == 3            # inside the window: held
    assert scaler.poll(window + 0.1, idle) == 2            # one pod ...
    assert scaler.poll(window + 0.2, idle) == 2            # ... per policy period
    assert scaler.poll(window + 0.1 + period + 0.01, idle) == 1
    assert scaler.poll(window + 10 * period, idle) == spec["minReplicaCount"]
