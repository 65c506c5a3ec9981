"""Which CUDA major a Python distribution is built for, from its name and version alone.

Two CUDA majors in one environment means two copies of the CUDA runtime libraries under
different sonames, each needing its own driver floor: `forage doctor` calls it an error, and
the GPU image's lock (deploy/gpu-requirements.txt) is tested to hold one major. Both read the
same rules here, which need only `name==version` (no import, no installed files).
"""

from __future__ import annotations

import re

# Unsuffixed distributions whose version starts with the CUDA major they belong to (NVIDIA's
# CUDA 13 wheels dropped the -cuXX suffix; cuBLAS and the CUDA Python bindings follow the
# toolkit's numbering).
CUDA_VERSIONED = frozenset({
    "cuda-bindings", "cuda-python", "cuda-toolkit",
    "nvidia-cublas", "nvidia-cuda-cccl", "nvidia-cuda-crt", "nvidia-cuda-cupti",
    "nvidia-cuda-nvcc", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-nvjitlink",
    "nvidia-nvtx", "nvidia-nvvm",
})
# Unsuffixed CUDA libraries numbered on their own (cuFFT 12.0 ships with CUDA 13.0, cuRAND 10.4,
# cuSOLVER 12.0, cuSPARSE 12.6, cuFile 1.15): NVIDIA publishes them without a -cuXX suffix
# since CUDA 13 (up to CUDA 12 they were nvidia-cufft-cu12 and so on), so they are CUDA 13.
UNSUFFIXED_SINCE = 13
CUDA_LIBRARIES = frozenset({
    "nvidia-cufft", "nvidia-cufile", "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse",
    "nvidia-npp", "nvidia-nvjpeg", "nvidia-nvfatbin", "nvidia-cuda-culibos",
    "nvidia-cuda-opencl", "nvidia-cuda-profiler-api", "nvidia-cuda-sanitizer-api",
    "nvidia-cuda-cuxxfilt", "nvidia-nvml-dev", "nvidia-nvptxcompiler", "nvidia-cuda-nvdisasm",
})
# NVIDIA and CUDA-named distributions that carry no CUDA major of their own: NVML bindings
# (driver-side), cuDNN's header-only frontend, the CUTLASS DSL's Python parts, CUDA Python's
# pure-Python helpers.
NOT_CUDA_SPECIFIC = frozenset({
    "nvidia-ml-py", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core", "cuda-core",
    "cuda-pathfinder", "cuda-tile",
})
# A second major that upstream metadata requires and that brings no CUDA runtime of its own:
# name -> why it is allowed beside the other major.
ALLOWED_OTHER_MAJOR: dict[str, str] = {
    "nvidia-cutlass-dsl-libs-cu12": (
        "nvidia-cutlass-dsl requires it whatever the CUDA (its [cu13] extra, which vLLM asks "
        "for, adds nvidia-cutlass-dsl-libs-cu13); it requires only cuda-bindings and the DSL's "
        "own packages, no CUDA 12 runtime library"),
}
# faiss GPU builds whose name does not say the major, by release (from each release's
# requirements on PyPI: nvidia-*-cu12 or the unsuffixed CUDA 13 wheels).
FAISS_RELEASES: dict[str, dict[str, int]] = {
    "faiss-cuda": {"1.14.1.post3": 13, "1.14.1.post4": 13, "1.14.3": 12, "1.14.3.post0": 12},
    "faiss-gpu": {"1.14.3": 12, "1.15.0": 12, "1.15.1": 12},
    "faiss-gpu-cuvs": {"1.14.1.post1": 12, "1.15.0": 13, "1.15.1": 13},
}


def canonical(name: str) -> str:
    """PEP 503 name: `Nvidia_CUDNN_cu13` -> `nvidia-cudnn-cu13`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _label_major(digits: str) -> int:
    """"13" -> 13, "130" -> 13, "128" -> 12, "118" -> 11 (cuXY[Z]: the last digit of three is
    the minor)."""
    return int(digits[:-1]) if len(digits) == 3 else int(digits)


def cuda_major(name: str, version: str) -> int | None:
    """The CUDA major `name==version` is built for; None when it has none (or is not a CUDA
    build). Raises ValueError for an NVIDIA or CUDA distribution these rules do not know, so a
    new one is classified rather than silently passed over."""
    name = canonical(name)
    label = re.search(r"\+cu(\d{2,3})\b", version)
    if label:  # torch 2.14.0+cu130, flashinfer-jit-cache 0.7.2.post1+cu130
        return _label_major(label.group(1))
    suffix = re.search(r"-cu(\d{2,3})$", name)
    if suffix:  # nvidia-cudnn-cu13, faiss-gpu-cu12, libcuvs-cu13, faiss-cuda-cu128
        return _label_major(suffix.group(1))
    if name in CUDA_VERSIONED:
        return int(version.split(".", 1)[0])
    if name in CUDA_LIBRARIES:
        return UNSUFFIXED_SINCE
    if name in FAISS_RELEASES:
        return FAISS_RELEASES[name].get(version.split("+", 1)[0])
    if name in NOT_CUDA_SPECIFIC:
        return None
    if name.startswith("nvidia-") or name.startswith("cuda-"):
        raise ValueError(f"{name} {version}: no rule says which CUDA major it is built for "
                         "(services/common/cuda_majors.py)")
    return None


def majors(pins: dict[str, str], strict: bool = True) -> dict[int, list[str]]:
    """{CUDA major: ["name version", ...]} of a {name: version} set, ALLOWED_OTHER_MAJOR left
    out. strict=False skips NVIDIA/CUDA distributions no rule knows instead of raising."""
    found: dict[int, list[str]] = {}
    for name, version in sorted(pins.items()):
        if canonical(name) in ALLOWED_OTHER_MAJOR:
            continue
        try:
            major = cuda_major(name, version)
        except ValueError:
            if strict:
                raise
            continue
        if major is not None:
            found.setdefault(major, []).append(f"{canonical(name)} {version}")
    return found


def describe(found: dict[int, list[str]], shown: int = 3) -> str:
    """"CUDA 12: faiss-gpu-cu12 1.14.1.post1, nvidia-cublas-cu12 12.9.3.13; CUDA 13: ..."."""
    parts = []
    for major, names in sorted(found.items()):
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        parts.append(f"CUDA {major}: {', '.join(names[:shown])}{more}")
    return "; ".join(parts)
