"""The trainer's side of issue 18 on the tiny policy: every policy loss is selectable by
`learner.algorithm.policy_loss` and trains; rollout IS weights and bypass mode reach the loss;
the old-log-prob pass also gives sum_pi_squared for the optimal token baselines."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.common.config.learner import LearnerSection
from services.learner.algorithms import POLICY_LOSSES, compute_policy_loss
from services.learner.logprobs import forward_logits, token_logprobs
from services.learner.packing import pack
from services.learner.trainer import PolicyTrainer

EXTRA = {"dro": {"dro_beta": 0.1}}


def _trainer(tiny_policy, **algorithm) -> PolicyTrainer:
    cfg = LearnerSection(lr=1e-3, micro_batch_tokens=160, total_steps=5, seed=0,
                         algorithm=algorithm)
    return PolicyTrainer(str(tiny_policy), cfg)


def _rl_samples(factory, trainer, n=4):
    samples = factory(n, with_rl=True)
    trainer.compute_log_probs(samples)
    for s in samples:  # the sampler's log-probs: a little off the trainer's
        s.set_field("rollout_logprobs", s.fields["old_logprobs"] - 0.1 * s.loss_mask)
    return samples


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_is_selectable_and_trains(tiny_policy, samples_factory, name):
    trainer = _trainer(tiny_policy, policy_loss=name, **EXTRA.get(name, {}))
    samples = _rl_samples(samples_factory, trainer)
    metrics = trainer.rl_step(samples)
    assert math.isfinite(metrics["pg_loss"]) and metrics["grad_norm"] > 0
    assert all(math.isfinite(v) for v in metrics.values())


def test_sum_pi_squared_comes_with_the_old_log_probs(tiny_policy, samples_factory):
    trainer = _trainer(tiny_policy)
    samples = samples_factory(3)
    trainer.compute_log_probs(samples, sum_pi_squared=True)
    module = trainer.policy.module
    for s in samples:
        mb = pack([s], [0])
        with torch.no_grad():
            logits = forward_logits(module, mb).float()
        expected = (torch.softmax(logits[0, :-1], dim=-1) ** 2).sum(-1)  # predicts token p >= 1
        # read at the loss tokens, the only ones whose logits the learner computes
        loss = s.loss_mask[1:] > 0
        np.testing.assert_allclose(s.fields["sum_pi_squared"][1:][loss],
                                   expected.numpy()[loss], rtol=1e-5)
        np.testing.assert_allclose(s.fields["old_logprobs"][1:][loss],
                                   token_logprobs(logits, mb.input_ids)[0, 1:].numpy()[loss],
                                   atol=1e-5)


def _loss(trainer, samples):
    tokens, seqs = trainer._counts(samples, list(range(len(samples))))
    mb = pack(samples, list(range(len(samples))))
    with torch.no_grad():
        return trainer.rl_loss(mb, forward_logits(trainer.policy.module, mb), tokens, seqs)


def test_rollout_is_weights_reach_the_loss(tiny_policy, samples_factory):
    trainer = _trainer(tiny_policy)
    samples = _rl_samples(samples_factory, trainer)
    plain, _ = _loss(trainer, samples)
    for s in samples:
        s.set_field("rollout_is_weights", 0.5 * s.loss_mask)
    halved, _ = _loss(trainer, samples)
    assert float(halved) == pytest.approx(0.5 * float(plain), rel=1e-5)


def test_bypass_mode_uses_the_rollout_log_probs_as_old(tiny_policy, samples_factory):
    trainer = _trainer(tiny_policy, bypass_mode=True, rollout_is="token",
                       rollout_rs="token_k3", rollout_rs_threshold=1.0)
    samples = _rl_samples(samples_factory, trainer)
    loss, metrics = _loss(trainer, samples)
    assert "rollout_corr/rollout_is_mean" in metrics
    # the same as vanilla PPO with old := rollout (rejection keeps everything at this bound)
    mb = pack(samples, list(range(len(samples))))
    tokens, seqs = trainer._counts(samples, list(range(len(samples))))
    with torch.no_grad():
        logp = token_logprobs(forward_logits(trainer.policy.module, mb), mb.input_ids)
    rows = mb.response_matrix
    settings = trainer.options.loss_settings().with_counts(tokens, seqs, None)
    ref, _ = compute_policy_loss("vanilla", rows(logp), rows(mb.fields["rollout_logprobs"]),
                                 rows(mb.fields["advantages"]), rows(mb.loss_mask), settings)
    assert float(loss) == pytest.approx(float(ref), rel=1e-6)
    del samples[0].fields["rollout_logprobs"]
    for s in samples[1:]:
        del s.fields["rollout_logprobs"]
    with pytest.raises(ValueError, match="bypass_mode needs the rollout's log-probs"):
        _loss(trainer, samples)


def test_token_is_without_an_old_pass_is_computed_in_the_loss(tiny_policy, samples_factory):
    """tis_cap / rollout_is="token" alone with one update per batch: no old-log-prob pass, the
    loss weighs each token by min(exp(logp - rollout), cap) from the current log-probs."""
    from services.learner.algorithms import AlgorithmSettings
    from services.learner.rl_batch import apply_rollout_correction

    trainer = _trainer(tiny_policy, tis_cap=1.05)
    samples = _rl_samples(samples_factory, trainer)
    for s in samples:
        del s.fields["old_logprobs"]  # what the loop does with a single update
    assert not trainer.options.rollout_correction_needs_batch
    assert apply_rollout_correction(samples, trainer.options) == {}
    loss, metrics = _loss(trainer, samples)
    assert metrics["rollout_corr/rollout_is_mean"] > 0
    explicit = _trainer(tiny_policy)
    for s in samples:
        logp_minus_rollout = 0.1 * s.loss_mask  # rollout = old - 0.1 on loss tokens
        s.set_field("rollout_is_weights", np.minimum(np.exp(logp_minus_rollout), 1.05))
    expected, _ = _loss(explicit, samples)
    assert float(loss) == pytest.approx(float(expected), rel=1e-4)
    for needs in ({"rollout_rs": "token_k2", "rollout_rs_threshold": 1.0},
                  {"rollout_is": "sequence"},
                  {"rollout_is": "token", "rollout_is_batch_normalize": True}):
        assert AlgorithmSettings(**needs).rollout_correction_needs_batch, needs
