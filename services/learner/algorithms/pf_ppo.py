"""PF-PPO: resample the batch by reward-based weights before the update (verl `use_pf_ppo`).

verl 0.9.1 `verl/trainer/ppo/core_algos.py` `compute_pf_ppo_reweight_data` (read from the PyPI
wheel; PF-PPO, arXiv 2409.06957). Why: with a noisy reward model, the samples with extreme
rewards are the ones whose reward is most reliable, so the policy is trained on a batch redrawn
with replacement in favour of them. verl's `compute_advantage` (ray_trainer.py) calls it in the
`gae` branch only, right after the advantages and returns are computed, with
`algorithm.pf_ppo.reweight_method` and `algorithm.pf_ppo.weight_pow`.

Here it is a pure function of the sequence scores that returns the indices to keep: the caller
builds the resampled batch (`batch[indices]`, duplicates included). The RL loop calls it with
`learner.algorithm.use_pf_ppo`, after the advantages, through `rl_batch.pf_ppo_batch`
(docs/algorithms.md, "PF-PPO").
"""

from __future__ import annotations

import torch

PF_PPO_METHODS: tuple[str, ...] = ("pow", "max_min", "max_random")


@torch.no_grad()
def pf_ppo_weights(scores: torch.Tensor, method: str = "pow", weight_pow: float = 2.0
                   ) -> torch.Tensor:
    """verl's sampling weights of each sequence score (before its + 1e-8 floor):

    - `pow`: |score| ** weight_pow;
    - `max_min`: 1 for a score equal to the batch max or min, else 0;
    - `max_random`: 0.4 for the batch max, else 0.1.
    """
    if method == "pow":
        return torch.pow(torch.abs(scores), weight_pow)
    if method == "max_min":
        best, worst = torch.max(scores), torch.min(scores)
        return torch.where((scores == best) | (scores == worst), 1.0, 0.0).to(scores.dtype)
    if method == "max_random":
        return torch.where(scores == torch.max(scores), 0.4, 0.1).to(scores.dtype)
    raise ValueError(f"unknown pf_ppo_reweight_method {method!r}; choose one of "
                     f"{', '.join(PF_PPO_METHODS)}")


@torch.no_grad()
def pf_ppo_resample(
    scores: torch.Tensor,
    method: str = "pow",
    weight_pow: float = 2.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(B,) int64 indices of the resampled batch: B draws with replacement, with probability
    proportional to clamp(weights + 1e-8, min=1e-8) (verl `compute_pf_ppo_reweight_data`).

    `scores` are the sequence scores, verl's `token_level_scores.sum(-1)`: the reward before any
    KL penalty (Forage: the trajectory's reward). Pass a seeded `generator` for a reproducible
    draw (torch's global RNG otherwise, as verl). A NaN score (an unscorable trajectory) is an
    error: it has no weight (verl would fail inside torch.multinomial)."""
    scores = scores.reshape(-1).float()
    if scores.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    if torch.isnan(scores).any():
        raise ValueError("pf_ppo_resample: NaN score (an unscorable trajectory) has no weight")
    weights = torch.clamp(pf_ppo_weights(scores, method, weight_pow) + 1e-8, min=1e-8)
    return torch.multinomial(weights, scores.numel(), replacement=True, generator=generator)
