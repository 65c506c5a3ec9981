"""Dr. GRPO's normaliser is a constant: the loss and its gradient do not depend on how the
trainer packs a batch into micro-batches (issue 18).

seq-mean-token-sum-norm divides by max_response_len. Before issue 18, with
learner.algorithm.max_response_len unset the trainer used each micro-batch's longest response
as the divisor, so a batch with uneven response lengths gave one loss packed in one micro-batch
and another packed one sequence per micro-batch; the first test failed there. The divisor is
now learner.algorithm.max_response_len, else the run's rollout.max_response_length (the RL loop
sets it on the trainer), as verl's loss_scale_factor and TRL's max_completion_length are
constants.
"""

from __future__ import annotations

import pytest
import torch

from services.common.config.learner import LearnerSection
from services.learner.logprobs import forward_logits
from services.learner.packing import pack
from services.learner.trainer import PolicyTrainer


def _trainer(tiny_policy, **algorithm) -> PolicyTrainer:
    cfg = LearnerSection(lr=1e-3, micro_batch_tokens=160, total_steps=5, seed=0,
                         algorithm={"loss_agg_mode": "seq-mean-token-sum-norm", **algorithm})
    return PolicyTrainer(str(tiny_policy), cfg)


def loss_and_grads(trainer: PolicyTrainer, samples, plan):
    """The summed micro-batch losses of `plan` and the gradient on every parameter."""
    module = trainer.policy.module
    module.zero_grad(set_to_none=True)
    tokens, seqs = trainer._counts(samples, list(range(len(samples))))
    total = 0.0
    for micro in plan:
        mb = pack(samples, micro)
        loss, _ = trainer.rl_loss(mb, forward_logits(module, mb), tokens, seqs)
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()
             if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return total, grads


def test_dr_grpo_loss_is_invariant_to_packing(tiny_policy, samples_factory):
    trainer = _trainer(tiny_policy)
    trainer.max_response_length = 96  # what the loop sets from rollout.max_response_length
    samples = samples_factory(6, seed=1, with_rl=True)
    lengths = {len(s) - s.prompt_len for s in samples}
    assert len(lengths) > 2  # uneven responses: a per-micro-batch width would differ by packing
    trainer.compute_log_probs(samples)
    for s in samples:  # behaviour log-probs a little off, so ratios are not all 1
        s.set_field("old_logprobs", s.fields["old_logprobs"] - 0.05 * s.loss_mask)
    one, g_one = loss_and_grads(trainer, samples, [list(range(6))])
    singles, g_singles = loss_and_grads(trainer, samples, [[i] for i in range(6)])
    pairs, g_pairs = loss_and_grads(trainer, samples, [[0, 5], [1, 4], [2, 3]])
    planned, g_planned = loss_and_grads(trainer, samples,
                                        trainer._plan(samples, list(range(6))))
    for value in (singles, pairs, planned):
        assert value == pytest.approx(one, rel=1e-5)
    for grads in (g_singles, g_pairs, g_planned):
        for name, g in g_one.items():
            assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-7), name
    # the constant is the divisor: doubling it halves the loss
    trainer.max_response_length = 192
    half, _ = loss_and_grads(trainer, samples, [list(range(6))])
    assert half == pytest.approx(one / 2, rel=1e-5)
    # the config key wins over the run's constant
    keyed = _trainer(tiny_policy, max_response_len=48)
    keyed.max_response_length = 96
    double, _ = loss_and_grads(keyed, samples, [list(range(6))])
    assert double == pytest.approx(one * 2, rel=1e-5)


def test_dr_grpo_without_a_constant_is_a_clear_error(tiny_policy, samples_factory):
    trainer = _trainer(tiny_policy)
    samples = samples_factory(2, with_rl=True)
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm needs a constant divisor"):
        loss_and_grads(trainer, samples, [[0, 1]])
