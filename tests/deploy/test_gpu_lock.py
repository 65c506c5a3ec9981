"""The GPU image's requirement set, offline: deploy/gpu-requirements.txt (written by `make
gpu-lock` with pip's resolver for the image's Python and platform) holds one CUDA major, the
one of the image's base; it satisfies pyproject.toml's gpu extra; FlashInfer's kernel pins
follow it; deploy/Dockerfile's gpu stage installs exactly these files, and with
WHEELHOUSE=1 none of its steps reaches a network; deploy/build-offline-gpu.sh reads the same
Dockerfile and refuses to build from a wheelhouse that was not filled for this lock."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest
import tomllib
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.version import Version

from services.common import cuda_majors, doctor

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "deploy" / "gpu-requirements.txt"
KERNELS = REPO / "deploy" / "gpu-kernels.txt"
SCRIPT = REPO / "deploy" / "build-offline-gpu.sh"


@pytest.fixture(scope="module")
def gpu_lock():
    spec = importlib.util.spec_from_file_location("forage_gpu_lock", REPO / "deploy/gpu_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pins(gpu_lock) -> dict[str, str]:
    return gpu_lock.read_pins(LOCK.read_text())


def _gpu_stage() -> str:
    text = (REPO / "deploy" / "Dockerfile").read_text()
    return re.search(r"^FROM \S+ AS gpu\n(.*?)(?=^FROM |\Z)", text, re.S | re.M).group(1)


def _base_cuda_major() -> int:
    text = (REPO / "deploy" / "Dockerfile").read_text()
    return int(re.search(r"^FROM nvidia/cuda:(\d+)\.\d+\.\d+-\S+ AS gpu$", text, re.M).group(1))


def test_lock_holds_one_cuda_major_the_bases(gpu_lock, pins) -> None:
    everything = {**pins, **gpu_lock.read_pins(KERNELS.read_text())}
    found = cuda_majors.majors(everything)  # raises on an NVIDIA/CUDA wheel no rule knows
    assert list(found) == [_base_cuda_major()], cuda_majors.describe(found)
    # the builds that matter have a major of their own, not just "no rule" (PyPI's torch says
    # its CUDA through its cuda-toolkit pin)
    for name in ("cuda-toolkit", "faiss-cuda", "flashinfer-jit-cache", "nvidia-cuda-runtime",
                 "nvidia-cublas", "nvidia-cudnn-cu13"):
        assert cuda_majors.cuda_major(name, everything[name]) == _base_cuda_major(), name
    for allowed in cuda_majors.ALLOWED_OTHER_MAJOR:  # allowed only with what requires it
        assert allowed not in pins or "nvidia-cutlass-dsl" in pins
    # the check bites: the gpu extra's former faiss and its CUDA 12 runtime
    mixed = cuda_majors.majors({**pins, "faiss-gpu-cu12": "1.14.1.post1",
                                "nvidia-cublas-cu12": "12.9.3.13"})
    assert sorted(mixed) == [12, 13]


def test_lock_satisfies_pyproject_and_vllms_torch(gpu_lock, pins) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["gpu"]
    environment = {**gpu_lock.TARGET_ENVIRONMENT, "extra": ""}
    for line in [*wanted, *gpu_lock.BUILD_REQUIREMENTS]:
        requirement = Requirement(line)
        if requirement.marker and not requirement.marker.evaluate(environment):
            continue
        name = cuda_majors.canonical(requirement.name)
        assert name in pins, f"{line}: not in {LOCK.name}"
        assert requirement.specifier.contains(Version(pins[name]), prereleases=True), (
            f"{line}: the lock has {name}=={pins[name]}")
    assert "faiss-cpu" not in pins
    assert pins["torch"] == doctor.VLLM_TORCH[pins["vllm"]]
    assert Marker('python_version > "3.11"').evaluate(environment)  # the image's Python
    assert Version(pins["setuptools"]) < Version("81")  # vLLM's bound under Python 3.12


def test_kernel_pins_follow_the_lock(gpu_lock, pins) -> None:
    lines = [line for line in KERNELS.read_text().splitlines() if not line.startswith("#")]
    assert lines == gpu_lock.kernel_indexes(pins) + gpu_lock.kernel_pins(pins)
    assert gpu_lock.cuda_label(pins) == f"cu{pins['cuda-toolkit'].replace('.', '')[:3]}"


def _offline(run: str) -> str:
    """A RUN command as it runs with WHEELHOUSE set: the `then` branch of each WHEELHOUSE test."""
    run = re.sub(r"\s*\\\n\s*", " ", run)
    test = r'if \[ -n "\$WHEELHOUSE" \];\s*then\s'
    run = re.sub(test + r"(.*?);\s*else\s.*?;\s*fi\b", r"\1", run)
    return re.sub(test + r"(.*?);\s*fi\b", r"\1", run)


def test_gpu_stage_installs_the_lock_and_nothing_from_a_network_offline() -> None:
    stage = _gpu_stage()
    runs = re.findall(r"^RUN (.*?)(?<!\\)\n", stage, re.S | re.M)
    pip_steps = [run for run in runs if "pip install" in run]
    assert len(pip_steps) == 1
    installs = re.findall(r"pip install ([^&;\n\\]*)", pip_steps[0])
    assert [i.strip() for i in installs] == [
        "-r deploy/gpu-requirements.txt", "-r deploy/gpu-kernels.txt",
        "--no-deps --no-build-isolation -e ."]
    # the kernels are left out only when a build asks (the stand-in check, FLASHINFER_KERNELS=0)
    assert re.search(r"^ARG FLASHINFER_KERNELS=1$", stage, re.M)
    assert 'if [ "$FLASHINFER_KERNELS" = 1 ]; then python -m pip install -r deploy/gpu-kernels' \
        in pip_steps[0]
    assert "COPY deploy/gpu-requirements.txt deploy/gpu-kernels.txt ./deploy/" in stage
    for run in runs:
        offline = _offline(run)
        assert "apt-get update" not in offline and not re.search(r"\b(curl|wget|git clone)\b",
                                                                 offline), offline
        for args in re.findall(r"apt-get install ([^&;]*)", offline):
            packages = [a for a in args.split() if not a.startswith("-")]
            assert packages and all(a.startswith("/wheelhouse/") for a in packages), offline
        if "pip install" in offline:
            assert offline.index("PIP_NO_INDEX=1") < offline.index("pip install"), offline
            assert "PIP_FIND_LINKS=/wheelhouse" in offline
        if "/wheelhouse" in run:
            assert "--mount=type=bind,source=deploy/wheelhouse-gpu,target=/wheelhouse" in run


def test_offline_script_reads_the_dockerfile_and_refuses_an_unfilled_wheelhouse(
        tmp_path: Path) -> None:
    plan = subprocess.run([str(SCRIPT), "plan"], capture_output=True, text=True, check=True)
    apt = re.search(r"^apt: (.*)$", plan.stdout, re.M).group(1).split()
    online = re.search(r"else apt-get update && apt-get install -y --no-install-recommends "
                       r"([^;]*);", re.sub(r"\\\n", " ", _gpu_stage())).group(1).split()
    assert sorted(apt) == sorted(online)
    assert f"base: nvidia/cuda:{_base_cuda_major()}." in plan.stdout
    unknown = subprocess.run([str(SCRIPT), "push"], capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown step 'push'" in unknown.stderr
    (tmp_path / ".complete").write_text("0123456789abcdef\n")  # filled for another lock
    build = subprocess.run([str(SCRIPT), "build"], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", "GPU_WHEELHOUSE": str(tmp_path)})
    assert build.returncode == 1
    assert "is not filled for this lock" in build.stderr and "fetch" in build.stderr
    odd = subprocess.run([str(SCRIPT), "plan"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "FLASHINFER_KERNELS": "no"})
    assert odd.returncode == 1 and "FLASHINFER_KERNELS is 0 or 1, not 'no'" in odd.stderr
