"""What `forage doctor` finds on this node: nvidia-smi, installed distributions, torch.

Versions come from the distributions' metadata (importlib.metadata), never from importing the
package, except where only the module can say: torch (its CUDA build, whether it sees CUDA,
NCCL) and faiss (how many GPUs it sees, cheap once torch is loaded). vLLM is never imported:
that is slow and may initialise CUDA. The rules that judge the result are in doctor.py.
"""

from __future__ import annotations

import csv
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from services.common import cuda_majors
from services.common.doctor import (
    FAISS_DISTRIBUTIONS,
    TORCH_COMPANIONS,
    VLLM_DISTRIBUTIONS,
    Gpu,
    NodeVersions,
)

NVIDIA_SMI_QUERY = ["--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"]
NVIDIA_SMI_TIMEOUT_S = 15


def dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def torch_pin(name: str) -> str | None:
    """The X of a `torch==X` requirement of distribution `name` (not one behind an extra)."""
    try:
        requirements = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return None
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        if "extra" in marker:
            continue
        match = re.fullmatch(r"\s*torch\s*(?:\[[^\]]*\])?\s*===?\s*([^\s,;]+)\s*", spec)
        if match:
            return match.group(1)
    return None


def cuda_packages() -> dict[str, str]:
    """Every installed distribution with a CUDA major of its own (cuda_majors.py) -> version,
    from the metadata of all installed distributions (names only: no import)."""
    found = {}
    for dist in metadata.distributions():
        name = cuda_majors.canonical(dist.metadata["Name"] or "")
        try:
            major = cuda_majors.cuda_major(name, dist.version)
        except ValueError:
            continue
        if major is not None:
            found[name] = dist.version
    return found


def os_line() -> str:
    pretty = ""
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                pretty = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    kernel = f"{platform.system()} {platform.release()} {platform.machine()}"
    return f"{pretty} ({kernel})" if pretty else kernel


def python_line() -> str:
    return f"Python {platform.python_version()} ({sys.executable})"


def nvidia_smi(which=shutil.which, run=subprocess.run) -> tuple[str | None, str | None,
                                                               tuple[Gpu, ...]]:
    """(driver version, error, GPUs); (None, None, ()) where nvidia-smi is not installed."""
    binary = which("nvidia-smi")
    if binary is None:
        return None, None, ()
    try:
        done = run([binary, *NVIDIA_SMI_QUERY], capture_output=True, text=True,
                   timeout=NVIDIA_SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"no answer within {NVIDIA_SMI_TIMEOUT_S} s", ()
    except OSError as exc:
        return None, str(exc), ()
    if done.returncode != 0:
        said = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        return None, (said[-1] if said else f"exit code {done.returncode}"), ()
    rows = [row for row in csv.reader(done.stdout.splitlines(), skipinitialspace=True) if row]
    if not rows:
        return None, "it listed no GPU", ()
    gpus = tuple(Gpu(name=row[1].strip() if len(row) > 1 else "?",
                     memory=row[2].strip() if len(row) > 2 else "?") for row in rows)
    return rows[0][0].strip(), None, gpus


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def nccl_version() -> str | None:
    """NCCL as torch was built with it ("2.27.7"), or None where torch has none."""
    try:
        import torch

        nccl = torch.cuda.nccl.version()
    except Exception:
        return None
    return ".".join(str(part) for part in nccl) if isinstance(nccl, tuple) else str(nccl)


def probe() -> NodeVersions:
    driver, driver_error, gpus = nvidia_smi()
    found = NodeVersions(os=os_line(), python=python_line(), driver=driver,
                         driver_error=driver_error, gpus=gpus)
    found.torch = dist_version("torch")
    if found.torch is not None:
        try:
            import torch

            found.torch = str(torch.__version__)
            found.torch_cuda = torch.version.cuda
            found.cuda_available = bool(torch.cuda.is_available())
        except Exception as exc:  # a broken install is a finding, not a crash
            found.torch_error = _error_text(exc)
    if found.cuda_available:
        found.nccl = nccl_version()
    found.vllm_builds = {name: version for name in VLLM_DISTRIBUTIONS
                         if (version := dist_version(name)) is not None}
    for name, version in found.vllm_builds.items():
        found.vllm, found.vllm_build = version, name
        found.vllm_torch_pin = torch_pin(name)
        break
    found.torch_companions = {name: version for name in TORCH_COMPANIONS
                              if (version := dist_version(name)) is not None}
    found.faiss = {name: version for name in FAISS_DISTRIBUTIONS
                   if (version := dist_version(name)) is not None}
    if found.faiss:
        try:
            import faiss

            found.faiss_gpus = int(faiss.get_num_gpus()) if hasattr(faiss, "get_num_gpus") else 0
        except Exception as exc:
            found.faiss_error = _error_text(exc)
    found.cuda_packages = cuda_packages()
    found.flash_attn = dist_version("flash-attn")
    if found.flash_attn is not None:
        found.flash_attn_torch_pin = torch_pin("flash-attn")
    found.deepspeed = dist_version("deepspeed")
    found.transformers = dist_version("transformers")
    return found
