"""Logits only where a loss reads them (logprobs.KeptLogits): the learner computes the output
layer at the positions that predict a loss token, and its losses, log-probs and updates are
those of a full forward."""

from __future__ import annotations

import pytest
import torch

from services.common.config.learner import LearnerSection
from services.learner.logprobs import (
    KeptLogits,
    token_entropy,
    token_logprobs,
    token_sum_pi_squared,
)
from services.learner.packing import pack
from services.learner.trainer import PolicyTrainer


def test_token_values_at_kept_positions_equal_the_full_forwards() -> None:
    torch.manual_seed(0)
    length, vocab = 12, 50
    logits = torch.randn(1, length, vocab)
    ids = torch.randint(0, vocab, (1, length))
    positions = torch.tensor([2, 3, 4, 8, 10])
    kept = KeptLogits(positions, length)
    at = positions + 1  # the token each kept position predicts
    elsewhere = torch.ones(length, dtype=torch.bool)
    elsewhere[at] = False
    pairs = [
        (token_logprobs(logits, ids, 0.7), token_logprobs(logits[:, positions], ids, 0.7, kept)),
        (token_entropy(logits, 0.7), token_entropy(logits[:, positions], 0.7, kept)),
        (token_sum_pi_squared(logits), token_sum_pi_squared(logits[:, positions], 1.0, kept)),
    ]
    for full, part in pairs:
        assert part.shape == (1, length)
        torch.testing.assert_close(part[0, at], full[0, at])
        assert not part[0, elsewhere].any()


def test_the_packed_row_keeps_the_positions_before_its_loss_tokens(samples_factory) -> None:
    samples = samples_factory(3)
    mb = pack(samples, [0, 1, 2], 0)
    positions = mb.logit_positions
    assert torch.equal(mb.loss_mask[0, positions + 1], torch.ones(len(positions)))
    assert len(positions) == int(mb.loss_mask.sum())


def _pair(tiny_policy, **kw) -> tuple[PolicyTrainer, PolicyTrainer]:
    """Two trainers from the same weights: one computes logits only where a loss reads them
    (the default with a transformers model), one computes them everywhere."""
    cfg = LearnerSection(lr=1e-3, micro_batch_tokens=160, total_steps=5, seed=0, grad_clip=1.0,
                         **kw)
    kept, full = PolicyTrainer(str(tiny_policy), cfg), PolicyTrainer(str(tiny_policy), cfg)
    assert kept.keep_logits
    full.keep_logits = False
    return kept, full


def _assert_same_weights(a: PolicyTrainer, b: PolicyTrainer) -> None:
    for (name, p), (_, q) in zip(a.policy.module.named_parameters(),
                                 b.policy.module.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=2e-6, rtol=1e-5, msg=name)


def test_sft_and_rl_steps_match_a_full_forward(tiny_policy, samples_factory,
                                               group_samples_factory) -> None:
    kept, full = _pair(tiny_policy)
    sft = samples_factory(6)
    a, b = kept.sft_step(sft), full.sft_step(sft)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    _assert_same_weights(kept, full)

    rl_kept = group_samples_factory(with_rl=True)  # shared prompts, observation spans
    rl_full = group_samples_factory(with_rl=True)
    kept.compute_log_probs(rl_kept, sum_pi_squared=True)
    full.compute_log_probs(rl_full, sum_pi_squared=True)
    for s, t in zip(rl_kept, rl_full, strict=True):
        loss = s.loss_mask > 0
        for name in ("old_logprobs", "sum_pi_squared"):
            torch.testing.assert_close(torch.from_numpy(s.fields[name][loss]),
                                       torch.from_numpy(t.fields[name][loss]))
            assert not s.fields[name][~loss].any()  # nothing computed off the loss tokens
    a, b = kept.rl_step(rl_kept), full.rl_step(rl_full)
    for key in ("pg_loss", "grad_norm", "ppo_kl"):
        if key in b:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
    _assert_same_weights(kept, full)
