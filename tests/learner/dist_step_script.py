"""Run by test_multirank.py under torchrun: one SFT step (and one RL step when the algorithms
exist) on a fixed batch; rank 0 writes the resulting weights and metrics to OUT."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

torch.set_num_threads(1)


def main() -> None:
    from safetensors.torch import save_file

    from services.common.config.learner import LearnerSection
    from services.learner import distributed as D
    from services.learner.packing import Sample
    from services.learner.trainer import PolicyTrainer, broadcast_samples

    policy, out, zero_stage = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = LearnerSection(lr=1e-3, micro_batch_tokens=150, zero_stage=zero_stage, seed=0)
    trainer = PolicyTrainer(policy, cfg)
    samples = None
    if D.rank() == 0:  # only rank 0 has the batch, as in the loop; the others receive it
        rng = np.random.default_rng(7)
        samples = []
        for i in range(7):
            length = int(rng.integers(20, 90))
            mask = np.ones(length)
            mask[:6] = 0
            mask[12:18] = 0
            s = Sample(rng.integers(5, 400, length), mask, prompt_len=6, uid=f"g{i // 2}")
            s.set_response_field("advantages", rng.normal(0, 1, length - 6))
            samples.append(s)
    samples = broadcast_samples(samples)
    metrics = {"sft": trainer.sft_step(samples)}
    try:
        from services.learner.algorithms import policy_loss  # noqa: F401

        trainer.compute_log_probs(samples)
        for s in samples:
            s.set_field("old_logprobs", s.fields["old_logprobs"] - 0.1 * s.loss_mask)
        metrics["rl"] = trainer.rl_step(samples)
    except ImportError:
        pass
    state = trainer.state_dict_for_export()
    if D.rank() == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, f"{out}/weights.safetensors")
        with open(f"{out}/metrics.json", "w") as fh:
            json.dump(metrics, fh)
    D.barrier()


if __name__ == "__main__":
    main()
