"""DeepSpeed training on the tiny policy: loss goes down, masks hold, checkpoints resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.config.learner import LearnerSection
from services.learner.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from services.learner.logprobs import forward_logits
from services.learner.packing import pack
from services.learner.trainer import PolicyTrainer


def _cfg(**kw) -> LearnerSection:
    base = dict(lr=1e-3, micro_batch_tokens=160, total_steps=20, seed=0, grad_clip=1.0)
    base.update(kw)
    return LearnerSection(**base)


def test_sft_step_lowers_loss_on_fixed_batch(tiny_policy, samples_factory) -> None:
    trainer = PolicyTrainer(str(tiny_policy), _cfg())
    samples = samples_factory(6)
    before = trainer.sft_eval_loss(samples)
    metrics = trainer.sft_step(samples)
    after = trainer.sft_eval_loss(samples)
    assert metrics["loss"] == pytest.approx(before, rel=1e-4)  # the step's loss is the batch loss
    assert after < before - 0.05
    assert metrics["padding_fraction"] == 0.0
    assert metrics["tokens_computed"] == sum(len(s) for s in samples)
    assert np.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert trainer.policy.global_steps == 1


def _grads(trainer: PolicyTrainer, samples, loss_fn) -> dict[str, torch.Tensor]:
    """Gradient of the micro-batched global loss w.r.t. every policy parameter."""
    module = trainer.policy.module
    module.zero_grad(set_to_none=True)
    tokens, seqs = trainer._counts(samples, list(range(len(samples))))
    for micro in trainer._plan(samples, list(range(len(samples)))):
        mb = pack(samples, micro)
        loss, _ = loss_fn(mb, forward_logits(module, mb), tokens, seqs)
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return grads


def _perturb_masked(samples, rng) -> None:
    """Change what loss must ignore: the trailing observation tokens (nothing trained comes
    after them, so they are context for nothing) and every per-token field at masked tokens."""
    for sample in samples:
        masked = sample.loss_mask == 0
        sample.input_ids[-3:] = rng.integers(5, 400, 3)
        for values in sample.fields.values():
            values[masked] = rng.normal(0, 50, int(masked.sum()))


def test_masked_tokens_get_zero_gradient_sft(tiny_policy, samples_factory) -> None:
    trainer = PolicyTrainer(str(tiny_policy), _cfg())
    samples = samples_factory(4)
    base = _grads(trainer, samples, trainer.sft_loss)
    _perturb_masked(samples, np.random.default_rng(3))
    changed = _grads(trainer, samples, trainer.sft_loss)
    for name in base:
        assert torch.equal(base[name], changed[name]), name
    # and a trained token does matter
    samples[0].loss_mask[10] = 0
    assert any(not torch.equal(base[n], g) for n, g in
               _grads(trainer, samples, trainer.sft_loss).items())


def test_masked_tokens_get_zero_gradient_rl(tiny_policy, samples_factory) -> None:
    trainer = PolicyTrainer(str(tiny_policy), _cfg())
    samples = samples_factory(4, with_rl=True)
    trainer.compute_log_probs(samples)
    for s in samples:  # behaviour log-probs slightly off, so ratios are not all 1
        s.set_field("old_logprobs", s.fields["old_logprobs"] - 0.05 * s.loss_mask)
    base = _grads(trainer, samples, trainer.rl_loss)
    _perturb_masked(samples, np.random.default_rng(4))
    changed = _grads(trainer, samples, trainer.rl_loss)
    for name in base:
        assert torch.allclose(base[name], changed[name], atol=1e-7, rtol=0), name


def test_rl_step_lowers_policy_loss(tiny_policy, samples_factory) -> None:
    trainer = PolicyTrainer(str(tiny_policy), _cfg(lr=3e-4))
    samples = samples_factory(6, with_rl=True)
    trainer.compute_log_probs(samples)
    first = trainer.rl_step(samples)
    second = trainer.rl_step(samples)  # same batch, same old log-probs: loss must drop
    assert second["pg_loss"] < first["pg_loss"]
    assert np.isfinite(first["grad_norm"])


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_checkpoint_resume_same_params_and_next_loss(
    tiny_policy, samples_factory, tmp_path, zero_stage
):
    from transformers import AutoModelForCausalLM

    cfg = _cfg(warmup_steps=3, zero_stage=zero_stage)  # the scheduler state must come back too
    batches = [samples_factory(5, seed=s) for s in range(3)]
    run = PolicyTrainer(str(tiny_policy), cfg)
    run.sft_step(batches[0])
    run.sft_step(batches[1])
    path = save_checkpoint(run, tmp_path / "ckpt", TrainerState(step=2, policy_version=2,
                           data_cursor={"epoch": 0, "pos": 2}), tokenizer_from=tiny_policy)
    assert latest_checkpoint(tmp_path / "ckpt") == path
    torch.manual_seed(1234)  # anything after the save must not leak into the resumed run
    uninterrupted = run.sft_step(batches[2])
    params_uninterrupted = run.state_dict_for_export()  # ZeRO-3: shards gathered

    resumed = PolicyTrainer(str(tiny_policy), cfg)
    state = load_checkpoint(resumed, path)
    assert (state.step, state.policy_version, state.data_cursor) == (2, 2, {"epoch": 0, "pos": 2})
    next_step = resumed.sft_step(batches[2])
    assert next_step["loss"] == pytest.approx(uninterrupted["loss"], abs=1e-6)
    assert next_step["lr"] == pytest.approx(uninterrupted["lr"])
    for name, value in resumed.state_dict_for_export().items():
        assert torch.allclose(value, params_uninterrupted[name], atol=1e-6), name

    # The policy directory is a plain HF checkpoint with the weights of step 2.
    hf = AutoModelForCausalLM.from_pretrained(str(path / "policy"))
    fresh = PolicyTrainer(str(path / "policy"), _cfg())
    assert fresh.sft_eval_loss(batches[2]) == pytest.approx(next_step["loss"], abs=1e-5)
    assert (path / "policy" / "tokenizer.json").is_file()
    assert sum(p.numel() for p in hf.parameters()) > 0


def test_kl_loss_and_critic_train(tiny_policy, samples_factory) -> None:
    """GAE set-up: frozen reference for a KL loss term, a critic trained on returns."""
    cfg = _cfg(lr=1e-3, algorithm={"use_kl_loss": True, "kl_loss_coef": 0.1,
                                   "entropy_coeff": 0.01})
    trainer = PolicyTrainer(str(tiny_policy), cfg, use_ref=True, use_critic=True)
    samples = samples_factory(4, with_rl=True)
    trainer.compute_log_probs(samples)
    trainer.compute_log_probs(samples, "ref")
    trainer.compute_values(samples)
    for s in samples:
        assert np.allclose(s.fields["ref_logprobs"], s.fields["old_logprobs"], atol=1e-5)
        s.set_field("returns", s.loss_mask * 2.0)
    first = trainer.rl_step(samples)
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before
    trainer.compute_values(samples)  # the rollout-time values of the next round
    second = trainer.rl_step(samples)
    assert second["critic/vf_loss"] < first["critic/vf_loss"]
    assert second["kl_loss"] > 0.0  # the policy moved away from the frozen reference
