"""Write deploy/gpu-requirements.txt and deploy/gpu-kernels.txt: the GPU image's exact Python set.

The GPU image (deploy/Dockerfile, target gpu) is Ubuntu 24.04 with its CPython 3.12 on x86_64;
it installs these two files and nothing else, so what it holds is decided here, on a machine
with PyPI, and not by whatever the index serves on the day of a build. Run `make gpu-lock`.

pip's own resolver decides (`pip install --dry-run --ignore-installed --report`, wheels only,
the image's platform tags). pip evaluates environment markers against the interpreter running
it, whatever `--python-version` says (that option only picks wheel tags and checks
Requires-Python): vLLM's `setuptools<81; python_version > "3.11"` would be dropped when run
from the project's Python 3.11. So the resolver runs in this process with the image's marker
environment (`TARGET_ENVIRONMENT`) in place of this interpreter's.

Distributions with no wheel on PyPI (DeepSpeed) are built here into a wheel first (`pip wheel
--no-deps` of the newest sdist that the failing requirement allows), then resolved like the rest.

FlashInfer's prebuilt kernels (flashinfer-cubin, flashinfer-jit-cache) are not on PyPI: they
live on FlashInfer's indexes (`FLASHINFER_INDEX`). gpu-kernels.txt pins them to the
flashinfer-python release of the lock and to the CUDA version of its CUDA toolkit (torch's); it
is checked against those indexes when they answer, and says so in its header either way.

Usage: python deploy/gpu_lock.py [--check-kernels-only]
Environment: FLASHINFER_INDEX (default https://flashinfer.ai/whl).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "deploy" / "gpu-requirements.txt"
KERNELS = REPO / "deploy" / "gpu-kernels.txt"
PYPI = "https://pypi.org/simple"
FLASHINFER_INDEX = os.environ.get("FLASHINFER_INDEX", "https://flashinfer.ai/whl")

# The GPU image's interpreter and platform: Ubuntu 24.04's python3.12 package (3.12.3) on glibc
# 2.39, x86_64 (deploy/Dockerfile's `FROM nvidia/cuda:...-ubuntu24.04 AS gpu`).
PYTHON_VERSION = "3.12"
GLIBC = (2, 39)
TARGET_ENVIRONMENT = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_system": "Linux",
    "python_full_version": "3.12.3",
    "python_version": PYTHON_VERSION,
    "sys_platform": "linux",
}
# What the image builds Forage's own editable install with (pyproject.toml's build-system).
BUILD_REQUIREMENTS = ("setuptools>=68", "wheel")
FORAGE = "forage"


def platform_tags(glibc: tuple[int, int] = GLIBC) -> list[str]:
    """Every manylinux tag a glibc-`glibc` x86_64 system accepts, newest first (pip's
    `--platform` takes the list literally; it does not add the older ones itself)."""
    tags = [f"manylinux_2_{minor}_x86_64" for minor in range(glibc[1], 4, -1)]
    return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def target_options() -> list[str]:
    """pip options that select the image's wheels: binary only, its tags, its Python."""
    options = ["--only-binary=:all:", "--python-version", PYTHON_VERSION,
               "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    for tag in platform_tags():
        options += ["--platform", tag]
    return options


def lock_lines(report: dict) -> list[str]:
    """`name==version` for every distribution pip would install, Forage itself left out."""
    pins = {}
    for item in report["install"]:
        name = canonical(item["metadata"]["name"])
        if name != FORAGE:
            pins[name] = item["metadata"]["version"]
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def canonical(name: str) -> str:
    """PEP 503 normalised name: `Flashinfer_Python` -> `flashinfer-python`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(text: str) -> dict[str, str]:
    """{name: version} of a requirements file of exact pins (comments and options skipped)."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise ValueError(f"not an exact pin: {line!r}")
        pins[canonical(name)] = version.strip()
    return pins


def cuda_label(pins: dict[str, str]) -> str:
    """The `cuXY` of the lock's CUDA toolkit (torch's `cuda-toolkit==X.Y.Z` requirement)."""
    version = pins.get("cuda-toolkit")
    if version is None:
        raise ValueError("the lock has no cuda-toolkit pin: cannot tell torch's CUDA version")
    major, minor = version.split(".")[:2]
    return f"cu{major}{minor}"


def kernel_pins(pins: dict[str, str]) -> list[str]:
    """FlashInfer's prebuilt-kernel packages for the lock's flashinfer-python and CUDA."""
    flashinfer = pins.get("flashinfer-python")
    if flashinfer is None:
        raise ValueError("the lock has no flashinfer-python pin (vLLM requires one)")
    return [f"flashinfer-cubin=={flashinfer}",
            f"flashinfer-jit-cache=={flashinfer}+{cuda_label(pins)}"]


def kernel_indexes(pins: dict[str, str]) -> list[str]:
    """Where FlashInfer publishes them: cubins at the root index, the JIT cache (its shim and
    one provider wheel per GPU architecture) under the CUDA version."""
    return [f"--index-url {FLASHINFER_INDEX}/{cuda_label(pins)}",
            f"--extra-index-url {FLASHINFER_INDEX}"]


# --------------------------------------------------------------------------- running pip


def _pip_in_target_environment(args: list[str]) -> int:
    """pip's CLI, in this process, with the image's marker environment."""
    from pip._internal.cli.main import main as pip_main
    from pip._vendor.packaging import markers

    host = markers.default_environment

    def target() -> dict[str, str]:
        return {**host(), **TARGET_ENVIRONMENT}

    markers.default_environment = target
    try:
        return pip_main(args)
    finally:
        markers.default_environment = host


def _pip(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    """This interpreter's pip, isolated from the machine's pip configuration."""
    return subprocess.run([sys.executable, "-m", "pip", "--isolated",
                           "--disable-pip-version-check", *args],
                          check=False, text=True, capture_output=capture)


def _missing(stderr: str) -> str | None:
    match = re.search(r"No matching distribution found for ([^\s;]+)", stderr)
    return match.group(1) if match else None


def resolve(requirements: list[str], built: Path) -> dict:
    """pip's report for `requirements` on the image; sdist-only requirements are built into
    wheels under `built` (at most 10)."""
    for _ in range(10):
        with tempfile.NamedTemporaryFile("r", suffix=".json") as report_file:
            args = ["install", "--isolated", "--disable-pip-version-check", "--dry-run",
                    "--ignore-installed", "--quiet", "--report", report_file.name,
                    "--index-url", PYPI, "--find-links", str(built), *target_options(),
                    *requirements]
            code = _run_captured(args)
            if code[0] == 0:
                return json.loads(Path(report_file.name).read_text())
        missing = _missing(code[1])
        if missing is None or canonical(re.split(r"[<>=!~\[ ]", missing)[0]) in _built(built):
            sys.stderr.write(code[1])
            raise SystemExit("pip could not resolve the GPU image's requirements (above)")
        print(f"gpu-lock: no wheel of {missing} on PyPI: building one from its sdist",
              file=sys.stderr)
        download = _pip("download", "--no-deps", "--no-binary=:all:", "--index-url", PYPI,
                        "-d", str(built / "sdist"), missing, capture=True)
        if download.returncode:
            raise SystemExit(f"pip download {missing}: {download.stderr.strip()}")
        for sdist in (built / "sdist").iterdir():
            wheel = _pip("wheel", "--no-deps", "--index-url", PYPI, "-w", str(built),
                         str(sdist), capture=True)
            if wheel.returncode:
                raise SystemExit(f"pip wheel {sdist.name}: {wheel.stderr.strip()}")
            sdist.unlink()
    raise SystemExit("gpu-lock: more than 10 sdists to build; giving up")


def _built(built: Path) -> set[str]:
    return {canonical(wheel.name.split("-")[0]) for wheel in built.glob("*.whl")}


def _run_captured(args: list[str]) -> tuple[int, str]:
    """Run pip in a child process (it calls sys.exit and keeps global state) with the image's
    marker environment; (exit code, stderr)."""
    here = str(Path(__file__).parent)
    code = (f"import sys; sys.path.insert(0, {here!r}); import gpu_lock; "
            "sys.exit(gpu_lock._pip_in_target_environment(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, *args], text=True,
                          capture_output=True, check=False)
    return done.returncode, done.stderr


def kernels_on_index(pins: dict[str, str]) -> str | None:
    """None when FlashInfer's indexes serve the kernel pins for the image, else why not."""
    try:
        urllib.request.urlopen(FLASHINFER_INDEX + "/", timeout=20).close()
    except OSError as exc:
        return f"{FLASHINFER_INDEX} did not answer from this machine: {exc}"
    args = ["install", "--isolated", "--disable-pip-version-check", "--dry-run",
            "--ignore-installed", "--no-deps", "--quiet", "--timeout", "20", "--retries", "0",
            *(part for option in kernel_indexes(pins) for part in option.split()),
            *target_options(), *kernel_pins(pins)]
    code, stderr = _run_captured(args)
    if code == 0:
        return None
    lines = [line for line in stderr.splitlines() if line.startswith("ERROR")]
    return (lines[-1] if lines else stderr.strip()[-300:]) or f"pip exited {code}"


def _pip_version() -> str:
    from pip import __version__

    return __version__


def write_lock(lines: list[str], built: list[str]) -> None:
    header = [
        "# Forage's GPU image (deploy/Dockerfile, target gpu): every Python distribution it",
        "# installs from PyPI, exact pins. Written by `make gpu-lock` (deploy/gpu_lock.py): pip",
        f"# {_pip_version()}'s resolver, wheels only, for CPython {PYTHON_VERSION} on manylinux "
        f"x86_64 (glibc {GLIBC[0]}.{GLIBC[1]}),",
        "# from pyproject.toml's gpu extra and its build backend (setuptools, wheel). Edit",
        "# pyproject.toml and regenerate; do not edit this file.",
    ]
    if built:
        header.append("# No wheel on PyPI, built from the sdist: " + ", ".join(built))
    LOCK.write_text("\n".join(header + lines) + "\n")


def write_kernels(pins: dict[str, str], unchecked: str | None) -> None:
    checked = ("# Checked against those indexes when written." if unchecked is None else
               "# NOT checked against those indexes when written (" + unchecked[:200] + ").")
    header = [
        "# FlashInfer's prebuilt kernels for the GPU image, so that nothing is compiled (nvcc)",
        "# or downloaded at run time: flashinfer-cubin (kernel binaries) and flashinfer-jit-cache",
        "# (a shim that requires one provider wheel per GPU architecture, same version). Not on",
        "# PyPI: on FlashInfer's indexes below. Written by `make gpu-lock` from",
        "# gpu-requirements.txt: flashinfer-python's release and the CUDA toolkit's version.",
        checked,
    ]
    KERNELS.write_text("\n".join(header + kernel_indexes(pins) + kernel_pins(pins)) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check-kernels-only", action="store_true",
                        help="keep gpu-requirements.txt; rewrite gpu-kernels.txt from it")
    options = parser.parse_args(argv)
    if options.check_kernels_only:
        pins = read_pins(LOCK.read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="forage-gpu-lock.") as tmp:
            built = Path(tmp)
            report = resolve([f"{REPO}[gpu]", *BUILD_REQUIREMENTS], built)
            lines = lock_lines(report)
            write_lock(lines, sorted(_built(built)))
        pins = read_pins(LOCK.read_text())
        print(f"gpu-lock: {len(lines)} pins in {LOCK.relative_to(REPO)}", file=sys.stderr)
    unchecked = kernels_on_index(pins)
    write_kernels(pins, unchecked)
    print(f"gpu-lock: {KERNELS.relative_to(REPO)}"
          + ("" if unchecked is None else f" (not checked: {unchecked})"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
