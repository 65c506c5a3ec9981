"""Learner throughput: a DeepSpeed training step vs a plain PyTorch AdamW loop, same batch.

Both sides train the same tiny Qwen2 policy on the same batch of variable-length trajectories,
packed into the same padding-free micro-batches, with the same loss (the PPO policy loss when
services.learner.algorithms provides it, else the masked NLL of SFT), gradient clipping and
AdamW. The ratio is DeepSpeed tokens/s over plain tokens/s, so it measures what the engine
wrapper costs. Also printed: the fraction of computed tokens that are padding (packed layout)
next to what naive row padding would have cost on the same batch.

    .venv/bin/python bench/learner.py [--sequences 24] [--repeats 5]

The last line is the ratio.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch


def make_batch(n: int, seed: int, vocab: int, min_len: int, max_len: int):
    from services.learner.packing import Sample

    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        length = int(rng.integers(min_len, max_len))
        prompt = int(rng.integers(16, 48))
        mask = np.ones(length)
        mask[:prompt] = 0
        # two observation spans inside the response, as a 2-search trajectory has
        for _ in range(2):
            start = int(rng.integers(prompt, max(prompt + 1, length - 40)))
            mask[start : start + 30] = 0
        sample = Sample(rng.integers(5, vocab, length), mask, prompt_len=prompt, uid=f"g{i // 4}")
        sample.set_response_field("advantages", rng.normal(0, 1, length - prompt))
        sample.set_response_field("old_logprobs", np.full(length - prompt, -6.0))
        samples.append(sample)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=24)
    parser.add_argument("--min-len", type=int, default=48)
    parser.add_argument("--max-len", type=int, default=640)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from services.common.config.learner import LearnerSection
    from services.learner.packing import pack, padding_fraction_padded
    from services.learner.trainer import PolicyTrainer
    from services.tasks.tiny_policy import make_test_policy

    policy = make_test_policy(tempfile.mkdtemp(prefix="bench-learner-") + "/policy")
    cfg = LearnerSection(lr=1e-5, micro_batch_tokens=args.micro_batch_tokens, grad_clip=1.0)
    trainer = PolicyTrainer(str(policy), cfg)
    # both sides compute every position's logits: this bench measures the engine wrapper (the
    # kept-logits saving has its own bench, learner_logits.py)
    trainer.keep_logits = False
    vocab = trainer.policy.module.config.vocab_size
    samples = make_batch(args.sequences, 0, vocab, args.min_len, args.max_len)
    try:
        from services.learner.algorithms import policy_loss  # noqa: F401

        loss_fn, loss_name, step = trainer.rl_loss, "ppo policy loss", trainer.rl_step
    except ImportError:
        loss_fn, loss_name, step = trainer.sft_loss, "masked nll (sft)", trainer.sft_step

    model = AutoModelForCausalLM.from_pretrained(str(policy), attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    indices = list(range(len(samples)))

    def plain_step() -> None:
        model.train()
        tokens, seqs = trainer._counts(samples, indices)
        for micro in trainer._plan(samples, indices):
            mb = pack(samples, micro)
            logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids,
                           use_cache=False).logits
            loss, _ = loss_fn(mb, logits, tokens, seqs)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    metrics: dict[str, float] = {}

    def ds_step() -> None:
        metrics.update(step(samples))

    total_tokens = sum(len(s) for s in samples)
    for fn in (plain_step, ds_step):  # warm-up (allocator, kernels, DeepSpeed first step)
        fn()
    plain_t, ds_t = [], []
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        for fn, times in ((plain_step, plain_t), (ds_step, ds_t)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    print("step times (s): plain", [round(t, 2) for t in plain_t], "deepspeed", [round(t, 2) for t in ds_t])
    plain_tps = total_tokens / min(plain_t)
    ds_tps = total_tokens / min(ds_t)
    lengths = [len(s) for s in samples]
    n_micro = len(trainer._plan(samples, indices))
    naive = padding_fraction_padded(lengths, max(1, len(samples) // n_micro))
    print(f"batch: {len(samples)} sequences, {total_tokens} tokens, lengths "
          f"{min(lengths)}..{max(lengths)}, {n_micro} packed micro-batches, loss: {loss_name}")
    print(f"plain torch AdamW: {plain_tps:,.0f} tokens/s (best of {args.repeats}: the machine is shared, the minimum is the least disturbed)")
    print(f"deepspeed (zero {cfg.zero_stage}): {ds_tps:,.0f} tokens/s")
    print(f"padding fraction (packed): {metrics['padding_fraction']:.4f}   "
          f"naive padded rows, same micro count: {naive:.4f}")
    print(f"ratio: {ds_tps / plain_tps:.3f}")


if __name__ == "__main__":
    main()
