"""Part 5: `forage demo --quick` end to end with the rollout engine and the learner on CUDA:
Redis, retriever, scorer, rollout and learner start as processes and talk over their real
protocols on this box. It checks that everything starts and talks on a GPU machine; at --quick
size it does not learn. The retriever stays on the CPU (faiss without GPU support; see
retriever_part.py), its encoder too, as `forage demo` configures it.

    python bench/gpu/demo_part.py --out DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    ChildConsole,
    PartReport,
    exit_on_sigterm,
    part_main,
    say,
    torch_device,
)
from encoder_standin import real_package_present  # noqa: E402

# What the services' logs say when they run on CUDA (learner: trainer.py's start-up line).
CUDA_MARKERS = {"learner": "policy in bfloat16"}


def measure(args: argparse.Namespace, report: PartReport) -> None:
    device = torch_device()
    report.set(encoder_weights="real" if real_package_present() else "random (stand-in)")
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="forage-gpu-demo-"))
    argv_demo = [sys.executable, "-m", "services.cli", "demo", "--quick", "--fresh",
                 "--out", str(run_dir), "--set", f"rollout.device={device}"]
    report.set(command=" ".join(argv_demo[1:]), run_dir=str(run_dir))
    exit_on_sigterm()
    child = ChildConsole(argv_demo, keep=40)
    try:
        child.follow()
    finally:
        report.set(console_tail=child.tail(), log_tails=_log_tails(run_dir / "logs"),
                   wall_s_demo=round(child.elapsed(), 1))
        child.stop()
    proc, wall, console = child.proc, child.elapsed(), child.tail()
    summary_path = run_dir / "report" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    demo_info = run_dir / "demo.json"
    phases = json.loads(demo_info.read_text()).get("phases") if demo_info.exists() else None
    logs = run_dir / "logs"
    on_cuda = {}
    for service, marker in CUDA_MARKERS.items():
        texts = [p.read_text(errors="replace") for p in logs.glob(f"{service}*.log")]
        on_cuda[service] = any(marker in t for t in texts)
    result = {"exit_code": proc.returncode, "wall_s": round(wall, 1), "phases_s": phases,
              "steps": summary.get("steps"), "em_before": summary.get("em_before"),
              "em_after": summary.get("em_after"), "rollout_device": device,
              "bf16_learner_seen_in_log": on_cuda}
    say(f"demo: exit {proc.returncode} in {wall:.0f}s, steps {summary.get('steps')}")
    report.add(result)
    if proc.returncode != 0:
        report.set(error=f"forage demo --quick exited {proc.returncode}: "
                         + " | ".join(console[-8:]))
    elif not summary:
        report.set(error=f"forage demo --quick wrote no {summary_path}")


def main(argv: list[str] | None = None) -> int:
    def run_dir_argument(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--run-dir", type=Path, default=None,
                            help="where the demo writes its run (default: a temporary folder)")

    return part_main("demo", __doc__, measure, argv, run_dir_argument)


def _log_tails(logs: Path, lines: int = 12) -> dict[str, list[str]]:
    """The last lines of each phase's and service's log: where a slow or stuck run was."""
    if not logs.is_dir():
        return {}
    return {path.name: path.read_text(errors="replace").splitlines()[-lines:]
            for path in sorted(logs.glob("*.log"))}


if __name__ == "__main__":
    sys.exit(main())
