"""From scored trajectories to training samples with advantages (one RL batch).

The order of work matters and is fixed here: rewards (optionally minus the KL penalty to the
reference) → the configured estimator and multi-turn credit mode over (batch, T) tensors →
probe shaping after normalisation → advantages/returns written back into each sample. It needs
the samples' `old_logprobs` (and `ref_logprobs` / `values` when the options ask for them)
already filled by the trainer's collective passes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from services.common.trajectory import ScoredTrajectory
from services.learner import algorithms as alg
from services.learner.algorithms.kl import KLController
from services.learner.batch_stats import overconfidence_per_row
from services.learner.packing import (
    Sample,
    response_tensors,
    sample_from_trajectory,
    set_response_matrix,
)

# Estimators the stream loop cannot feed: ReMax needs a greedy rollout per prompt as baseline.
UNSUPPORTED_IN_LOOP = {"remax": "remax needs a greedy baseline rollout per prompt, which the "
                                 "stream loop does not issue; use grpo, rloo or "
                                 "reinforce_plus_plus_baseline"}


def check_estimator(name: str) -> None:
    """Fail at start-up (not at the first step) for an estimator the loop cannot run."""
    alg.get_adv_estimator_fn(name)  # unknown name -> ValueError listing the known ones
    if name in UNSUPPORTED_IN_LOOP:
        raise ValueError(f"learner.adv_estimator={name}: {UNSUPPORTED_IN_LOOP[name]}")


def samples_of(items: Sequence[ScoredTrajectory], step_rows: bool = False) -> list[Sample]:
    """Training samples of a batch; with `step_rows` each also carries `step_index` (the step of
    every response token, from `Trajectory.turns`) for rllm's one-row-per-step loss."""
    samples = [sample_from_trajectory(item.trajectory) for item in items]
    if step_rows:
        for sample, item in zip(samples, items, strict=True):
            length = len(item.trajectory.response_ids)
            sample.set_response_field("step_index",
                                      np.asarray(alg.step_index_row(item.trajectory.turns, length),
                                                 dtype=np.float32))
    return samples


def response_field_matrix(samples: Sequence[Sample], name: str, width: int) -> torch.Tensor:
    """(batch, width) response-aligned view of a per-token field (zeros past each response)."""
    out = torch.zeros(len(samples), width)
    for row, sample in enumerate(samples):
        values = sample.response_field(name)
        out[row, : len(values)] = torch.from_numpy(np.asarray(values, dtype=np.float32))
    return out


def assign_advantages(
    samples: Sequence[Sample],
    items: Sequence[ScoredTrajectory],
    options: alg.AlgorithmSettings,
    estimator: str,
    *,
    bnpo_state: alg.BNPOState | None = None,
    kl_controller: KLController | None = None,
    overconf_coeff: float = 0.0,
) -> dict[str, float]:
    """Fill `advantages` and `returns` of every sample; returns the step's advantage metrics.

    An unscorable trajectory (reward NaN: every reward function returned None) follows TRL's
    GRPOTrainer: it is left out of every baseline and normalisation (group mean and std, batch
    whitening) and gets advantage 0, so it neither moves the policy nor biases the others'
    baselines; it stays in the batch (KL and loss normalisation see it, as in TRL). Its returns
    are 0, or its own values under GAE (no pull on the critic)."""
    if len(samples) != len(items):
        raise ValueError(f"{len(samples)} samples for {len(items)} scored trajectories")
    scorable = [row for row, item in enumerate(items) if not math.isnan(float(item.reward))]
    if len(scorable) == len(items):
        return _assign(samples, items, options, estimator, bnpo_state, kl_controller,
                       overconf_coeff)
    for row in sorted(set(range(len(items))) - set(scorable)):
        sample = samples[row]
        zeros = np.zeros(len(sample) - sample.prompt_len, dtype=np.float32)
        sample.set_response_field("advantages", zeros)
        own_values = estimator == "gae" and "values" in sample.fields
        sample.set_response_field("returns", sample.response_field("values").copy()
                                  if own_values else zeros)
    metrics: dict[str, float] = {}
    if scorable:
        metrics = _assign([samples[r] for r in scorable], [items[r] for r in scorable], options,
                          estimator, bnpo_state, kl_controller, overconf_coeff)
    metrics["rewards/unscorable_fraction"] = 1.0 - len(scorable) / len(items)
    return metrics


def _assign(
    samples: Sequence[Sample],
    items: Sequence[ScoredTrajectory],
    options: alg.AlgorithmSettings,
    estimator: str,
    bnpo_state: alg.BNPOState | None,
    kl_controller: KLController | None,
    overconf_coeff: float,
) -> dict[str, float]:
    tensors = response_tensors(samples, [float(i.reward) for i in items])
    mask = tensors["response_mask"]
    token_rewards = tensors["token_level_rewards"]
    width = mask.shape[1]
    metrics: dict[str, float] = {}
    if options.use_kl_in_reward:
        if kl_controller is None:
            raise ValueError("use_kl_in_reward needs a KL controller")
        old = response_field_matrix(samples, "old_logprobs", width)
        ref = response_field_matrix(samples, "ref_logprobs", width)
        token_rewards, kl_metrics = alg.apply_kl_penalty(
            token_rewards, old, ref, mask, kl_controller, options.kl_penalty
        )
        metrics.update(kl_metrics)
    kwargs: dict[str, Any] = options.advantage_options(estimator, bnpo_state)
    if estimator == "gae":
        kwargs["values"] = response_field_matrix(samples, "values", width)
    if options.multi_turn != "trajectory":
        kwargs["turn_spans"] = [item.trajectory.turns for item in items]
    advantages, returns = alg.compute_advantage(
        token_rewards, mask, tensors["group_ids"], **kwargs
    )
    if overconf_coeff != 0.0:
        over = overconfidence_per_row(items)
        advantages = alg.apply_overconfidence_penalty(advantages, mask, over, overconf_coeff)
        metrics.update(alg.overconfidence_penalty_metrics(over, overconf_coeff))
    set_response_matrix(samples, "advantages", advantages)
    set_response_matrix(samples, "returns", returns)
    if mask.sum() > 0:
        metrics["advantages/mean"] = float(alg.masked_mean(advantages, mask))
        metrics["advantages/abs_mean"] = float(alg.masked_mean(advantages.abs(), mask))
        metrics["returns/mean"] = float(alg.masked_mean(returns, mask))
    return metrics
