"""Part 3: weight sync from a CUDA state dict. A learner process publishes a bf16 state dict held
on the GPU (Qwen2.5-0.5B-sized: 1 GiB) on Forage's gRPC weight-sync server; this process fetches
it over loopback (checksums and all checks included) and loads it back onto the GPU, against a
raw TCP copy of the same bytes between the same processes (bench/weight_sync.py's measurement).

    python bench/gpu/weight_sync_part.py --out DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import PartReport, part_main, say, torch_device  # noqa: E402


def measure(args: argparse.Namespace, report: PartReport) -> None:
    from weight_sync import measure

    size_mb, repeats = (16, 1) if args.dry_run else (1024, 3)
    device = torch_device()
    figures = measure(size_mb=size_mb, chunk_mb=4.0, repeats=repeats, device=device)
    result = {"source_device": device, "size_mb": size_mb, "repeats": repeats,
              **{k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}}
    say(f"weight_sync: {result}")
    report.add(result)


def main(argv: list[str] | None = None) -> int:
    return part_main("weight_sync", __doc__, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
