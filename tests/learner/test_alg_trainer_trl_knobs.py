"""The trainer's side of TRL's `off_policy_mask_threshold`, `top_entropy_quantile` and
`use_bias_correction_kl` on the tiny policy: the config keys reach `rl_loss`, the masks are
TRL's (trl 1.16.0 grpo_trainer.py, written out here), and the top-entropy threshold is pooled
over the whole mini-batch, so it does not depend on the micro-batch packing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.common.config.learner import LearnerSection
from services.learner.algorithms import agg_loss, compute_policy_loss
from services.learner.logprobs import forward_logits, token_entropy, token_logprobs
from services.learner.packing import pack
from services.learner.trainer import PolicyTrainer


def _trainer(tiny_policy, micro_batch_tokens: int = 160, **algorithm) -> PolicyTrainer:
    cfg = LearnerSection(lr=1e-3, micro_batch_tokens=micro_batch_tokens, total_steps=5, seed=0,
                         algorithm=algorithm)
    return PolicyTrainer(str(tiny_policy), cfg)


def _forward(trainer, samples):
    mb = pack(samples, list(range(len(samples))))
    with torch.no_grad():
        logits = forward_logits(trainer.policy.module, mb)
    return mb, logits


def _loss(trainer, samples, **kwargs):
    tokens, seqs = trainer._counts(samples, list(range(len(samples))))
    mb, logits = _forward(trainer, samples)
    with torch.no_grad():
        return trainer.rl_loss(mb, logits, tokens, seqs, **kwargs)


def _expected_pg(trainer, samples, keep):
    """vanilla PPO on the same rows with `keep` multiplying the per-token loss."""
    mb, logits = _forward(trainer, samples)
    tokens, seqs = trainer._counts(samples, list(range(len(samples))))
    rows = mb.response_matrix
    logp = token_logprobs(logits, mb.input_ids, trainer.temperature)
    settings = trainer.options.loss_settings().with_counts(tokens, seqs, None).with_keep(keep)
    return compute_policy_loss("vanilla", rows(logp), rows(mb.fields["old_logprobs"]),
                               rows(mb.fields["advantages"]), rows(mb.loss_mask), settings)[0]


def trl_get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                            off_policy_threshold):
    kl_div = torch.nan_to_num(sampling_per_token_logps - per_token_logps.detach(), nan=0.0)
    avg_seq_kl = (kl_div * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(
        min=1.0)
    return ((advantages >= 0) | (avg_seq_kl <= off_policy_threshold)).to(dtype=mask.dtype)


def test_off_policy_mask_reaches_the_loss(tiny_policy, samples_factory):
    trainer = _trainer(tiny_policy, off_policy_mask_threshold=0.5)
    samples = samples_factory(6, with_rl=True)  # advantages -1, +1, -1, +1, ...
    trainer.compute_log_probs(samples)
    plain, _ = _loss(_trainer(tiny_policy), samples)
    # no rollout log-probs, old = current: KL 0, nothing dropped
    same, metrics = _loss(trainer, samples)
    assert float(same) == pytest.approx(float(plain), rel=1e-6)
    assert metrics["off_policy_masked_fraction"] == 0.0
    # the sampler far off on samples 0 (A < 0) and 1 (A > 0), close on the rest
    for i, s in enumerate(samples):
        shift = 1.0 if i < 2 else 0.1
        s.set_field("rollout_logprobs", s.fields["old_logprobs"] + shift * s.loss_mask)
    loss, metrics = _loss(trainer, samples)
    mb, logits = _forward(trainer, samples)
    rows = mb.response_matrix
    logp = rows(token_logprobs(logits, mb.input_ids, trainer.temperature))
    adv = rows(mb.fields["advantages"])
    mask = rows(mb.loss_mask)
    keep = trl_get_off_policy_mask(adv, logp, rows(mb.fields["rollout_logprobs"]), mask, 0.5)
    dropped = [bool(((1 - keep[r]) * mask[r]).any()) for r in range(len(samples))]
    assert dropped == [True, False, False, False, False, False]  # only sample 0 (A < 0) goes
    assert float(loss) == pytest.approx(float(_expected_pg(trainer, samples, keep)), rel=1e-6)
    assert float(loss) != pytest.approx(float(plain), rel=1e-3)
    share = float(mask[0].sum() / mask.sum())
    assert metrics["off_policy_masked_fraction"] == pytest.approx(share, rel=1e-5)


def test_entropy_threshold_is_pooled_over_the_mini_batch(tiny_policy, samples_factory):
    trainer = _trainer(tiny_policy, top_entropy_quantile=0.3)
    samples = samples_factory(6, with_rl=True)
    trainer.compute_log_probs(samples)
    indices = list(range(len(samples)))
    entropies, threshold = trainer.loss_token_entropies(samples, indices)
    # TRL: torch.quantile(entropies of every loss token, 1 - rho), from each sample's own forward
    pooled = []
    for i, s in enumerate(samples):
        _, logits = _forward(trainer, [s])
        ent = token_entropy(logits, trainer.temperature)[0]
        pooled.append(ent[torch.from_numpy(s.loss_mask) > 0])
        loss = s.loss_mask > 0  # the learner computes logits only where a loss reads them
        np.testing.assert_allclose(entropies[i][loss], ent.numpy()[loss], atol=1e-5)
    expected = torch.quantile(torch.cat(pooled).float(), 1 - 0.3)
    assert float(threshold) == pytest.approx(float(expected), abs=1e-5)
    # the loss keeps the tokens with entropy >= the pooled threshold (TRL's rule)
    loss, metrics = _loss(trainer, samples, entropies=entropies, entropy_threshold=threshold)
    mb, _ = _forward(trainer, samples)
    rows = mb.response_matrix
    ent_rows = torch.zeros(len(samples), rows(mb.loss_mask).shape[1])
    for r, s in enumerate(samples):
        resp = torch.from_numpy(entropies[r][s.prompt_len:])
        ent_rows[r, : len(resp)] = resp
    mask = rows(mb.loss_mask)
    keep = ((ent_rows * mask >= threshold) & mask.bool()).float()
    assert float(loss) == pytest.approx(float(_expected_pg(trainer, samples, keep)), rel=1e-6)
    kept = float(keep.sum() / mask.sum())
    assert metrics["entropy_mask_kept_fraction"] == pytest.approx(kept, rel=1e-5)
    assert 0.25 < kept < 0.4
    # rl_loss alone (no mini-batch entropies): TRL's rule over this call's tokens, here the
    # whole batch, so the same selection
    alone, alone_metrics = _loss(trainer, samples)
    assert float(alone) == pytest.approx(float(loss), rel=1e-5)
    assert alone_metrics["entropy_mask_kept_fraction"] == pytest.approx(kept, rel=1e-5)


def test_entropy_mask_does_not_depend_on_the_packing(tiny_policy, samples_factory):
    """TRL takes the quantile per forward; Forage per optimizer step, so one micro-batch or
    many give the same loss (TRL's result with one forward per step)."""
    out = []
    for budget in (100, 10_000):
        trainer = _trainer(tiny_policy, micro_batch_tokens=budget, top_entropy_quantile=0.2)
        samples = samples_factory(6, with_rl=True)
        trainer.compute_log_probs(samples)
        micro = len(trainer._plan(samples, list(range(6))))
        assert micro == 1 if budget > 1000 else micro > 1
        metrics = trainer.rl_step(samples)
        assert all(math.isfinite(v) for v in metrics.values())
        out.append(metrics)
    assert out[0]["pg_loss"] == pytest.approx(out[1]["pg_loss"], rel=1e-5)
    assert out[0]["entropy_mask_kept_fraction"] == pytest.approx(
        out[1]["entropy_mask_kept_fraction"], rel=1e-6)
    assert out[0]["grad_norm"] == pytest.approx(out[1]["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl_reaches_the_loss(tiny_policy, samples_factory, level):
    algorithm = {"use_kl_loss": True, "kl_loss_type": "k3", "kl_clamp": False,
                 "kl_loss_coef": 0.1, "use_bias_correction_kl": True, "ratio_kind": level}
    trainer = _trainer(tiny_policy, **algorithm)
    samples = samples_factory(4, with_rl=True)
    trainer.compute_log_probs(samples)
    for s in samples:  # pi_old below the current policy, the reference elsewhere
        s.set_field("ref_logprobs", s.fields["old_logprobs"] - 0.3 * s.loss_mask)
        s.set_field("old_logprobs", s.fields["old_logprobs"] - 0.2 * s.loss_mask)
    _, metrics = _loss(trainer, samples)
    _, plain = _loss(_trainer(tiny_policy, **{**algorithm, "use_bias_correction_kl": False}),
                     samples)
    mb, logits = _forward(trainer, samples)
    rows = mb.response_matrix
    logp = rows(token_logprobs(logits, mb.input_ids, trainer.temperature)).double()
    ref, old = rows(mb.fields["ref_logprobs"]).double(), rows(mb.fields["old_logprobs"]).double()
    mask = rows(mb.loss_mask).double()
    per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1  # TRL's k3
    log_ratio = logp - old
    if level == "token":
        coef_1 = torch.exp(log_ratio)
    else:
        coef_1 = torch.exp(((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))
                           .unsqueeze(-1))
    expected = agg_loss(per_token_kl * coef_1, mask, "token-mean")
    assert metrics["kl_loss"] == pytest.approx(float(expected), rel=1e-5)
    assert plain["kl_loss"] == pytest.approx(float(agg_loss(per_token_kl, mask, "token-mean")),
                                             rel=1e-5)
    assert metrics["kl_loss"] > plain["kl_loss"] * 1.1  # ratio ~ e^0.2 here
