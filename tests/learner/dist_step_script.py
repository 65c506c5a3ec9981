"""Run by test_multirank.py (and test_multinode.py, one rank on each of two torchrun "nodes")
under torchrun: one SFT step and one RL step on each of three fixed batches, one after the
other; rank 0 writes the resulting weights and metrics to OUT.

The batches: `mixed` (7 sequences, no shared prompts), `single` (one sequence: rank 1 has only
a dummy pass, so no loss metrics of its own) and `group` (one GRPO group of 4 with one prompt,
computed once per row with learner.shared_prompts)."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

torch.set_num_threads(1)


def make_batch(case: str) -> list:
    from services.learner.packing import Sample

    rng = np.random.default_rng(7)
    if case == "group":
        prompt = rng.integers(5, 400, 30)
        samples = []
        for _ in range(4):
            response = rng.integers(5, 400, int(rng.integers(8, 20)))  # fits one row of 150
            ids = np.concatenate([prompt, response])
            mask = np.concatenate([np.zeros(len(prompt)), np.ones(len(response))])
            s = Sample(ids, mask, prompt_len=len(prompt), uid="g0")
            s.set_response_field("advantages", rng.normal(0, 1, len(response)))
            samples.append(s)
        return samples
    samples = []
    for i in range(7 if case == "mixed" else 1):
        length = int(rng.integers(20, 90))
        mask = np.ones(length)
        mask[:6] = 0
        mask[12:18] = 0
        s = Sample(rng.integers(5, 400, length), mask, prompt_len=6, uid=f"g{i // 2}")
        s.set_response_field("advantages", rng.normal(0, 1, length - 6))
        samples.append(s)
    return samples


def main() -> None:
    from safetensors.torch import save_file

    from services.common.config.learner import LearnerSection
    from services.learner import distributed as D
    from services.learner.trainer import PolicyTrainer, broadcast_samples

    policy, out, zero_stage = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = LearnerSection(lr=1e-3, micro_batch_tokens=150, zero_stage=zero_stage, seed=0)
    trainer = PolicyTrainer(policy, cfg)
    metrics = {}
    for case in ("mixed", "single", "group"):
        samples = make_batch(case) if D.rank() == 0 else None  # rank 0 has it, as in the loop
        samples = broadcast_samples(samples)
        step = {"sft": trainer.sft_step(samples)}
        trainer.compute_log_probs(samples)
        for s in samples:
            s.set_field("old_logprobs", s.fields["old_logprobs"] - 0.1 * s.loss_mask)
        step["rl"] = trainer.rl_step(samples)
        metrics[case] = step
    state = trainer.state_dict_for_export()
    if D.rank() == 0:
        # clone: the export keeps tied names as one tensor, which save_file refuses to write
        save_file({k: v.clone(memory_format=torch.contiguous_format) for k, v in state.items()},
                  f"{out}/weights.safetensors")
        with open(f"{out}/metrics.json", "w") as fh:
            json.dump(metrics, fh)
    D.barrier()


if __name__ == "__main__":
    main()
