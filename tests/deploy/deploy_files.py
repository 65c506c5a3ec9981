"""Reading the shipped deploy files as Docker Compose and kustomize read them (test helper).

- Compose: YAML with `!override` / `!reset`, `${VAR:-default}` interpolation, and the merge of
  several `-f` files (compose-go's rules for what this project uses: maps merge, `command`,
  `entrypoint` and `healthcheck.test` are replaced, other lists are appended, volumes are unique
  by target), then the compose-spec JSON schema (vendored by check-jsonschema).
- Kustomize: `kubectl kustomize` where kubectl is installed; otherwise `render_kustomization`,
  which implements the subset these manifests use (resources, components, JSON 6902 patches,
  namespace, configMapGenerator with kustomize's name hash and name references). The tests
  check both agree where kubectl exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
LAYOUTS = {n: REPO / "deploy" / "compose" / f"gpus-{n}.yml" for n in (1, 2, 8)}
# The variables a user puts in .env next to docker-compose.yml (docs/deploy.md); compose
# refuses to start without them.
USER_ENV = {"FORAGE_WEIGHT_SYNC_TOKEN": "rehearsal-token-0123456789abcdef"}
K8S_ROOT = REPO  # kustomization.yaml at the repository root (configMapGenerator + deploy/k8s)
# docs/deploy.md's Kubernetes steps, in order: the kustomization each applies. Step 1 has two
# variants (the data volume ReadWriteMany, or ReadWriteOnce on one node); the index build
# completes before the run is applied.
K8S_STEPS = {
    "data-loader": REPO / "deploy" / "k8s" / "data-loader",
    "single-node": REPO / "deploy" / "k8s" / "single-node",
    "index": REPO / "deploy" / "k8s" / "index",
    "run": K8S_ROOT,
}
# Opt-in variants of the run: kustomize Components that the root kustomization.yaml lists
# under `components:` when the user enables them (docs/deploy.md); `root_with_components`.
K8S_COMPONENTS = {"multinode-learner": "deploy/k8s/multinode-learner"}
GPU = "nvidia.com/gpu"
K8S_VERSION = "1.32.0"


# ------------------------------------------------------------------ compose

class Override:
    """`!override value`: replaces what the earlier files had."""

    def __init__(self, value: Any) -> None:
        self.value = value


class Reset:
    """`!reset ...`: removes the key."""


class _ComposeLoader(yaml.SafeLoader):
    pass


def _construct_any(loader: yaml.Loader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


_ComposeLoader.add_constructor("!override", lambda ld, n: Override(_construct_any(ld, n)))
_ComposeLoader.add_constructor("!reset", lambda ld, n: Reset())


def load_compose_file(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)  # noqa: S506 (SafeLoader subclass)


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class MissingVariable(ValueError):
    """`${VAR:?message}` / `${VAR?message}` with VAR unset (or empty, for `:?`): compose stops
    with the message."""


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`,
    `${VAR?error}`, `$VAR` and `$$`."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, Override):
        return Override(interpolate(value.value, env))
    if not isinstance(value, str):
        return value

    def sub(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, default = match.group(2), match.group(3)
        current = env.get(name)
        if op == ":-" and not current:
            return default
        if op == "-" and current is None:
            return default
        if (op == ":?" and not current) or (op == "?" and current is None):
            raise MissingVariable(f"required variable {name} is missing a value: {default}")
        return current or ""

    return _VAR.sub(sub, value)


def _replaced(path: tuple[str, ...]) -> bool:
    """Lists compose replaces instead of appending to."""
    service_level = len(path) == 3 and path[0] == "services"
    return (service_level and path[2] in ("command", "entrypoint")) or path[-2:] == (
        "healthcheck", "test")


def _volume_target(entry: Any) -> Any:
    if isinstance(entry, dict):
        return entry.get("target")
    parts = str(entry).split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def _merge(base: Any, over: Any, path: tuple[str, ...]) -> Any:
    if isinstance(over, Override):
        return over.value
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            if isinstance(value, Reset):
                out.pop(key, None)
            elif key in out:
                out[key] = _merge(out[key], value, path + (key,))
            else:
                out[key] = value.value if isinstance(value, Override) else value
        return out
    if isinstance(base, list) and isinstance(over, list):
        if _replaced(path):
            return over
        if path[-1] == "volumes":
            targets = {_volume_target(v) for v in over}
            return [v for v in base if _volume_target(v) not in targets] + over
        return base + [v for v in over if v not in base]
    return over


def compose_model(*files: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The merged model of `docker compose -f A -f B ...` (interpolated, tags resolved)."""
    env = dict(os.environ if env is None else env)
    model: dict[str, Any] = {}
    for file in files or (COMPOSE_FILE,):
        model = _merge(model, interpolate(load_compose_file(file), env), ())
    return model


def compose_schema() -> dict[str, Any]:
    text = (resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json")
    return json.loads(text.read_text())


def schema_errors(document: Any, schema: dict[str, Any]) -> list[str]:
    import jsonschema

    cls = jsonschema.validators.validator_for(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    return [
        f"{'/'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    ]


def device_ids(service: dict[str, Any]) -> list[str]:
    """GPU ids a service reserves (deploy.resources.reservations.devices)."""
    devices = (service.get("deploy") or {}).get("resources", {}).get("reservations", {})
    ids: list[str] = []
    for request in devices.get("devices", []) or []:
        if "gpu" in request.get("capabilities", []):
            ids.extend(str(i) for i in request.get("device_ids", []))
    return ids


def gpu_requests(service: dict[str, Any]) -> list[dict[str, Any]]:
    devices = (service.get("deploy") or {}).get("resources", {}).get("reservations", {})
    return [r for r in devices.get("devices", []) or [] if "gpu" in r.get("capabilities", [])]


def image_entrypoint(target: str) -> list[str]:
    """ENTRYPOINT of a stage of deploy/Dockerfile (JSON form)."""
    stage = None
    entry: dict[str, list[str]] = {}
    for line in (REPO / "deploy" / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            stage = line.split()[-1] if " AS " in line else None
        elif line.startswith("ENTRYPOINT ") and stage:
            entry[stage] = json.loads(line.split(" ", 1)[1])
    return entry[target]


def image_env(target: str) -> dict[str, str]:
    """ENV of a stage of deploy/Dockerfile (`ENV k=v k=v \\` lines; PATH left out)."""
    text = (REPO / "deploy" / "Dockerfile").read_text().replace("\\\n", " ")
    stage, env = None, {}
    for line in text.splitlines():
        if line.startswith("FROM "):
            stage = line.split()[-1] if " AS " in line else None
        elif line.startswith("ENV ") and stage == target:
            for pair in line.split()[1:]:
                key, _, value = pair.partition("=")
                if key != "PATH":
                    env[key] = value
    return env


# ------------------------------------------------------------------ kustomize

def _load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


_ALPHA = {"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"}


def configmap_hash(name: str, data: dict[str, str]) -> str:
    """kustomize's name suffix: sha256 of the JSON of {kind, name, data}, 10 hex digits with
    vowel-free substitutions (api/hasher). Go's json.Marshal sorts keys and escapes <, >, &.
    The generator hashes before it names the object, so `name` is empty in the JSON (checked
    against kubectl kustomize v5.5: `x` with a=b is x-4h2mbtbbt6)."""
    encoded = json.dumps({"data": data, "kind": "ConfigMap", "name": ""}, sort_keys=True,
                         separators=(",", ":"), ensure_ascii=False)
    for char, escape in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"),
                         ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        encoded = encoded.replace(char, escape)
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:10]
    return "".join(_ALPHA.get(c, c) for c in digest)


_CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "ClusterRole", "ClusterRoleBinding",
                   "StorageClass", "CustomResourceDefinition"}


def render_kustomization(directory: Path, _root: Path | None = None) -> list[dict[str, Any]]:
    """kustomize build, for the features these manifests use."""
    root = (_root or directory).resolve()
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            if directory.resolve().is_relative_to(path):
                raise ValueError(f"cycle detected: {path} contains {directory.resolve()}")
            objects.extend(render_kustomization(path))
        else:
            if not path.is_relative_to(directory.resolve()):
                raise ValueError(f"{entry}: file outside the kustomization directory")
            objects.extend(_load_docs(path))
    for entry in spec.get("components", []):
        objects.extend(_component_resources((directory / entry).resolve()))
        _apply_component_patches(objects, (directory / entry).resolve())
    for entry in spec.get("patches", []):
        _apply_patch(objects, entry, directory)
    renamed: dict[str, str] = {}
    for generator in spec.get("configMapGenerator", []):
        data = {}
        for item in generator.get("files", []):
            key, _, source = item.rpartition("=") if "=" in item else ("", "", item)
            file = (directory / source).resolve()
            if not file.is_relative_to(root):
                raise ValueError(f"{source}: outside {root} (kustomize's load restrictor)")
            data[key or file.name] = file.read_text()
        name = generator["name"]
        full = f"{name}-{configmap_hash(name, data)}"
        renamed[name] = full
        labels = (generator.get("options") or {}).get("labels") or {}
        meta: dict[str, Any] = {"name": full}
        if labels:
            meta["labels"] = dict(labels)
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    namespace = spec.get("namespace")
    for obj in objects:
        if namespace and obj["kind"] not in _CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = namespace
        for pod in _pod_specs(obj):
            for volume in pod.get("volumes", []):
                cm = volume.get("configMap")
                if cm and cm.get("name") in renamed:
                    cm["name"] = renamed[cm["name"]]
    return objects


def _component_spec(directory: Path) -> dict[str, Any]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if spec.get("kind") != "Component":
        raise ValueError(f"{directory}: listed under components but not a kustomize Component")
    unknown = set(spec) - {"apiVersion", "kind", "resources", "patches"}
    if unknown:
        raise ValueError(f"{directory}: Component fields not supported here: {sorted(unknown)}")
    return spec


def _component_resources(directory: Path) -> list[dict[str, Any]]:
    """The objects a Component adds (its own files); kustomize accumulates them after the
    parent's resources and before the parent's generators and patches."""
    objects: list[dict[str, Any]] = []
    for entry in _component_spec(directory).get("resources", []):
        path = (directory / entry).resolve()
        if not path.is_file() or not path.is_relative_to(directory):
            raise ValueError(f"{entry}: only files inside the Component are supported here")
        objects.extend(_load_docs(path))
    return objects


def _apply_component_patches(objects: list[dict[str, Any]], directory: Path) -> None:
    """A Component's patches act on everything accumulated so far: the parent's objects too."""
    for entry in _component_spec(directory).get("patches", []):
        _apply_patch(objects, entry, directory)


def root_with_components(components: list[str], workdir: Path) -> Path:
    """A copy of the run's kustomization root (kustomization.yaml, configs/, deploy/k8s/) under
    `workdir` whose kustomization.yaml lists `components` (paths relative to the root), as
    docs/deploy.md tells the user to enable them; the repository's own file stays as shipped.
    `render` of the returned directory is what `kubectl apply -k .` then creates."""
    root = workdir / "repo"
    shutil.copytree(REPO / "configs", root / "configs")
    shutil.copytree(REPO / "deploy" / "k8s", root / "deploy" / "k8s")
    spec = yaml.safe_load((K8S_ROOT / "kustomization.yaml").read_text())
    spec["components"] = list(components)
    (root / "kustomization.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return root


def _apply_patch(objects: list[dict[str, Any]], entry: dict[str, Any], directory: Path) -> None:
    """A `patches:` entry of the JSON 6902 kind (add / replace / remove), selected by the
    target's kind, name and namespace; kustomize applies it before the namespace."""
    target = entry.get("target") or {}
    unknown = set(target) - {"kind", "name", "namespace"}
    if unknown:
        raise ValueError(f"patch target fields not supported here: {sorted(unknown)}")
    text = entry["patch"] if "patch" in entry else (directory / entry["path"]).read_text()
    operations = yaml.safe_load(text)
    if not isinstance(operations, list):
        raise ValueError("only JSON 6902 patches (a list of operations) are supported here")
    for obj in objects:
        meta = obj.get("metadata") or {}
        if all((obj["kind"] if key == "kind" else meta.get(key)) == value
               for key, value in target.items()):
            for operation in operations:
                _json_patch(obj, operation)


def _json_patch(document: dict[str, Any], operation: dict[str, Any]) -> None:
    keys = [k.replace("~1", "/").replace("~0", "~") for k in operation["path"].split("/")[1:]]
    parent: Any = document
    for key in keys[:-1]:
        parent = parent[int(key)] if isinstance(parent, list) else parent[key]
    last, op = keys[-1], operation["op"]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if op == "add":
            parent.insert(index, operation["value"])
        elif op == "replace":
            parent[index] = operation["value"]
        elif op == "remove":
            del parent[index]
        else:
            raise ValueError(f"JSON patch op {op!r} not supported here")
    elif op in ("add", "replace"):
        if op == "replace" and last not in parent:
            raise ValueError(f"replace: {operation['path']} does not exist")
        parent[last] = operation["value"]
    elif op == "remove":
        del parent[last]
    else:
        raise ValueError(f"JSON patch op {op!r} not supported here")


def _pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    if obj["kind"] == "Pod":
        return [obj["spec"]]
    template = (obj.get("spec") or {}).get("template")
    return [template["spec"]] if template else []


def kubectl() -> str | None:
    return shutil.which("kubectl")


def kubectl_kustomize(directory: Path) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory}: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render(directory: Path = K8S_ROOT) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k DIRECTORY` would create."""
    return kubectl_kustomize(directory) if kubectl() else render_kustomization(directory)


# Custom resources the manifests use, validated against the schema their project publishes
# (vendored under tests/deploy/schemas/, with where it came from).
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda-v2.20.2-scaledobject.json",
    ("keda.sh/v1alpha1", "TriggerAuthentication"):
        "keda-v2.20.2-triggerauthentication-secrettargetref.json",
}


def strict_crd_schema(schema: Any) -> Any:
    """A CRD's structural schema made strict, as kubernetes_validate's strict mode is: every
    object that lists its properties and keeps no unknown fields refuses other keys (the API
    server would silently prune them)."""
    if isinstance(schema, list):
        return [strict_crd_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict_crd_schema(value) for key, value in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def crd_errors(obj: dict[str, Any]) -> list[str] | None:
    """Strict validation of a custom resource against its vendored schema; None for a kind
    that has none."""
    name = CRD_SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
    if name is None:
        return None
    schema = json.loads((Path(__file__).with_name("schemas") / name).read_text())["schema"]
    return schema_errors(obj, strict_crd_schema(schema))


def k8s_errors(objects: list[dict[str, Any]], version: str = K8S_VERSION) -> list[str]:
    """Strict Kubernetes schema validation (unknown fields are errors), one line per problem;
    custom resources against their own project's schema (CRD_SCHEMAS)."""
    import kubernetes_validate

    errors = []
    for obj in objects:
        where = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
        custom = crd_errors(obj)
        if custom is not None:
            errors += [f"{where}: {error}" for error in custom]
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{where}: {'/'.join(str(p) for p in exc.path)}: {exc.message}")
    return errors


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a Pod, Deployment, StatefulSet or Job."""
    return obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]


# The `forage` command groups that talk to Redis, each as its own ACL user (docs/deploy.md).
REDIS_ROLES = ("rollout", "scorer", "learner")


def forage_role(argv: list[str]) -> str | None:
    """The Redis role of a container's argv: the `forage` command group it runs, if it is one
    of REDIS_ROLES."""
    after = argv[argv.index("forage") + 1:] if "forage" in argv else []
    return after[0] if after and after[0] in REDIS_ROLES else None


def compose_argv(service: dict[str, Any]) -> list[str]:
    """A compose service's argv: its entrypoint (or its image's, for forage:*) and command."""
    argv = list(service.get("entrypoint") or []) + list(service.get("command") or [])
    if str(service.get("image", "")).startswith("forage:") and not service.get("entrypoint"):
        argv = image_entrypoint(service["build"]["target"]) + argv
    return argv


def container_argv(container: dict[str, Any]) -> list[str]:
    """A pod container's argv: its command (or `forage`, the forage:* images' entrypoint) and
    args."""
    image = str(container.get("image", ""))
    entry = container.get("command") or (["forage"] if image.startswith("forage:") else [])
    return list(entry) + list(container.get("args", []))


def workload_containers(objects: list[dict[str, Any]], secret_dir: str
                        ) -> Iterator[tuple[str, dict[str, Any], dict[str, Any],
                                            dict[str, dict[str, str]]]]:
    """(where, container, env, secrets) for every container and init container of every
    Deployment, StatefulSet and Job: `where` is "object/container", `env` its plain values,
    `secrets` the Secret items of the volume mounted at `secret_dir` (`secret_items`)."""
    for obj in objects:
        if obj["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        pod = pod_spec(obj)
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            yield (f"{obj['metadata']['name']}/{container['name']}", container, env,
                   secret_items(volumes.get(mounts.get(secret_dir), {})))


def secret_items(volume: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Secret name -> {key: path in the volume} of a pod volume: a Secret volume, or a
    projected volume's Secret sources (a Secret without `items` maps to {})."""
    if "secret" in volume:
        secret = volume["secret"]
        return {secret["secretName"]: {i["key"]: i["path"] for i in secret.get("items", [])}}
    out: dict[str, dict[str, str]] = {}
    for source in (volume.get("projected") or {}).get("sources", []):
        if "secret" in source:
            secret = source["secret"]
            out[secret["name"]] = {i["key"]: i["path"] for i in secret.get("items", [])}
    return out


def pod_gpus(pod: dict[str, Any]) -> int:
    """The GPUs the scheduler reserves for one pod: its effective request, the larger of the
    app containers' sum and the largest init container's request. The node keeps it reserved
    from scheduling on, while the init containers run too. (Init containers that keep running
    as sidecars would add to the sum; these manifests have none, which this checks.)"""
    def gpus(container: dict[str, Any]) -> int:
        resources = container.get("resources") or {}
        limits = resources.get("limits") or {}
        # an extended resource's request defaults to its limit
        return int((resources.get("requests") or {}).get(GPU, limits.get(GPU, 0)))

    inits = pod.get("initContainers", [])
    assert not any(c.get("restartPolicy") == "Always" for c in inits), "sidecar init container"
    return max(max((gpus(c) for c in inits), default=0), sum(gpus(c) for c in pod["containers"]))


def pod_count(obj: dict[str, Any]) -> int:
    """Pods a workload runs at once as written (Deployment and StatefulSet replicas, Job
    parallelism; 1 when unset)."""
    if obj["kind"] == "Pod":
        return 1
    key = "parallelism" if obj["kind"] == "Job" else "replicas"
    return int(obj["spec"].get(key, 1))


def gpus_reserved(objects: list[dict[str, Any]]) -> dict[str, int]:
    """Workload name -> GPUs its pods reserve together, for the workloads that reserve any."""
    out = {}
    for obj in objects:
        if obj["kind"] in ("Pod", "Deployment", "StatefulSet", "Job"):
            total = pod_gpus(pod_spec(obj)) * pod_count(obj)
            if total:
                out[obj["metadata"]["name"]] = total
    return out
