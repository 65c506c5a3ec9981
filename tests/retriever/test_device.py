"""`--device cuda` on a machine whose torch or faiss cannot use a GPU is an error at start,
never a warning and a CPU server; and each install gets exactly one faiss build.

This machine has a CPU torch and faiss-cpu, so every `cuda` request here must be refused. The
old code logged a warning and served from CPU: the process tests below then time out waiting
for an exit that never comes, and `load_dense(..., "cuda")` returned a CPU index.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import tomllib

from services.common import doctor

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _run(tools, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run([tools.forage, "retriever", *args], capture_output=True,
                                text=True, timeout=timeout, env=ENV)
    except subprocess.TimeoutExpired as exc:  # the old code: a CPU server that keeps running
        pytest.fail(f"`forage retriever {' '.join(args)}` did not exit ({exc.stderr!r})")
    return result


SERVE_ERROR = "forage retriever serve: error: "
BUILD_ERROR = "forage retriever build-index: error: "


def _error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines, "no error on stderr"
    assert "Traceback" not in result.stderr, result.stderr
    return lines[-1]


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_serve_device_cuda_without_gpu_stack_fails_at_start(tools, flat_index, device) -> None:
    port = tools.free_port()
    result = _run(tools, "serve", "--index", str(flat_index), "--device", device,
                  "--port", str(port))
    assert result.returncode == 2
    line = _error_line(result)
    assert line.startswith(f"{SERVE_ERROR}retriever.device {device} cannot be used: ")
    assert "torch" in line and "no CUDA device" in line
    assert "faiss" in line and "no GPU support" in line and "gpu extra" in line
    assert "using CPU" not in result.stderr


def test_config_device_cuda_fails_like_the_flag(tools, flat_index, tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"retriever:\n  index_dir: {flat_index}\n  device: cuda\n  port: 0\n")
    result = _run(tools, "serve", "--config", str(config))
    assert result.returncode == 2
    assert _error_line(result).startswith(SERVE_ERROR + "retriever.device cuda cannot be used: ")


def test_unknown_device_is_named(tools, flat_index) -> None:
    result = _run(tools, "serve", "--index", str(flat_index), "--device", "gpu")
    assert result.returncode == 2
    assert _error_line(result) == (
        SERVE_ERROR + "retriever.device: unknown device 'gpu' (use cpu, cuda or cuda:N)")


def test_build_index_device_cuda_fails_before_reading_the_corpus(tools, corpus, tmp_path) -> None:
    out = tmp_path / "index"
    result = _run(tools, "build-index", "--corpus", str(corpus[0]), "--out", str(out),
                  "--device", "cuda", "--no-progress")
    assert result.returncode == 2
    line = _error_line(result)
    assert line.startswith(BUILD_ERROR + "--device cuda cannot be used: ") and "torch" in line
    assert not out.exists()


def test_load_dense_on_cuda_raises_instead_of_serving_from_cpu(flat_index) -> None:
    from services.retriever.indexes import FAISS_FILE, DeviceError, load_dense

    with pytest.raises(DeviceError, match="faiss .* has no GPU support"):
        load_dense(flat_index / FAISS_FILE, "flat", {}, device="cuda")
    with pytest.raises(DeviceError, match="no GPU implementation of HNSW"):
        load_dense(flat_index / FAISS_FILE, "hnsw", {}, device="cuda")
    assert load_dense(flat_index / FAISS_FILE, "flat", {}, device="cpu").ntotal > 0


def test_check_device() -> None:
    from services.retriever.indexes import DeviceError, parse_device
    from services.retriever.searcher import check_device

    assert parse_device("cpu") == ("cpu", None)
    assert parse_device("cuda") == ("cuda", None)
    assert parse_device("cuda:3") == ("cuda", 3)
    for bad in ("gpu", "cuda:x", "cpu:0", "", "CUDA"):
        with pytest.raises(DeviceError, match="unknown device"):
            parse_device(bad)
    check_device("cpu", "flat")
    check_device("cuda", "bm25")  # BM25 runs neither an encoder nor faiss
    with pytest.raises(DeviceError, match="torch"):
        check_device("cuda", "flat", index_on_device=False)


# ----------------------------------------------------------------- one faiss per install


def _extras() -> tuple[list[str], dict[str, list[str]]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["dependencies"], project["optional-dependencies"]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_pyproject_brings_exactly_one_faiss_per_extra() -> None:
    base, extras = _extras()
    assert not {n for n in _names(base) if n.startswith("faiss")}, "faiss in the base deps"
    assert {n for n in _names(extras["cpu"]) if n.startswith("faiss")} == {"faiss-cpu"}
    gpu = {n for n in _names(extras["gpu"]) if n.startswith("faiss")}
    assert len(gpu) == 1 and gpu.pop() in doctor.FAISS_GPU


def test_makefile_installs_the_cpu_extra_without_cuda_and_the_gpu_extra_with() -> None:
    recipe = (REPO / "Makefile").read_text()
    branch = recipe.split("nvidia-smi >/dev/null 2>&1; then", 1)[1]
    cuda, cpu = branch.split("else", 1)
    cpu = cpu.split("fi", 1)[0]
    assert re.search(r"pip install -q -e '\.\[gpu[,\]]", cuda)
    assert "uninstall -q -y faiss-cpu" in cuda  # a venv made before keeps no CPU faiss
    assert re.search(r"pip install -q -e '\.\[cpu[,\]]", cpu)
    assert "[gpu" not in cpu


def test_dockerfile_installs_one_faiss_per_image() -> None:
    text = (REPO / "deploy" / "Dockerfile").read_text()
    stages = dict(re.findall(r"^FROM \S+ AS (\w+)\n(.*?)(?=^FROM |\Z)", text, re.S | re.M))
    installs = {name: re.findall(r"pip install[^\n]*-e\s+(\S+)", body)
                for name, body in stages.items()}
    # the cpu image: Forage with extras among which exactly one brings a faiss (the cpu one)
    [cpu_install] = [i.strip("'\"") for i in installs["cpu"]]
    extras = re.fullmatch(r"\.\[([\w,-]+)\]", cpu_install).group(1).split(",")
    import tomllib

    optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    faiss = [req for extra in extras for req in optional[extra] if req.startswith("faiss")]
    assert faiss == ["faiss-cpu>=1.8"], (extras, faiss)
    # the gpu image installs its lock (resolved from the gpu extra), then Forage with no deps
    assert [i.strip("'\"") for i in installs["gpu"]] == ["."], installs
    assert "-r deploy/gpu-requirements.txt" in stages["gpu"]
    lock = (REPO / "deploy" / "gpu-requirements.txt").read_text()
    assert re.search(r"^faiss-cuda==", lock, re.M) and not re.search(r"^faiss-cpu==", lock, re.M)


def test_this_install_has_a_faiss() -> None:
    import faiss

    assert faiss.IndexFlatIP(4).d == 4
