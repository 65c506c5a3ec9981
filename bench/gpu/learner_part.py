"""Part 1: the learner alone. Forage's PolicyTrainer (DeepSpeed, bf16 on CUDA) runs GRPO
steps on a GRPO-shaped batch for each model shape x ZeRO stage x gradient checkpointing.

Reported per setting: step time (best of the timed steps) and the warm-up step's (kernel
compilation: FlexAttention's Triton kernels are compiled on first use), tokens/s (all tokens of
the batch), model-FLOPs utilisation (FLOPs of the tokens actually computed, a group's shared
prompt once, against the datasheet bf16 peak and against a matrix product measured in the same
run), peak GPU memory, which kernel `learner.attention` chose and why, and which attention
kernels ran (from one profiled step per shape and kernel choice), named as one kind
(`attention_kernel`: flex, flash-attn, or SDPA and its backend).

    python bench/gpu/learner_part.py --out DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    PartReport,
    datasheet_peak,
    device_facts,
    parameter_count,
    part_main,
    peak_memory_gib,
    reset_peak_memory,
    say,
    synchronize,
    train_flops,
)
from models import shaped_model  # noqa: E402

ATTENTION_WORDS = ("attention", "attn", "fmha", "flash", "sdpa", "mha", "flex", "triton_tem")
# Profiler names -> the kind of attention kernel that ran, first match wins. FlexAttention
# compiled by inductor runs Triton template kernels (`triton_tem_fused_*`); uncompiled, it
# computes the whole score matrix with ordinary ops. SDPA names its backend in its ATen op.
KERNEL_KINDS = (
    ("triton_tem", "flex (Triton kernels compiled by inductor)"),
    ("flash_attn", "flash-attn"),
    ("flash_fwd", "flash-attn"),
    ("cudnn_attention", "SDPA: cuDNN"),
    ("efficient_attention", "SDPA: memory-efficient"),
    ("_scaled_dot_product_flash_attention", "SDPA: flash"),
    ("attention_math", "SDPA: math (unfused)"),
    ("flex_attention", "flex, not compiled (unfused: the whole score matrix)"),
)


def grpo_batch(groups: int, n: int, prompt_len: int, response: tuple[int, int], vocab: int,
               seed: int = 0, spans: int = 2):
    """`groups` prompts x `n` samples: each group shares its prompt; responses of random length
    with `spans` masked observation spans (two: a two-search trajectory), random advantages."""
    from services.learner.packing import Sample

    rng = np.random.default_rng(seed)
    samples = []
    for g in range(groups):
        prompt = rng.integers(5, vocab, prompt_len)
        for _ in range(n):
            length = int(rng.integers(*response))
            ids = np.concatenate([prompt, rng.integers(5, vocab, length)])
            mask = np.ones(len(ids))
            mask[:prompt_len] = 0
            for _ in range(spans):
                start = int(rng.integers(prompt_len, max(prompt_len + 1, len(ids) - 40)))
                mask[start : start + min(30, length // 8)] = 0
            sample = Sample(ids, mask, prompt_len=prompt_len, uid=f"g{g}")
            sample.set_response_field("advantages", rng.normal(0, 1, length))
            sample.set_response_field("old_logprobs", np.full(length, -6.0))
            samples.append(sample)
    return samples


def measured_matmul_flops(dry_run: bool) -> float | None:
    """bf16 FLOP/s of a large square matrix product on this GPU (the achievable ceiling)."""
    import torch

    if not torch.cuda.is_available() or dry_run:
        return None
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    synchronize()
    return 2 * n**3 * 10 / (time.perf_counter() - start)


def attention_kernels(trainer, samples) -> list[str]:
    """Names of the attention ops (ATen) and kernels (CUDA) one training step ran."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        trainer.rl_step(samples)
        synchronize()
    names = {event.key for event in prof.key_averages()}
    return sorted(n for n in names if any(w in n.lower() for w in ATTENTION_WORDS))


def kernel_kind(implementation: str, names: list[str]) -> str:
    """What ran, in one phrase, from the profiled names (KERNEL_KINDS); when none matches,
    what transformers was asked for, marked as not seen in the profile."""
    lowered = [n.lower() for n in names]
    for word, kind in KERNEL_KINDS:
        if any(word in n for n in lowered):
            return kind
    return f"{implementation} (no known attention kernel in the profile)"


def run_setting(model_dir: Path, shape: str, zero: int, checkpointing: bool, samples,
                micro_tokens: int, steps: int, profile_kernels: bool,
                attention: str = "auto") -> dict:
    import torch

    from services.common.config.learner import LearnerSection
    from services.learner.trainer import PolicyTrainer

    reset_peak_memory()
    before = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
    cfg = LearnerSection(lr=1e-6, zero_stage=zero, micro_batch_tokens=micro_tokens, grad_clip=1.0,
                         attention=attention)
    started = time.perf_counter()
    trainer = PolicyTrainer(str(model_dir), cfg, gradient_checkpointing=checkpointing)
    build_s = time.perf_counter() - started
    try:
        synchronize()
        warm = time.perf_counter()
        trainer.rl_step(samples)  # warm-up: allocator, kernels, DeepSpeed's first step
        synchronize()
        warmup_s = time.perf_counter() - warm
        times, metrics = [], {}
        for _ in range(steps):
            synchronize()
            start = time.perf_counter()
            metrics = trainer.rl_step(samples)
            synchronize()
            times.append(time.perf_counter() - start)
        result = {
            "shape": shape, "zero_stage": zero, "zero_stage_run": trainer.policy.zero_stage,
            "gradient_checkpointing": checkpointing,
            "dtype": str(trainer.dtype).removeprefix("torch."),
            "attention": attention,
            "attn_implementation": trainer.attn_implementation,
            "attention_reason": trainer.attention.reason,
            "shared_prompts": trainer.share_prompts,
            "micro_batch_tokens": micro_tokens,
            "step_s": round(min(times), 4), "step_times_s": [round(t, 4) for t in times],
            "warmup_step_s": round(warmup_s, 2),
            "tokens_in_batch": int(sum(len(s) for s in samples)),
            "tokens_computed": int(metrics.get("tokens_computed", 0)),
            "build_s": round(build_s, 2),
            "peak_memory_gib": peak_memory_gib(),
            # What earlier settings left allocated in this process (DeepSpeed keeps some of a
            # deleted engine's memory): the setting's own peak is peak - before.
            "memory_before_gib": None if before is None else round(before, 2),
            "loss_finite": bool(np.isfinite(metrics.get("pg_loss", metrics.get("loss", 0.0)))),
            "grad_norm": metrics.get("grad_norm"),
        }
        if profile_kernels:
            names = attention_kernels(trainer, samples)
            result["attention_kernel"] = kernel_kind(trainer.attn_implementation, names)
            result["attention_kernels"] = names[:20]
        return result
    finally:
        del trainer
        gc.collect()
        reset_peak_memory()


# (ZeRO stage, gradient checkpointing, learner.attention) per shape. `auto` is what a run gets
# (flash-attn, else FlexAttention block masks on CUDA, else SDPA); the `sdpa` row beside the
# first is the dense-mask baseline it replaced, timed in the same process.
SETTINGS = ((0, False, "auto"), (0, False, "sdpa"), (0, True, "auto"), (2, False, "auto"),
            (2, True, "auto"))


def measure(args: argparse.Namespace, report: PartReport) -> None:
    facts = device_facts()
    if args.dry_run:
        shapes, micro, steps = ["toy"], 512, 1
        batch = dict(groups=2, n=2, prompt_len=32, response=(16, 96))
    else:
        shapes, micro, steps = ["qwen2.5-0.5b", "qwen2.5-1.5b"], 8192, 3
        batch = dict(groups=8, n=4, prompt_len=256, response=(128, 1024))
    report.set(batch=batch, timed_steps=steps)
    matmul = measured_matmul_flops(args.dry_run)
    peak = datasheet_peak(str(facts.get("device")))
    report.set(datasheet_bf16_flops=peak, measured_matmul_flops=matmul)
    for shape in shapes:
        started = time.perf_counter()
        report.stage(f"{shape}: random weights")
        model_dir = shaped_model(shape)
        say(f"learner: {shape} random weights ready in {time.perf_counter() - started:.1f}s")
        from common import SHAPES

        samples = grpo_batch(vocab=SHAPES[shape]["vocab_size"], **batch)
        profiled: set[str] = set()  # one profiled step per kernel choice and shape
        for zero, checkpointing, attention in SETTINGS:
            report.stage(f"{shape}, ZeRO {zero}, gradient checkpointing {checkpointing}, "
                         f"attention {attention}")
            try:
                result = run_setting(model_dir, shape, zero, checkpointing, samples,
                                     micro, steps, profile_kernels=attention not in profiled,
                                     attention=attention)
            except Exception as exc:  # one setting failing (e.g. OOM) keeps the rest
                result = {"shape": shape, "zero_stage": zero,
                          "gradient_checkpointing": checkpointing, "attention": attention,
                          "error": f"{type(exc).__name__}: {exc}"[:2000]}
            else:
                profiled.add(attention)
                computed = _computed_lengths(samples, result)
                flops = train_flops(shape, computed)
                result["tokens_per_s"] = round(result["tokens_in_batch"] / result["step_s"])
                result["model_tflops_per_s"] = round(flops / result["step_s"] / 1e12, 2)
                result["params"] = parameter_count(shape)["total"]
                if peak:
                    result["mfu"] = round(flops / result["step_s"] / peak, 4)
                if matmul:
                    result["of_measured_matmul"] = round(
                        flops / result["step_s"] / matmul, 4)
            say(f"learner: {result}")
            report.add(result)


def main(argv: list[str] | None = None) -> int:
    return part_main("learner", __doc__, measure, argv)


def _computed_lengths(samples, result: dict) -> list[int]:
    """Sequence lengths whose FLOPs were computed: with shared prompts, each group's prompt
    once (the tokens_computed the trainer counted), spread as lengths for the attention term."""
    lengths = [len(s) for s in samples]
    computed, total = result["tokens_computed"], sum(lengths)
    if not computed or computed >= total:
        return lengths
    scale = computed / total
    return [max(1, int(n * scale)) for n in lengths]


if __name__ == "__main__":
    sys.exit(main())
