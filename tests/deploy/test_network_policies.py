"""deploy/k8s/network-policies.yaml: the run's NetworkPolicies select the pods the manifests
create and let exactly the needed traffic through.

No cluster is needed: the policies are read from the rendered objects (kubectl kustomize, or
the Python renderer) and evaluated the way the NetworkPolicy API defines them (a pod selected
by a policy of a direction accepts only what some such policy's rule allows; a connection needs
the source's egress and the destination's ingress; a named port is the destination
container's port of that name). The pods are the pod templates of every Kubernetes step
(data loader, index build, the run, and the multi-node learner variant), plus the peers the
policies name from outside: Prometheus (namespace monitoring), KEDA's operator (namespace keda),
a user's pod labelled as a retriever client, a stranger's pod in the namespace, another
tenant's pod, and the cluster DNS. Every (source, destination, destination port) is checked
against the table of what Forage needs, so a missing rule and a too-wide one both fail.
The strict schema validation of the policies is test_manifests.py's, over the same objects.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest

NAMESPACE = "forage"
CLIENT_LABEL = {"forage.io/retriever-client": "true"}  # user pods: docs/deploy.md
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job", "Pod")


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str = NAMESPACE
    labels: dict[str, str] = field(default_factory=dict)
    ports: dict[str, tuple[int, str]] = field(default_factory=dict)  # name -> (number, protocol)

    external: bool = False  # an address outside the cluster: no namespace, no labels

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace}


OUTSIDERS = [
    Pod("user-client", labels=dict(CLIENT_LABEL)),
    Pod("stranger", labels={"app": "something-else"}),
    Pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}),
    Pod("keda-operator", "keda", {"app": "keda-operator"}),
    Pod("other-tenant", "team-b", {"app.kubernetes.io/name": "forage-rollout"}),
]
DNS = Pod("kube-dns", "kube-system", {"k8s-app": "kube-dns"},
          {"dns": (53, "UDP"), "dns-tcp": (53, "TCP")})
INTERNET = Pod("internet", "", ports={"https": (443, "TCP")}, external=True)
UNLISTED = "unlisted"

# What Forage needs: (source, destination, destination port name). Everything else between
# these pods is refused.
NEEDED = {
    ("forage-rollout", "forage-redis", "redis"), ("forage-scorer", "forage-redis", "redis"),
    ("forage-learner", "forage-redis", "redis"), ("keda-operator", "forage-redis", "redis"),
    ("prometheus", "forage-redis", "metrics"),
    ("forage-rollout", "forage-retriever", "http"), ("forage-learner", "forage-retriever", "http"),
    ("user-client", "forage-retriever", "http"), ("prometheus", "forage-retriever", "http"),
    ("prometheus", "forage-scorer", "http"),
    ("forage-rollout", "forage-learner", "weights"), ("prometheus", "forage-learner", "metrics"),
    # the weight relay listens on a port of its choosing: replicas reach each other on all
    ("forage-rollout", "forage-rollout", "metrics"), ("forage-rollout", "forage-rollout", UNLISTED),
    ("prometheus", "forage-rollout", "metrics"),
}


# ------------------------------------------------------------------ the API's rules

def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions; {} selects everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, op, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def peer_matches(peer: dict[str, Any], policy_namespace: str, pod: Pod) -> bool:
    """A from/to entry: podSelector alone means the policy's namespace; an ipBlock is taken
    to name no pod (these policies have none) and outside addresses only when it is all of
    them."""
    if "ipBlock" in peer:
        return pod.external and peer["ipBlock"].get("cidr") == "0.0.0.0/0"
    if pod.external:
        return False
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], pod.namespace_labels)
    else:
        in_namespace = pod.namespace == policy_namespace
    return in_namespace and ("podSelector" not in peer or selects(peer["podSelector"], pod.labels))


def port_matches(ports: list[dict[str, Any]] | None, destination: Pod, port: str) -> bool:
    if not ports:
        return True
    number, protocol = destination.ports[port]
    return any(p.get("protocol", "TCP") == protocol and p.get("port") in (None, port, number)
               for p in ports)


def policy_types(policy: dict[str, Any]) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]


def _side_allows(policies: list[dict], direction: str, subject: Pod, peer: Pod,
                 destination: Pod, port: str) -> bool:
    """Whether `subject`'s policies of `direction` let the connection to/from `peer` through:
    a subject no such policy selects is not isolated."""
    chosen = [p for p in policies if p["metadata"].get("namespace") == subject.namespace
              and direction in policy_types(p) and selects(p["spec"].get("podSelector"),
                                                           subject.labels)]
    if not chosen:
        return True
    key, peers_key = direction.lower(), "from" if direction == "Ingress" else "to"
    for policy in chosen:
        for rule in policy["spec"].get(key) or []:
            peers = rule.get(peers_key)
            if (not peers or any(peer_matches(x, subject.namespace, peer) for x in peers)) \
                    and port_matches(rule.get("ports"), destination, port):
                return True
    return False


def allowed(policies: list[dict], source: Pod, destination: Pod, port: str) -> bool:
    """A connection from `source` to `destination`'s port named `port`."""
    return (_side_allows(policies, "Egress", source, destination, destination, port)
            and _side_allows(policies, "Ingress", destination, source, destination, port))


# ------------------------------------------------------------------ the manifests

def pods_of(deploy, objects: list[dict]) -> list[Pod]:
    """One Pod per workload's template, with its labels and named container ports."""
    pods = []
    for obj in objects:
        if obj["kind"] not in WORKLOAD_KINDS:
            continue
        labels = (obj["metadata"] if obj["kind"] == "Pod"
                  else obj["spec"]["template"]["metadata"]).get("labels") or {}
        spec = deploy.pod_spec(obj)
        ports = {p["name"]: (p["containerPort"], p.get("protocol", "TCP"))
                 for c in spec["containers"] for p in c.get("ports", []) if "name" in p}
        pods.append(Pod(obj["metadata"]["name"], obj["metadata"].get("namespace", NAMESPACE),
                        dict(labels), ports))
    return pods


def policies_of(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] == "NetworkPolicy"]


def selector_problems(policies: list[dict], pods: list[Pod]) -> list[str]:
    """Selectors that select no pod of the manifests, and named ports that the selected
    pods do not expose (ingress: the policy's pods; egress: the pods the rule reaches)."""
    problems = []
    for policy in policies:
        name, spec = policy["metadata"]["name"], policy["spec"]
        own = [p for p in pods if selects(spec.get("podSelector"), p.labels)]
        if not own and spec.get("podSelector") != {} and \
                (spec.get("podSelector") or {}).get("matchLabels") != CLIENT_LABEL:
            problems.append(f"{name}: podSelector selects no pod")
        for direction, peers_key in (("ingress", "from"), ("egress", "to")):
            for rule in spec.get(direction) or []:
                reached = own
                if direction == "egress":
                    reached = [p for p in pods if any(peer_matches(x, NAMESPACE, p)
                                                      for x in rule.get("to") or [])]
                for peer in rule.get(peers_key) or []:
                    if "namespaceSelector" in peer or "ipBlock" in peer:
                        continue
                    if peer["podSelector"].get("matchLabels") == CLIENT_LABEL:
                        continue
                    if not any(selects(peer["podSelector"], p.labels) for p in pods):
                        problems.append(f"{name}: {direction} peer {peer} selects no pod")
                for port in rule.get("ports") or []:
                    if isinstance(port.get("port"), str):
                        missing = [p.name for p in reached if port["port"] not in p.ports]
                        if missing or not reached:
                            problems.append(f"{name}: {direction} port {port['port']!r} not "
                                            f"exposed by {missing or 'any pod'}")
    return problems


def with_unlisted(pod: Pod) -> Pod:
    """`pod` with one more listener its manifest does not name (a debugger, a stray server):
    nothing may reach it unless a rule opens every port."""
    return Pod(pod.name, pod.namespace, pod.labels, {**pod.ports, UNLISTED: (40000, "TCP")})


def matrix_problems(policies: list[dict], pods: list[Pod], needed: set) -> list[str]:
    """Every (source, destination, port) that the policies decide otherwise than `needed`;
    the sources in the namespace also must not reach outside addresses."""
    problems = []
    for source in [*pods, *OUTSIDERS]:
        inside = source.namespace == NAMESPACE
        for destination in [*map(with_unlisted, pods), *([INTERNET] if inside else [])]:
            for port in destination.ports:
                want = (source.name, destination.name, port) in needed
                if allowed(policies, source, destination, port) != want:
                    problems.append(f"{source.name} -> {destination.name}:{port} "
                                    f"{'refused' if want else 'allowed'}")
    for pod in pods:
        for port in DNS.ports:
            if not allowed(policies, pod, DNS, port):
                problems.append(f"{pod.name}: no DNS ({port})")
    return problems


@pytest.fixture(scope="module")
def cluster(deploy, steps) -> tuple[list[dict], list[Pod]]:
    """The run's policies and every pod template of every step (the loader, the index, the run)."""
    objects = steps["data-loader"] + steps["index"] + steps["run"]
    return policies_of(steps["run"]), pods_of(deploy, objects)


def test_policies_select_the_manifests_pods_and_name_ports_they_expose(cluster):
    policies, pods = cluster
    assert {p["metadata"]["name"] for p in policies} >= {"forage-default-deny", "forage-dns"}
    assert all(p["metadata"]["namespace"] == NAMESPACE for p in policies)
    assert {p.name for p in pods} >= {"forage-redis", "forage-retriever", "forage-rollout",
                                      "forage-scorer", "forage-learner", "forage-index",
                                      "forage-data-loader"}
    assert selector_problems(policies, pods) == []


def test_each_pod_reaches_what_it_needs_and_nothing_else(cluster):
    policies, pods = cluster
    assert matrix_problems(policies, pods, NEEDED) == []


def test_the_multinode_learner_adds_its_peers_rule(deploy, tmp_path):
    root = deploy.root_with_components([deploy.K8S_COMPONENTS["multinode-learner"]], tmp_path)
    objects = deploy.render(root)
    pods = pods_of(deploy, objects)
    learner = next(p for p in pods if p.name == "forage-learner")
    assert "rendezvous" in learner.ports
    peers = {("forage-learner", "forage-learner", port) for port in [*learner.ports, UNLISTED]}
    policies = policies_of(objects)
    assert selector_problems(policies, pods) == []
    assert matrix_problems(policies, pods, NEEDED | peers) == []


@pytest.mark.parametrize("mutate, expected", [
    # a typo in a port name: the learner exposes `weights`
    (lambda ps: ps["forage-learner"]["spec"]["ingress"][0]["ports"][0].update(port="weight"),
     "port 'weight' not exposed"),
    # a selector that matches no pod template
    (lambda ps: ps["forage-redis"]["spec"]["ingress"][0]["from"][1]["podSelector"].update(
        matchLabels={"app.kubernetes.io/name": "scorer"}), "selects no pod"),
])
def test_selector_check_catches_a_broken_copy(cluster, mutate, expected):
    policies, pods = cluster
    broken = copy.deepcopy(policies)
    mutate({p["metadata"]["name"]: p for p in broken})
    problems = selector_problems(broken, pods)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("mutate, expected", [
    # without the default deny, a pod with no ingress rule of its own takes anything
    (lambda ps: ps.pop("forage-default-deny"), "other-tenant -> forage-index:unlisted allowed"),
    # a rule without its port list opens every port
    (lambda ps: ps["forage-learner"]["spec"]["ingress"][1].pop("ports"),
     "prometheus -> forage-learner:weights allowed"),
    # a rule open to every namespace lets another tenant fetch the weights
    (lambda ps: ps["forage-learner"]["spec"]["ingress"][0]["from"][0].update(
        namespaceSelector={}), "other-tenant -> forage-learner:weights allowed"),
    # the scorer's egress rule gone: it cannot reach Redis
    (lambda ps: ps.pop("forage-scorer-egress"), "forage-scorer -> forage-redis:redis refused"),
    (lambda ps: ps.pop("forage-dns"), "forage-learner: no DNS"),
])
def test_matrix_check_catches_a_broken_copy(cluster, mutate, expected):
    policies, pods = cluster
    by_name = {p["metadata"]["name"]: p for p in copy.deepcopy(policies)}
    mutate(by_name)
    problems = matrix_problems(list(by_name.values()), pods, NEEDED)
    assert any(p.startswith(expected) for p in problems), problems
