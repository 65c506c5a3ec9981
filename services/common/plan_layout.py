"""Which services share which GPU in a Docker Compose layout (docker-compose.yml and the
deploy/compose/gpus-*.yml files), read the way Compose merges them: the base file, then the
layout file, `!override` replacing a value and `!reset` removing it, maps merging,
`command` / `entrypoint` replaced, YAML anchors and `<<` merges expanded.

From each Forage service: its GPUs (deploy.resources.reservations.devices[].device_ids or
`count`, narrowed by NVIDIA_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES in its environment), what
it runs (`forage learner train`, `rollout serve`, ...), the `--set` overrides on its command
line, and the learner's ranks (torchrun --nproc-per-node). The layouts' comments describe the
same placement in words; the device lists are what Compose acts on, so they are what is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.common.plan import PlanError

BASE_FILE = "docker-compose.yml"
# The `forage` sub-command a service runs -> its role in the plan.
ROLES = {("learner", "train"): "learner", ("learner", "sft"): "learner",
         ("rollout", "serve"): "rollout", ("retriever", "serve"): "retriever",
         ("retriever", "build-index"): "index-build", ("scorer", "serve"): "scorer"}


class _Override:
    def __init__(self, value: Any) -> None:
        self.value = value


class _Reset:
    pass


class _Loader(yaml.SafeLoader):
    pass


def _any(loader: yaml.Loader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


_Loader.add_constructor("!override", lambda ld, n: _Override(_any(ld, n)))
_Loader.add_constructor("!reset", lambda ld, n: _Reset())

REPLACED = ("command", "entrypoint")


def _merge(base: Any, top: Any, key: str = "") -> Any:
    if isinstance(top, _Override):
        return _plain(top.value)
    if isinstance(base, dict) and isinstance(top, dict):
        out = dict(base)
        for k, v in top.items():
            if isinstance(v, _Reset):
                out.pop(k, None)
            else:
                out[k] = _merge(out[k], v, k) if k in out else _plain(v)
        return out
    if isinstance(base, list) and isinstance(top, list) and key not in REPLACED:
        return base + _plain(top)
    return _plain(top)


def _plain(value: Any) -> Any:
    if isinstance(value, _Override):
        return _plain(value.value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if not isinstance(v, _Reset)}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def load_compose(*files: Path) -> dict[str, Any]:
    model: dict[str, Any] = {}
    for path in files:
        try:
            data = yaml.load(Path(path).read_text(), Loader=_Loader)  # noqa: S506 (SafeLoader)
        except (OSError, yaml.YAMLError) as exc:
            raise PlanError(f"cannot read layout {path}: {exc}") from None
        if not isinstance(data, dict):
            raise PlanError(f"layout {path}: not a Compose file")
        model = _merge(model, data)
    return model


def layout_files(layout: Path) -> list[Path]:
    """The files Compose merges for a layout: docker-compose.yml at the repository root, then
    the layout file (docker-compose.yml itself is the 4-GPU layout)."""
    layout = Path(layout)
    if layout.name == BASE_FILE:
        return [layout]
    for parent in layout.resolve().parents:
        if (parent / BASE_FILE).is_file():
            return [parent / BASE_FILE, layout]
    raise PlanError(f"layout {layout}: no {BASE_FILE} above it to merge it onto")


@dataclass
class Placement:
    """One service of a layout, as the plan needs it."""

    name: str
    role: str
    gpus: list[str] = field(default_factory=list)  # host GPU ids ([] = none)
    overrides: list[str] = field(default_factory=list)  # --set words of its command
    configs: list[str] = field(default_factory=list)  # --config paths (container paths)
    ranks: int = 1  # learner processes (torchrun --nproc-per-node)
    one_shot: bool = False  # runs to completion before the long-running services start


def _argv(service: dict[str, Any]) -> list[str]:
    entry = service.get("entrypoint") or ["forage"]
    command = service.get("command") or []
    entry = entry.split() if isinstance(entry, str) else list(entry)
    command = command.split() if isinstance(command, str) else list(command)
    return [str(w) for w in entry + command]


def _role(words: list[str]) -> str | None:
    start = words.index("forage") + 1 if "forage" in words else 0
    pair = tuple(words[start:start + 2])
    return ROLES.get(pair)  # type: ignore[arg-type]


def _flag_values(words: list[str], flag: str) -> list[str]:
    found = []
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            found.append(words[i + 1])
        elif word.startswith(flag + "="):
            found.append(word.split("=", 1)[1])
    return found


def _ranks(words: list[str]) -> int:
    for flag in ("--nproc-per-node", "--nproc_per_node"):
        values = _flag_values(words, flag)
        if values and values[0].isdigit():
            return int(values[0])
    return 1


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(str(e).split("=", 1) for e in env if "=" in str(e))
    return {str(k): str(v) for k, v in env.items()}


def _gpus(service: dict[str, Any], all_ids: list[str]) -> list[str]:
    devices = (((service.get("deploy") or {}).get("resources") or {}).get("reservations")
               or {}).get("devices") or []
    ids: list[str] = []
    for device in devices:
        if "gpu" not in (device.get("capabilities") or []) and device.get("driver") != "nvidia":
            continue
        if device.get("device_ids"):
            ids.extend(str(i) for i in device["device_ids"])
        elif device.get("count") is not None:
            count = device["count"]
            ids.extend(all_ids if count in ("all", -1) else all_ids[: int(count)])
    env = _environment(service)
    nvidia = env.get("NVIDIA_VISIBLE_DEVICES")
    if nvidia and nvidia not in ("all", "void", "none"):
        ids = [i.strip() for i in nvidia.split(",")]
    cuda = env.get("CUDA_VISIBLE_DEVICES")
    if cuda is not None and ids:
        picked = [ids[int(i)] for i in cuda.split(",") if i.strip().isdigit()
                  and int(i) < len(ids)]
        ids = picked
    return ids


def read_layout(*files: Path) -> list[Placement]:
    """The Forage services of a layout (those whose command is a known `forage` command)."""
    services = load_compose(*files).get("services") or {}
    declared = sorted({str(i) for s in services.values() for d in
                       ((((s or {}).get("deploy") or {}).get("resources") or {})
                        .get("reservations") or {}).get("devices") or []
                       for i in d.get("device_ids") or []}, key=_id_order)
    placements = []
    for name, service in services.items():
        service = service or {}
        words = _argv(service)
        role = _role(words)
        if role is None:
            continue
        placements.append(Placement(
            name=name, role=role, gpus=_gpus(service, declared),
            overrides=_flag_values(words, "--set"), configs=_flag_values(words, "--config"),
            ranks=_ranks(words) if role == "learner" else 1,
            one_shot=str(service.get("restart", "")) == "no" or role == "index-build",
        ))
    return placements


def _id_order(gpu: str) -> tuple[int, str]:
    return (int(gpu), gpu) if gpu.isdigit() else (1 << 30, gpu)


def gpu_ids(placements: list[Placement]) -> list[str]:
    return sorted({g for p in placements for g in p.gpus}, key=_id_order)


def declared_gpu_gib(*files: Path) -> float | None:
    """The GPU memory (GiB, as torch reports it) a layout is sized for, when it says so in its
    top-level `x-forage-plan: {gpu_memory_gib: ...}` (Compose ignores `x-` keys)."""
    value = (load_compose(*files).get("x-forage-plan") or {}).get("gpu_memory_gib")
    return float(value) if value is not None else None

