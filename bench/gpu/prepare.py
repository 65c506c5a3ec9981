"""The GPU check's cold start, paid once before the timed parts: import what the parts import
and build the C++ ops DeepSpeed compiles on first use, so that each part's time limit measures
its own work on a fresh machine as on a warm one.

On a CPU (the dry run) DeepSpeed's engine set-up JIT-compiles its shared-memory collective
(`ShareMemCommBuilder`, 1-2 minutes the first time on a small CPU, then cached in
TORCH_EXTENSIONS_DIR); without this step that build landed inside the learner part's limit
and a fresh machine's first dry run failed. On CUDA the learner uses a client torch optimizer,
so nothing is compiled: the step is the imports and the CUDA context.

    python bench/gpu/prepare.py --out DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PartReport, part_main, say  # noqa: E402


def build_deepspeed_ops() -> list[str]:
    """The ops DeepSpeed would JIT-build at engine set-up on this accelerator, built where the
    learner part loads them (`forage learner build-ops`' own step); names built."""
    from deepspeed.accelerator import get_accelerator

    from services.learner.op_build_watch import build_cpu_ops

    if get_accelerator().device_name() != "cpu":
        return []
    return [builder.absolute_name() for builder, _ in build_cpu_ops()]


def measure(args: argparse.Namespace, report: PartReport) -> None:
    report.stage("importing torch, transformers and DeepSpeed")
    import deepspeed  # noqa: F401
    import torch
    import transformers  # noqa: F401

    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # the CUDA context, once
    imported = time.time() - report.data["started"]  # the part's start: device_facts imports too
    report.stage("building DeepSpeed's C++ ops (cached in TORCH_EXTENSIONS_DIR afterwards)")
    began = time.perf_counter()
    built = build_deepspeed_ops()
    report.add({"imports_s": round(imported, 1), "ops": built,
                "ops_s": round(time.perf_counter() - began, 1)})
    say(f"prepare: imports {imported:.1f}s, ops {built or 'none to build'} in "
        f"{time.perf_counter() - began:.1f}s")


def main(argv: list[str] | None = None) -> int:
    return part_main("prepare", __doc__, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
