"""SFT step time on a quiet machine and under one competing busy process ("graceful
under load"): the demo's warm start, run as `forage learner sft` with the demo's config.

    .venv/bin/python bench/sft_load.py [--steps 40] [--rounds 2] [--env NAME=VALUE ...]

Builds (or reuses) the demo's world and tiny policy (`forage data synth`, `forage model init`
with configs/demo.yaml), then for `--rounds` rounds runs `forage learner sft` for `--steps`
optimizer steps quiet and with a `while True: pass` process it starts and stops itself. The
thread variables of the calling shell are removed, so the command's own policy
(services/common/threads.py) decides; `--env` adds some back (e.g. GOMP_SPINCOUNT=300000 for
libgomp's default spinning, the behaviour before the policy). Step times come from when each
line of `sft_metrics.jsonl` appears (the first 3 steps are warm-up and not counted). Printed:
median step time per load and run wall time; last line `ratio: busy / quiet median step time`
(the target: the demo under one competing process at most ~2x its quiet time).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.common.threads import without_thread_settings

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
CONFIG = REPO / "configs" / "demo.yaml"
WARM_UP_STEPS = 3


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = without_thread_settings(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(extra)
    return env


def forage(*args: str) -> None:
    done = subprocess.run([PYTHON, "-m", "services.cli", *args], cwd=REPO, env=clean_env({}),
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"forage {' '.join(args)} failed:\n{done.stdout}{done.stderr}")


def prepare(work: Path) -> tuple[Path, Path]:
    world, policy = work / "world", work / "world" / "policy"
    if not (world / "sft.parquet").exists():
        forage("data", "synth", "--out", str(world), "--config", str(CONFIG), "--sft-topk", "1",
               "--quiet")
    if not (policy / "config.json").exists():
        forage("model", "init", "--data", str(world), "--out", str(policy), "--config",
               str(CONFIG))
    return world, policy


def sft_run(world: Path, policy: Path, out: Path, steps: int, env: dict[str, str],
            log: Path) -> tuple[list[float], float]:
    """Step times (s) after warm-up, and the run's wall time, of one `forage learner sft`."""
    shutil.rmtree(out, ignore_errors=True)
    metrics = out / "sft_metrics.jsonl"
    argv = [PYTHON, "-m", "services.cli", "learner", "sft", "--config", str(CONFIG),
            "--set", f"model.path={policy}", "--set", f"run_dir={out.parent}",
            "--set", "learner.sft_epochs=1", "--set", f"learner.sft_max_rows={16 * steps}",
            "--set", "learner.sft_batch_size=16",
            "--data", str(world / "sft.parquet"), "--out", str(out)]
    started = time.perf_counter()
    stamps: list[float] = []
    with log.open("w") as handle:
        process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=handle,
                                   stderr=subprocess.STDOUT)
        seen = 0
        while process.poll() is None:
            lines = metrics.read_text().count("\n") if metrics.exists() else 0
            now = time.perf_counter()
            stamps.extend([now] * (lines - seen))
            seen = lines
            time.sleep(0.02)
    wall = time.perf_counter() - started
    if process.returncode:
        raise SystemExit(f"forage learner sft failed ({process.returncode}); see {log}")
    times = [b - a for a, b in zip(stamps, stamps[1:], strict=False)][WARM_UP_STEPS - 1:]
    return times, wall


class Busy:
    def __enter__(self) -> Busy:
        self.process = subprocess.Popen([PYTHON, "-c", "while True: pass"])
        time.sleep(1.0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.kill()
        self.process.wait()


class Quiet:
    def __enter__(self) -> Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--loads", default="quiet,busy", help="quiet, busy or both")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for the SFT process")
    parser.add_argument("--work", default=None,
                        help="world + policy folder (default $TMPDIR/forage-bench-sft-load)")
    args = parser.parse_args()
    loads = [load for load in args.loads.split(",") if load]
    if not loads or not set(loads) <= {"quiet", "busy"}:
        raise SystemExit(f"--loads {args.loads!r}: quiet and/or busy")
    extra = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--env {item!r}: expected NAME=VALUE")
        extra[name] = value
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    work = Path(args.work or Path(tempfile.gettempdir()) / "forage-bench-sft-load")
    world, policy = prepare(work)
    scratch = Path(tempfile.mkdtemp(prefix="sft-load-"))
    steps: dict[str, list[float]] = {"quiet": [], "busy": []}
    walls: dict[str, list[float]] = {"quiet": [], "busy": []}
    try:
        for round_number in range(args.rounds):
            for load in loads:
                with Busy() if load == "busy" else Quiet():
                    times, wall = sft_run(world, policy, scratch / "sft", args.steps,
                                          clean_env(extra), scratch / f"{load}.log")
                steps[load] += times
                walls[load].append(wall)
                print(f"round {round_number + 1} {load:5}: median step "
                      f"{statistics.median(times):.3f} s, mean {statistics.fmean(times):.3f} s, "
                      f"max {max(times):.3f} s, run {wall:.1f} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for load in loads:
        print(f"{load}: median step {statistics.median(steps[load]):.3f} s, "
              f"run {statistics.median(walls[load]):.1f} s")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if len(loads) == 2:
        ratio = statistics.median(steps["busy"]) / statistics.median(steps["quiet"])
        print(f"ratio: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
