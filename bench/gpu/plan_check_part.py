"""Part: the recipe's 3B learner in the 1-GPU layout's memory split, beside what `forage plan`
predicts for it, so the plan's estimate is checked on a GPU.

The layout (deploy/compose/gpus-1.yml) puts vLLM and the learner on one GPU: vLLM takes its
`gpu_memory_utilization` share of the GPU, the learner runs with the recipe config plus the
layout's `--set` (micro_batch_tokens 5120; from the recipe ZeRO-3, gradient checkpointing,
the KL loss's reference model, the entropy bonus). This part holds vLLM's share with one
tensor of that size, then runs one GRPO step of a Qwen2.5-3B-shaped policy (random weights):
the old and reference log-probs, then the update, on a batch whose largest micro-batch is
about micro_batch_tokens and almost all loss tokens (the case the plan sizes for). It records
the learner's peak GPU memory (the allocator's, less vLLM's share) beside the plan's learner
peak for the layout and for this batch's largest micro-batch, and the GPU's use beside the
plan's total for the GPU.

Where the plan says the layout does not fit this GPU (an 80 GB GPU: the learner alone peaks
near 80 GiB), the learner runs alone instead, at the largest micro-batch the plan says fits
the whole GPU, and the report says so; where none fits, nothing runs. run.py folds the report
into learner.json (`plan_check`).

    python bench/gpu/plan_check_part.py --out DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, PartReport, part_main, say, synchronize  # noqa: E402

RECIPE = REPO / "configs" / "search_r1_nq_hotpotqa.yaml"
LAYOUT = REPO / "deploy" / "compose" / "gpus-1.yml"
SHAPE = "qwen2.5-3b"
GIB = 1 << 30


@dataclass
class PlanRun:
    """What to run and what the plan predicts for it."""

    plan: Any  # services.common.plan_node.NodePlan of the layout on this GPU
    cfg: Any  # the learner's run config (the recipe and the layout's --set for the learner)
    estimate: Any  # the plan's LearnerEstimate for what runs
    reserve_bytes: int  # vLLM's share, held before the learner starts
    split: bool  # the layout's split (True) or the learner alone
    note: str


def plan_run(model_config: Path, gpu_gib: float, overrides: tuple[str, ...] = ()
             ) -> PlanRun | None:
    """The layout's plan on a GPU of `gpu_gib`; what runs (the split when it fits, else the
    learner alone at the largest micro-batch that fits the GPU); None when nothing fits.
    Pure arithmetic (services/common/plan*.py), as `forage plan --layout` computes it;
    `overrides` go after the layout's own `--set` (the dry run's smaller micro-batch)."""
    from services.common.plan import (
        CUDA_CONTEXT,
        estimate_learner,
        longest_trajectory,
        micro_batch_that_fits,
    )
    from services.common.plan_node import make_plan

    plan = make_plan([RECIPE], list(overrides), layout=LAYOUT, gpu_gib=gpu_gib,
                     model_config=model_config, environ={})
    cfg, est = plan.learner_config, plan.learner
    if plan.fits:
        (rollout,) = plan.vllm.values()
        return PlanRun(plan, cfg, est, rollout.budget, True,
                       f"the layout's split: vLLM's share ({rollout.budget / GIB:.1f} GiB) "
                       "beside the learner")
    budget = int(gpu_gib * GIB) - CUDA_CONTEXT
    micro = micro_batch_that_fits(est.setup, budget, longest_trajectory(cfg.rollout))
    if micro is None:
        return None
    alone = cfg.model_copy(update={"learner": cfg.learner.model_copy(
        update={"micro_batch_tokens": micro})})
    return PlanRun(plan, alone, estimate_learner(replace(est.setup, micro_tokens=micro)), 0,
                   False, f"the layout does not fit this GPU (plan: {plan_verdict(plan)}); "
                          f"the learner alone at micro_batch_tokens {micro}")


def plan_verdict(plan: Any) -> str:
    return "; ".join(f"GPU {g.gpu} {g.total / GIB:.1f} of {g.capacity / GIB:.1f} GiB, "
                     f"{g.verdict}" for g in plan.gpus)


def step_batch(groups: int, n: int, prompt_len: int, response: int, vocab: int):
    """`groups` prompts x `n` samples, every response token a loss token: a micro-batch of
    such groups is what the plan sizes the log-prob tensors for (K = N)."""
    from learner_part import grpo_batch

    return grpo_batch(groups=groups, n=n, prompt_len=prompt_len, response=(response, response + 1),
                      vocab=vocab, spans=0)


def largest_micro_batch(trainer: Any, samples: list) -> tuple[int, int]:
    """(computed tokens, loss tokens) of the largest micro-batch the trainer packs."""
    from services.learner.packing import pack

    best = (0, 0)
    for micro in trainer._plan(samples, list(range(len(samples)))):
        row = pack(samples, micro, 0, trainer.share_prompts, dense_mask=False)
        loss = int(sum(samples[i].loss_mask.sum() for i in micro))
        best = max(best, (int(row.input_ids.shape[-1]), loss))
    return best


def gib(n: float | None) -> float | None:
    return None if n is None else round(n / GIB, 2)


def measure(args: argparse.Namespace, report: PartReport) -> None:
    import torch
    from common import SHAPES
    from models import shaped_model

    from services.common.plan import CUDA_CONTEXT, estimate_learner
    from services.common.plan_layout import declared_gpu_gib, layout_files

    on_gpu = torch.cuda.is_available()
    shape = "toy" if args.dry_run else SHAPE
    report.stage(f"{shape}: random weights")
    model_dir = shaped_model(shape)
    total = None
    if on_gpu:
        torch.cuda.empty_cache()  # what building the weights left cached
        total = torch.cuda.get_device_properties(0).total_memory
    # On a CPU (the dry run) the plan is for the GPU the layout declares (x-forage-plan).
    gpu_gib = total / GIB if total else declared_gpu_gib(*layout_files(LAYOUT))
    # The dry run: the toy shape, and micro-batches of 1024 tokens instead of the layout's.
    overrides = ("learner.micro_batch_tokens=1024",) if args.dry_run else ()
    run = plan_run(model_dir / "config.json", gpu_gib, overrides)
    report.set(shape=shape, gpu_gib=round(gpu_gib, 1), layout=str(LAYOUT.relative_to(REPO)),
               plan_verdict=(plan_verdict(run.plan) if run else "nothing fits"))
    if run is None:
        report.note("the plan says no micro-batch of the learner fits this GPU: nothing ran")
        return
    say(f"plan_check: {run.note}")
    report.note(run.note)
    learner, rollout_cfg = run.cfg.learner, run.cfg.rollout
    reserve = None
    if on_gpu and run.reserve_bytes:
        report.stage(f"holding vLLM's share ({run.reserve_bytes / GIB:.1f} GiB)")
        reserve = torch.empty(run.reserve_bytes, dtype=torch.uint8, device="cuda")
    elif run.reserve_bytes:
        report.note("no GPU: vLLM's share is not held and no GPU memory is measured")
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if on_gpu else 0
    report.stage(f"{shape}: building the learner (ZeRO {learner.zero_stage}, "
                 f"micro_batch_tokens {learner.micro_batch_tokens})")
    from services.learner.trainer import PolicyTrainer

    planned = {"plan_learner_peak_gib": gib(run.estimate.peak),
               "plan_learner_items_gib": {i.name: gib(i.bytes) for i in run.estimate.items},
               "plan_gpu_total_gib": gib(run.plan.gpus[0].total if run.split
                                         else run.estimate.peak + CUDA_CONTEXT)}
    report.set(planned=planned)
    measured: dict[str, Any] = {}

    def peak_since(phase: str) -> None:
        """The learner's allocator peak over `phase` (since the last call), less vLLM's share."""
        if on_gpu:
            measured.setdefault("phases", {})[phase] = torch.cuda.max_memory_allocated() - before
            torch.cuda.reset_peak_memory_stats()

    started = time.perf_counter()
    try:
        trainer = PolicyTrainer(str(model_dir), learner, use_ref=run.estimate.setup.reference,
                                gradient_checkpointing=run.cfg.model.gradient_checkpointing)
        trainer.max_response_length = rollout_cfg.max_response_length
        measured["build_s"] = round(time.perf_counter() - started, 1)
        peak_since("build")
        n = run.cfg.data.n_samples
        prompt_len, response = (16, 96) if args.dry_run else (64, 480)
        groups = max(1, -(-2 * learner.micro_batch_tokens // (n * response + prompt_len)))
        samples = step_batch(groups, n, prompt_len, response, SHAPES[shape]["vocab_size"])
        computed, loss = largest_micro_batch(trainer, samples)
        at_batch = estimate_learner(replace(run.estimate.setup, micro_tokens=computed,
                                            logit_tokens=loss,
                                            dense_mask=trainer.attention.dense_mask))
        planned.update(plan_learner_peak_at_batch_gib=gib(at_batch.peak))
        measured.update(attn_implementation=trainer.attn_implementation,
                        zero_stage_run=trainer.policy.zero_stage,
                        reference_model=trainer.ref is not None, trajectories=len(samples),
                        largest_micro_batch_tokens=computed,
                        largest_micro_batch_loss_tokens=loss)
        report.stage(f"{shape}: one step ({len(samples)} trajectories)")
        synchronize()
        started = time.perf_counter()
        trainer.compute_log_probs(samples, "policy")
        if trainer.ref is not None:
            trainer.compute_log_probs(samples, "ref")
        synchronize()
        peak_since("log_probs")
        metrics = trainer.rl_step(samples)
        synchronize()
        peak_since("update")
        measured["step_s"] = round(time.perf_counter() - started, 2)
        measured["loss_finite"] = bool(np.isfinite(metrics.get("pg_loss",
                                                               metrics.get("loss", 0.0))))
    except torch.cuda.OutOfMemoryError:
        peak_since("until out of memory")
        report.add(result_row(shape, run, planned, measured, on_gpu, reserve is not None))
        raise
    result = result_row(shape, run, planned, measured, on_gpu, reserve is not None)
    say(f"plan_check: {result}")
    report.add(result)
    del trainer, reserve
    gc.collect()


def result_row(shape: str, run: PlanRun, planned: dict[str, Any], measured: dict[str, Any],
               on_gpu: bool, held: bool) -> dict[str, Any]:
    """Measured beside planned; plan errors are plan / measured - 1 (tests/common/test_plan.py's
    convention), from the learner's peak over the step (building it, which the plan does not
    model, is reported beside)."""
    import torch

    phases = measured.pop("phases", {})
    step = [v for k, v in phases.items() if k != "build"] or list(phases.values())
    peak = max(step) if step else None
    row: dict[str, Any] = {
        "shape": shape, "split": run.split, "micro_batch_tokens":
            run.cfg.learner.micro_batch_tokens, "zero_stage": run.cfg.learner.zero_stage,
        "gradient_checkpointing": run.cfg.model.gradient_checkpointing, **measured,
        "vllm_share_gib": gib(run.reserve_bytes) if run.split else None,
        "vllm_share_held": held, "learner_peak_gib": gib(peak),
        "learner_peak_by_phase_gib": {k: gib(v) for k, v in phases.items()},
        "learner_peak_reserved_gib": None, "gpu_used_gib": None, **planned}
    if on_gpu:
        free, total = torch.cuda.mem_get_info()
        row["gpu_used_gib"] = gib(total - free)
        row["learner_peak_reserved_gib"] = gib(
            torch.cuda.max_memory_reserved() - (run.reserve_bytes if held else 0))
    if peak:
        row["plan_error"] = round(planned["plan_learner_peak_gib"] * GIB / peak - 1, 4)
        if planned.get("plan_learner_peak_at_batch_gib"):
            row["plan_error_at_batch"] = round(
                planned["plan_learner_peak_at_batch_gib"] * GIB / peak - 1, 4)
    return row


def main(argv: list[str] | None = None) -> int:
    return part_main("plan_check", __doc__, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
