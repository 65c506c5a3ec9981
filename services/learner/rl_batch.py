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
from services.learner.algorithms.registry import NEEDS_POLICY_STATS, NEEDS_ROW_INPUTS
from services.learner.batch_stats import memory_answers, overconfidence_per_row
from services.learner.packing import (
    Sample,
    response_tensors,
    sample_from_trajectory,
    set_response_matrix,
)


def check_estimator(
    name: str, options: alg.AlgorithmSettings | None = None, n_samples: int | None = None
) -> None:
    """Fail at start-up (not at the first step) for an estimator the loop cannot run with these
    options: an unknown name, per-row inputs under a stepwise multi-turn mode, Pass@k with
    groups of one, GDPO without reward keys."""
    alg.get_adv_estimator_fn(name)  # unknown name -> ValueError listing the known ones
    if options is not None and options.multi_turn != "trajectory" and name in NEEDS_ROW_INPUTS:
        raise ValueError(f"learner.adv_estimator={name} needs per-row inputs, which "
                         f"learner.algorithm.multi_turn={options.multi_turn} cannot split by "
                         "step; use multi_turn: trajectory")
    if name == "grpo_passk" and n_samples is not None and n_samples < 2:
        raise ValueError("learner.adv_estimator=grpo_passk needs data.n_samples >= 2")
    if options is not None and options.use_pf_ppo and name != "gae":
        raise ValueError("learner.algorithm.use_pf_ppo: verl applies PF-PPO only with "
                         f"learner.adv_estimator=gae, not {name}")
    if name == "gdpo" and options is not None and not options.gdpo_reward_keys:
        raise ValueError("learner.adv_estimator=gdpo needs learner.algorithm.gdpo_reward_keys "
                         "(the scorer's reward_components to normalise separately)")


def samples_of(
    items: Sequence[ScoredTrajectory], step_rows: bool = False, mask_truncated: bool = False
) -> list[Sample]:
    """Training samples of a batch; with `step_rows` each also carries `step_index` (the step of
    every response token, from `Trajectory.turns`) for rllm's one-row-per-step loss. With
    `mask_truncated` (TRL mask_truncated_completions) a trajectory cut at the response budget
    (finish_reason "length") keeps its reward for the baselines but has no loss token."""
    samples = [sample_from_trajectory(item.trajectory) for item in items]
    if mask_truncated:
        for sample, item in zip(samples, items, strict=True):
            if item.trajectory.finish_reason == "length":
                sample.loss_mask[:] = 0.0
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


def apply_rollout_correction(
    samples: Sequence[Sample], options: alg.AlgorithmSettings
) -> dict[str, float]:
    """Decoupled rollout correction (verl `compute_rollout_correction_and_add_to_batch`): IS
    weights of old vs rollout log-probs into the `rollout_is_weights` field, rejected tokens out
    of each sample's loss mask, `rollout_corr/*` metrics. Runs before the advantages (which then
    see the rejection, as in verl) and on every rank: its inputs are on every rank and the
    arithmetic is deterministic, so no exchange is needed.

    The metrics are verl's `compute_rollout_correction_and_rejection_mask` ones under its exact
    names (IS, rejection and the off-policy gap: kl, k3_kl, perplexities, chi-square), taken
    over the loss mask before rejection; a row without a loss token (a masked truncated
    completion) counts in the per-row means as verl's fully masked rows do.

    Token-level IS alone, without old log-probs (one update per batch, so old = current), is
    left to the loss (`rollout_correction_needs_batch`), which computes the same weights from
    the current log-probs without an extra forward pass (and reports the IS metrics only)."""
    if not options.uses_rollout_correction or not samples:
        return {}
    no_old = any("old_logprobs" not in s.fields for s in samples)
    if no_old and not options.rollout_correction_needs_batch:
        return {}
    missing = [i for i, s in enumerate(samples)
               if "rollout_logprobs" not in s.fields or "old_logprobs" not in s.fields]
    if missing:
        raise ValueError(f"rollout correction needs rollout and old log-probs; samples "
                         f"{missing[:5]} lack them (trajectories without rollout_logprobs?)")
    width = max(len(s) - s.prompt_len for s in samples)
    mask = torch.zeros(len(samples), width)
    for row, sample in enumerate(samples):
        resp = sample.loss_mask[sample.prompt_len:]
        mask[row, : len(resp)] = torch.from_numpy(resp.copy())
    old = response_field_matrix(samples, "old_logprobs", width)
    rollout = response_field_matrix(samples, "rollout_logprobs", width)
    weights, kept, metrics = alg.rollout_correction(old, rollout, mask,
                                                    **options.rollout_correction_options())
    for row, sample in enumerate(samples):
        n = len(sample) - sample.prompt_len
        sample.loss_mask[sample.prompt_len:] = kept[row, :n].numpy()
    if weights is not None:
        set_response_matrix(samples, "rollout_is_weights", weights)
    return metrics


def assign_advantages(
    samples: Sequence[Sample],
    items: Sequence[ScoredTrajectory],
    options: alg.AlgorithmSettings,
    estimator: str,
    *,
    bnpo_state: alg.BNPOState | None = None,
    kl_controller: KLController | None = None,
    overconf_coeff: float = 0.0,
    reward_baselines: dict[str, float] | None = None,
    evidence_coeff: float = 0.0,
) -> dict[str, float]:
    """Fill `advantages` and `returns` of every sample; returns the step's advantage metrics.

    An unscorable trajectory (reward NaN: every reward function returned None) follows TRL's
    GRPOTrainer: it is left out of every baseline and normalisation (group mean and std, batch
    whitening) and gets advantage 0, so it neither moves the policy nor biases the others'
    baselines; it stays in the batch (KL and loss normalisation see it, as in TRL). Its returns
    are 0, or its own values under GAE (no pull on the critic). Under ReMax a group whose greedy
    baseline is unscorable is treated the same way (no baseline, no advantage).
    `reward_baselines`: ReMax's greedy reward per group uid."""
    if len(samples) != len(items):
        raise ValueError(f"{len(samples)} samples for {len(items)} scored trajectories")
    scorable = [row for row, item in enumerate(items) if not math.isnan(float(item.reward))]
    if estimator == "remax" and reward_baselines:  # an unscorable greedy sample: no baseline
        scorable = [row for row in scorable if not math.isnan(
            float(reward_baselines.get(items[row].trajectory.uid, 0.0)))]
    if len(scorable) == len(items):
        return _assign(samples, items, options, estimator, bnpo_state, kl_controller,
                       overconf_coeff, reward_baselines, evidence_coeff)
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
                          estimator, bnpo_state, kl_controller, overconf_coeff, reward_baselines,
                          evidence_coeff)
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
    reward_baselines: dict[str, float] | None = None,
    evidence_coeff: float = 0.0,
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
    kwargs.update(_row_inputs(samples, items, options, estimator, width, reward_baselines))
    if options.multi_turn != "trajectory":
        kwargs["turn_spans"] = [item.trajectory.turns for item in items]
    advantages, returns = alg.compute_advantage(
        token_rewards, mask, tensors["group_ids"], **kwargs
    )
    if overconf_coeff != 0.0:
        over = overconfidence_per_row(items)
        advantages = alg.apply_overconfidence_penalty(advantages, mask, over, overconf_coeff)
        metrics.update(alg.overconfidence_penalty_metrics(over, overconf_coeff))
    if evidence_coeff != 0.0:
        memory = memory_answers(items)
        advantages = evidence_shaping(advantages, mask, memory, evidence_coeff)
        shaped = [m for m in memory if m is not None]
        metrics["probe/evidence_penalty_mean"] = (
            evidence_coeff * sum(shaped) / len(shaped) if shaped else 0.0)
    set_response_matrix(samples, "advantages", advantages)
    set_response_matrix(samples, "returns", returns)
    if mask.sum() > 0:
        metrics["advantages/mean"] = float(alg.masked_mean(advantages, mask))
        metrics["advantages/abs_mean"] = float(alg.masked_mean(advantages.abs(), mask))
        metrics["returns/mean"] = float(alg.masked_mean(returns, mask))
    return metrics


def _row_inputs(
    samples: Sequence[Sample],
    items: Sequence[ScoredTrajectory],
    options: alg.AlgorithmSettings,
    estimator: str,
    width: int,
    reward_baselines: dict[str, float] | None,
) -> dict[str, Any]:
    """Per-row estimator inputs besides rewards: ReMax's greedy rewards (by group uid), GDPO's
    reward components, the optimal token baselines' policy statistics."""
    if estimator == "remax":
        baselines = reward_baselines or {}
        missing = sorted({i.trajectory.uid for i in items} - set(baselines))
        if missing:
            raise ValueError(f"remax: no greedy baseline reward for groups {missing[:5]}")
        return {"reward_baselines": [float(baselines[i.trajectory.uid]) for i in items]}
    if estimator == "gdpo":
        rows = []
        for key in options.gdpo_reward_keys:
            row = []
            for item in items:
                if key not in item.reward_components:
                    raise ValueError(f"gdpo: trajectory {item.trajectory.sample_id} has no "
                                     f"reward component {key!r} (it has "
                                     f"{sorted(item.reward_components)})")
                row.append(float(item.reward_components[key]))
            rows.append(row)
        return {"component_scores": torch.tensor(rows)}
    if estimator in NEEDS_POLICY_STATS:
        for name in ("old_logprobs", "sum_pi_squared"):
            if any(name not in s.fields for s in samples):
                raise ValueError(f"{estimator} needs {name} from the old-log-prob pass")
        out: dict[str, Any] = {
            "old_log_probs": response_field_matrix(samples, "old_logprobs", width),
            "sum_pi_squared": response_field_matrix(samples, "sum_pi_squared", width),
        }
        if all("rollout_is_weights" in s.fields for s in samples):
            out["rollout_is_weights"] = response_field_matrix(samples, "rollout_is_weights", width)
        return out
    return {}


def pf_ppo_batch(rewards: Sequence[float], options: alg.AlgorithmSettings, seed: int,
                 step: int) -> torch.Tensor:
    """PF-PPO's draw for one step (verl's compute_pf_ppo_reweight_data on the sequence
    rewards): the indices of the samples the update trains on, duplicates included. Seeded by
    the run's seed and the step, so a resumed step draws the same batch."""
    from services.learner.algorithms.pf_ppo import pf_ppo_resample

    generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    scores = torch.tensor(list(rewards), dtype=torch.float32)
    return pf_ppo_resample(scores, generator=generator, **options.pf_ppo_options())


def evidence_shaping(advantages: torch.Tensor, response_mask: torch.Tensor,
                     memory: Sequence[float | None], coeff: float) -> torch.Tensor:
    """probe.evidence.coeff (a departure from Search-R1; docs/probe.md): advantages - coeff *
    memory on each row's masked tokens, after normalisation, where `memory` is
    `batch_stats.memory_answers` (1: a right answer that survives swapped evidence; None: not
    probed, unchanged). A new tensor."""
    if len(memory) != advantages.shape[0]:
        raise ValueError(f"{len(memory)} rows of evidence for {advantages.shape[0]} advantages")
    penalty = torch.tensor([0.0 if m is None else coeff * float(m) for m in memory],
                           dtype=advantages.dtype, device=advantages.device)
    return advantages - penalty.unsqueeze(-1) * response_mask.to(advantages.dtype)
