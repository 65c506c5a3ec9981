"""`make gpu-image`: build `forage:gpu` the air-gapped way on this machine and check it.

Opt-in (not part of `make test`, and CI does not run it): it downloads ~4.5 GB of wheels and
writes ~25 GB (overlay2) to ~60 GB (vfs) of images. Steps, in a private Docker engine
(tests/deploy/dockerd.py; overlay2 where the data root allows it, else vfs):

1. free disk is checked first (--min-free-gb, default by storage driver);
2. the base: a local stand-in under the real base's name (deploy/local-gpu-base-image.sh),
   when the engine lacks it;
3. the wheelhouse: `deploy/build-offline-gpu.sh fetch` (PyPI, Ubuntu's mirror; FlashInfer's
   kernel wheels only when FlashInfer's index answers, otherwise FLASHINFER_KERNELS=0 and the
   summary says they were left out);
4. the image: `deploy/build-offline-gpu.sh build` (docker build --network=none, wheels and
   .debs from the wheelhouse only);
5. in the image, one container: `import torch, vllm, faiss, deepspeed, flashinfer`,
   `forage doctor --json` (no error, no warning; no driver here), `pip check`; and the image's
   size.

It prints a JSON summary (also written to --summary) and exits 1 if any step or check failed.
Usage: python tests/deploy/gpu_image.py [--root DIR] [--keep] [--summary FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.deploy import dockerd as dockerd_module  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
IMAGE = "forage:gpu"
FLASHINFER_INDEX = os.environ.get("FLASHINFER_INDEX", "https://flashinfer.ai/whl")
# Free space the build needs, by storage driver (vfs copies the filesystem for every layer and
# every container; the wheelhouse and BuildKit's copy of it come on top).
MIN_FREE_GB = {"overlay2": 30.0, "vfs": 60.0}

# Run inside the image (python -): the three checks, one JSON line on stdout.
IN_IMAGE = r"""
import json, subprocess, sys
def run(argv):
    p = subprocess.run(argv, capture_output=True, text=True)
    return p.returncode, (p.stdout + p.stderr).strip()
code = ("import torch, vllm, faiss, deepspeed, flashinfer, json; print(json.dumps({m.__name__: "
        "getattr(m, '__version__', '?') for m in (torch, vllm, faiss, deepspeed, flashinfer)}))")
rc, out = run([sys.executable, "-c", code])
result = {"import": {"rc": rc, "output": out[-3000:]}}
rc, out = run(["forage", "doctor", "--json"])
try:
    doctor = json.loads(out[out.index("{"):])
except ValueError:
    doctor = None
result["doctor"] = {"rc": rc, "json": doctor, "output": out[-3000:] if doctor is None else ""}
rc, out = run([sys.executable, "-m", "pip", "check"])
result["pip_check"] = {"rc": rc, "output": out[-3000:]}
print("@@RESULT " + json.dumps(result))
"""


def log(text: str) -> None:
    print(f"[gpu-image {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def kernels_reachable() -> str | None:
    """None when FlashInfer's index answers, else why not (one line)."""
    try:
        with urllib.request.urlopen(FLASHINFER_INDEX + "/", timeout=15):
            return None
    except OSError as error:
        return f"{FLASHINFER_INDEX} did not answer: {error}"


def start_engine(root: Path) -> dockerd_module.Dockerd:
    """overlay2 where the data root's filesystem allows it, else vfs."""
    try:
        return dockerd_module.Dockerd(root, storage_driver="overlay2").start()
    except dockerd_module.DockerdError as error:
        log(f"overlay2 did not start ({str(error).splitlines()[0]}): vfs")
        shutil.rmtree(root, ignore_errors=True)
        return dockerd_module.Dockerd(root, storage_driver="vfs").start()


def step(name: str, argv: list[str], env: dict[str, str], times: dict[str, float]) -> None:
    log(f"{name}: {' '.join(argv)}")
    t0 = time.monotonic()
    rc = subprocess.run(argv, env=env, cwd=REPO, check=False).returncode
    times[name] = round(time.monotonic() - t0, 1)
    if rc:
        raise RuntimeError(f"{name} failed (exit {rc}): see its output above")


def doctor_problems(doctor: dict | None) -> list[str]:
    """What is wrong with the image's `forage doctor --json` (empty: nothing)."""
    if doctor is None:
        return ["forage doctor --json printed no JSON"]
    problems = []
    if doctor.get("errors") or doctor.get("warnings") or not doctor.get("ok"):
        bad = [f["text"] for f in doctor.get("findings", []) if f["level"] in ("error", "warning")]
        problems.append(f"doctor found {doctor.get('errors')} errors, "
                        f"{doctor.get('warnings')} warnings: {bad}")
    versions = doctor.get("versions", {})
    for name in ("torch", "vllm", "deepspeed", "transformers"):
        if not versions.get(name):
            problems.append(f"doctor reports no {name}")
    if not versions.get("faiss"):
        problems.append("doctor reports no faiss")
    if not str(versions.get("torch_cuda") or "").startswith("13."):
        problems.append(f"torch is not a CUDA 13 build: {versions.get('torch_cuda')}")
    if versions.get("driver") is not None:
        problems.append(f"a driver was found ({versions['driver']}); this check expects none")
    return problems


def check_image(d: dockerd_module.Dockerd, summary: dict) -> list[str]:
    out = d.docker("run", "--rm", "-i", "--entrypoint", "python", IMAGE, "-",
                   input=IN_IMAGE, timeout=1800, check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("@@RESULT ")), None)
    if line is None:
        return [f"the checks in the image printed no result: {out.stdout[-2000:]}"
                f"{out.stderr[-2000:]}"]
    result = json.loads(line.removeprefix("@@RESULT "))
    failures = []
    if result["import"]["rc"]:
        failures.append(f"import failed: {result['import']['output']}")
    else:
        summary["imports"] = json.loads(result["import"]["output"].splitlines()[-1])
    doctor = result["doctor"]["json"]
    failures += doctor_problems(doctor)
    if doctor:
        summary["doctor"] = {"summary": doctor["summary"],
                             "report": {r["name"]: r["value"] for r in doctor["report"]}}
    if result["pip_check"]["rc"]:
        failures.append(f"pip check: {result['pip_check']['output']}")
    summary["pip_check"] = result["pip_check"]["output"]
    inspect = json.loads(d.docker("image", "inspect", IMAGE).stdout)[0]
    summary["image_bytes"] = inspect["Size"]
    summary["image_gb"] = round(inspect["Size"] / 1e9, 2)
    summary["labels"] = inspect["Config"].get("Labels") or {}
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="/var/tmp/forage-gpu-image",
                   help="the engine's folder (removed at the end unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the engine's folder (the image)")
    p.add_argument("--min-free-gb", type=float, help="refuse to start with less free disk")
    p.add_argument("--summary", default=str(REPO / "runs" / "gpu-image" / "last.json"))
    a = p.parse_args(argv)
    if os.geteuid() != 0 or not shutil.which("dockerd") or not shutil.which("debootstrap"):
        print("gpu-image: needs root, dockerd and debootstrap (make docker-tools)", file=sys.stderr)
        return 2
    root = Path(a.root)
    if root.exists():
        print(f"gpu-image: {root} exists (another run, or a kept one): remove it first",
              file=sys.stderr)
        return 2
    summary: dict = {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                     "machine": f"{platform.node()}, {os.cpu_count()} cores, "
                                f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
                     "image": IMAGE}
    failures: list[str] = []
    times: dict[str, float] = {}
    t0 = time.monotonic()
    root.parent.mkdir(parents=True, exist_ok=True)
    d = start_engine(root)
    try:
        driver = d.storage_driver
        free_gb = shutil.disk_usage(root).free / 1e9
        need = a.min_free_gb if a.min_free_gb is not None else MIN_FREE_GB[driver]
        summary.update(storage_driver=driver, free_gb_at_start=round(free_gb, 1))
        if free_gb < need:
            raise RuntimeError(f"{free_gb:.0f} GB free under {root}, the build needs about "
                               f"{need:.0f} GB with {driver} (--min-free-gb)")
        why_not = kernels_reachable()
        summary["flashinfer_kernels"] = ("installed" if why_not is None else
                                         f"LEFT OUT (FLASHINFER_KERNELS=0): {why_not}")
        if why_not:
            log(f"FlashInfer's kernel wheels are left out: {why_not}")
        env = dict(d.env, DOCKER=d.cli, DOCKER_BUILDKIT="1", FETCH_NETWORK="host",
                   FLASHINFER_KERNELS="1" if why_not is None else "0")
        step("base", ["bash", "deploy/local-gpu-base-image.sh"], env, times)
        step("fetch", ["bash", "deploy/build-offline-gpu.sh", "fetch"], env, times)
        step("build", ["bash", "deploy/build-offline-gpu.sh", "build", IMAGE], env, times)
        t1 = time.monotonic()
        failures += check_image(d, summary)
        times["checks"] = round(time.monotonic() - t1, 1)
        summary["engine_disk_gb"] = round(d.disk_usage() / 1e9, 1)
    except Exception as error:  # noqa: BLE001 - reported in the summary, exit 1
        failures.append(f"{type(error).__name__}: {error}")
    finally:
        d.keep_root = a.keep
        d.stop()
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    times["total"] = round(time.monotonic() - t0, 1)
    summary.update(seconds=times, failures=failures, ok=not failures)
    Path(a.summary).parent.mkdir(parents=True, exist_ok=True)
    Path(a.summary).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"gpu-image: {'OK' if not failures else 'FAILED: ' + '; '.join(failures)}"
          f" (summary in {a.summary})", file=sys.stderr)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
