"""Part 2: the transformers rollout engine on CUDA. Tokens/s of Forage's agent loop (continuous
batching, its own KV cache) against plain batched `model.generate` on the same prompts, same
model (Qwen2.5-0.5B-shaped, random weights, bf16), EOS disabled on both sides so both produce
exactly batch x new_tokens (bench/rollout.py's single-turn measurement).

    python bench/gpu/engine_part.py --out DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import PartReport, part_main, peak_memory_gib, say, torch_device  # noqa: E402
from models import shaped_model  # noqa: E402


def measure(args: argparse.Namespace, report: PartReport) -> None:
    import torch
    from rollout import bench_single_turn

    from services.rollout.transformers_engine import TransformersEngine

    shape = "toy" if args.dry_run else "qwen2.5-0.5b"
    settings = [(4, 8, 1)] if args.dry_run else [(16, 128, 2)]
    torch.manual_seed(0)
    device = torch_device()
    model_dir = shaped_model(shape)
    for batch, new_tokens, repeats in settings:
        engine = TransformersEngine.from_pretrained(str(model_dir), device=device,
                                                    max_batch_size=batch, seed=0)
        figures = bench_single_turn(engine, batch, new_tokens, repeats=repeats)
        result = {"shape": shape, "batch": batch, "new_tokens": new_tokens,
                  "dtype": str(engine.model.dtype).removeprefix("torch."),
                  **{k: round(v, 3) for k, v in figures.items()},
                  "peak_memory_gib": peak_memory_gib()}
        say(f"engine: {result}")
        report.add(result)
        del engine


def main(argv: list[str] | None = None) -> int:
    return part_main("engine", __doc__, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
