"""The GPU image's CUDA base agrees with what the `gpu` extra installs, and the docs agree with
both: vLLM (pyproject.toml's range) pins an exact torch, that torch's PyPI build targets one
CUDA version, and deploy/Dockerfile's `gpu` stage must build on that CUDA major, not older, with
the docs stating the driver that CUDA major needs (services/common/doctor.py's table)."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

from services.common import doctor

REPO = Path(__file__).resolve().parents[2]
# The CUDA version of each torch release's default (PyPI) Linux wheel: the nvidia-*-cuXX
# wheels it requires. Only releases some supported vLLM pins (doctor.VLLM_TORCH) matter.
TORCH_PYPI_CUDA: dict[str, tuple[int, int]] = {"2.14.0": (13, 0)}


def _newest_supported_vllm() -> str:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["gpu"]
    spec = next(req for req in extras if req.startswith("vllm"))
    low = re.search(r">=\s*([\d.]+)", spec).group(1)
    high = re.search(r"<\s*([\d.]+)", spec).group(1)
    inside = [v for v in doctor.VLLM_TORCH
              if doctor.version_tuple(low) <= doctor.version_tuple(v) < doctor.version_tuple(high)]
    assert inside, f"doctor.VLLM_TORCH knows no vLLM release inside {spec}"
    return max(inside, key=doctor.version_tuple)


def _gpu_base_cuda() -> tuple[int, int]:
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    match = re.search(r"^FROM nvidia/cuda:(\d+)\.(\d+)\.\d+-\S+ AS gpu$", dockerfile, re.M)
    assert match, "deploy/Dockerfile: no `FROM nvidia/cuda:X.Y.Z-... AS gpu`"
    return int(match.group(1)), int(match.group(2))


def test_gpu_image_base_is_the_cuda_of_the_torch_that_vllm_pins():
    vllm = _newest_supported_vllm()
    torch = doctor.VLLM_TORCH[vllm]
    assert torch in TORCH_PYPI_CUDA, f"record the CUDA of torch {torch}'s PyPI wheel here"
    torch_cuda = TORCH_PYPI_CUDA[torch]
    base = _gpu_base_cuda()
    # Same major (a CUDA 12 base under a CUDA 13 torch passes the container runtime's
    # cuda>=12.x check on drivers that cannot run torch), minor not newer than torch's.
    assert base[0] == torch_cuda[0] and base <= torch_cuda, (vllm, torch, torch_cuda, base)


def test_docs_state_the_driver_and_check_the_node_with_the_image_itself():
    major = _gpu_base_cuda()[0]
    floor = doctor.CUDA_MAJOR_DRIVER_FLOOR[major].split(".")[0]
    for doc in ("README.md", "docs/deploy.md"):
        text = (REPO / doc).read_text()
        assert f"{floor} or newer" in text, f"{doc} does not say the driver must be >= {floor}"
        assert "rollout doctor" in text, f"{doc} does not check the node with forage doctor"
        for image in re.findall(r"nvidia/cuda:(\d+)\.\d+", text):
            assert int(image) == major, f"{doc} names a CUDA {image} image; the image is {major}"
