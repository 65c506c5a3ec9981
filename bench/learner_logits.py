"""Learner steps with logits only where a loss reads them, against logits at every position.

The learner's forward asks the model for logits at the positions that predict a loss token
(transformers' `logits_to_keep`, services/learner/logprobs.py `KeptLogits`). On search
trajectories most of a row is prompt and retrieved text, so the output layer and the
(N, vocab) log-softmax shrink to the policy's own tokens. This bench runs the same SFT or GRPO
step both ways on one model, alternating, and prints the speed ratio (kept over full) and the
size of the largest micro-batch's float32 logits each way (what the loss's log-softmax reads).

Batch shapes are the Search-R1 ones: groups of `--samples` trajectories sharing a
`--prompt`-token prompt; each trajectory has `--turns` policy turns of `--turn` tokens with a
`--obs`-token observation between them (loss mask 0). SFT (`--mode sft`): one trajectory per
prompt, as the warm start's demonstrations are.

    .venv/bin/python bench/learner_logits.py --model runs/smollm2 [--mode grpo|sft] [--repeats 3]

The last line is the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_batch(args: argparse.Namespace, vocab: int) -> list:
    from services.learner.packing import Sample

    rng = np.random.default_rng(0)
    per_group = 1 if args.mode == "sft" else args.samples
    samples = []
    for group in range(args.groups):
        prompt = rng.integers(5, vocab, args.prompt)
        for _ in range(per_group):
            ids, mask = [prompt], [np.zeros(args.prompt)]
            for turn in range(args.turns):
                ids.append(rng.integers(5, vocab, args.turn))
                mask.append(np.ones(args.turn))
                if turn < args.turns - 1:
                    ids.append(rng.integers(5, vocab, args.obs))
                    mask.append(np.zeros(args.obs))
            sample = Sample(np.concatenate(ids), np.concatenate(mask), prompt_len=args.prompt,
                            uid=f"g{group}")
            if args.mode == "grpo":
                n = len(sample) - args.prompt
                sample.set_response_field("advantages", rng.normal(0, 1, n))
                sample.set_response_field("old_logprobs", np.full(n, -6.0))
            samples.append(sample)
    return samples


def logits_mb(trainer, samples: list) -> tuple[float, float]:
    """The largest micro-batch's float32 logits in MB: every position, and the kept ones."""
    indices = list(range(len(samples)))
    vocab = trainer.policy.module.config.vocab_size
    rows = [trainer._pack(samples, micro) for micro in trainer._plan(samples, indices)]
    full = max(mb.num_tokens for mb in rows) * vocab * 4 / 2**20
    kept = max(len(mb.logit_positions) for mb in rows) * vocab * 4 / 2**20
    return full, kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a local HF model directory")
    parser.add_argument("--mode", choices=["grpo", "sft"], default="grpo")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="trajectories per prompt (grpo)")
    parser.add_argument("--prompt", type=int, default=156)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--turn", type=int, default=40)
    parser.add_argument("--obs", type=int, default=60)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from services.common.config.learner import LearnerSection
    from services.learner.trainer import PolicyTrainer

    cfg = LearnerSection(lr=1e-6, micro_batch_tokens=args.micro_batch_tokens, grad_clip=1.0)
    trainer = PolicyTrainer(str(args.model), cfg)
    if not trainer.keep_logits:
        raise SystemExit(f"{args.model}: the model's forward takes no logits_to_keep")
    samples = make_batch(args, trainer.policy.module.config.vocab_size)
    step = trainer.sft_step if args.mode == "sft" else trainer.rl_step
    computed = sum(len(s) for s in samples)
    loss_tokens = sum(s.num_loss_tokens for s in samples)

    def run(keep: bool) -> float:
        trainer.keep_logits = keep
        start = time.perf_counter()
        step(samples)
        return time.perf_counter() - start

    times: dict[bool, list[float]] = {True: [], False: []}
    for keep in (False, True):  # warm-up (allocator, DeepSpeed's first step)
        run(keep)
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        for keep in (True, False):
            times[keep].append(run(keep))
    full, kept = min(times[False]), min(times[True])
    print(f"{args.model.name}, {args.mode}: {len(samples)} sequences, {computed} tokens "
          f"({loss_tokens} in the loss), micro-batches of {args.micro_batch_tokens} tokens, "
          f"{args.threads} threads")
    print("step times (s): full", [round(t, 2) for t in times[False]],
          "kept", [round(t, 2) for t in times[True]])
    full_mb, kept_mb = logits_mb(trainer, samples)
    print(f"full logits: {computed / full:,.0f} tokens/s (best of {args.repeats}); the largest "
          f"micro-batch's logits {full_mb:,.0f} MB")
    print(f"kept logits: {computed / kept:,.0f} tokens/s; the largest micro-batch's logits "
          f"{kept_mb:,.0f} MB")
    print(f"ratio: {full / kept:.3f}")


if __name__ == "__main__":
    main()
