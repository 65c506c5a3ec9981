"""The learner's GPU settings, checked on CPU with real DeepSpeed and the tiny policy:
bf16 accumulates gradients in fp32, the model is loaded in the training dtype, gradient
checkpointing is on when asked for and changes nothing but memory, packed rows get the right
attention kernel and the same loss as one sequence at a time, and the ZeRO-3 weight export
gathers the model in bounded groups and returns exactly its weights.
"""

from __future__ import annotations

import pytest
import torch

from services.common.config.learner import LearnerSection
from services.learner.attention import SDPA
from services.learner.engine import (
    ds_config,
    effective_zero_stage,
    param_dtype,
    plan_gather_groups,
    use_bf16,
)
from services.learner.packing import pack
from services.learner.trainer import PolicyTrainer


def _cfg(**kw) -> LearnerSection:
    base = dict(lr=1e-3, micro_batch_tokens=160, total_steps=20, seed=0, grad_clip=1.0)
    base.update(kw)
    return LearnerSection(**base)


# ------------------------------------------------------------------ bf16 and the load dtype


def test_ds_config_accumulates_bf16_gradients_in_fp32() -> None:
    config = ds_config(_cfg(zero_stage=0), bf16=True)
    assert config["bf16"] == {"enabled": True}
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    assert config["zero_optimization"]["stage"] == 1  # DeepSpeed 0.19: fp32 accum needs ZeRO
    for stage in (1, 2, 3):
        assert ds_config(_cfg(zero_stage=stage), bf16=True)["zero_optimization"]["stage"] == stage
    plain = ds_config(_cfg(zero_stage=0), bf16=False)
    assert "bf16" not in plain and "data_types" not in plain
    assert plain["zero_optimization"]["stage"] == 0
    assert [effective_zero_stage(s, False) for s in range(4)] == [0, 1, 2, 3]
    assert [effective_zero_stage(s, True) for s in range(4)] == [1, 1, 2, 3]


def test_model_is_loaded_in_the_training_dtype() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert param_dtype(use_bf16("auto", cuda)) == torch.bfloat16
    assert param_dtype(use_bf16("auto", cpu)) == torch.float32
    assert param_dtype(use_bf16("on", cpu)) == torch.bfloat16
    assert param_dtype(use_bf16("off", cuda)) == torch.float32


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_bf16_engine_trains_with_fp32_gradient_accumulation(
    tiny_policy, samples_factory, zero_stage
) -> None:
    """Real DeepSpeed (CPU): bf16 weights from the start, fp32 gradient accumulation over
    several micro-batches, and a finite step."""
    trainer = PolicyTrainer(str(tiny_policy), _cfg(bf16="on", zero_stage=zero_stage))
    engine = trainer.policy.engine
    assert trainer.dtype == torch.bfloat16
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    assert {p.dtype for p in trainer.policy.module.parameters()} == {torch.bfloat16}
    samples = samples_factory(6)
    assert len(trainer._plan(samples, list(range(6)))) > 1  # accumulation happens
    metrics = trainer.sft_step(samples)
    assert torch.isfinite(torch.tensor([metrics["loss"], metrics["grad_norm"]])).all()
    assert metrics["grad_norm"] > 0 and trainer.policy.global_steps == 1


# ------------------------------------------------------------------ gradient checkpointing


def _layer_calls(model: torch.nn.Module) -> list[int]:
    """Count runs of the first layer's MLP `forward` (module hooks do not fire again in the
    recompute, so the method itself is counted)."""
    calls = [0]
    mlp = model.model.layers[0].mlp
    forward = mlp.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    mlp.forward = counted
    return calls


def _loss_and_grads(trainer: PolicyTrainer, samples) -> tuple[float, dict[str, torch.Tensor]]:
    module = trainer.policy.module
    module.train()
    module.zero_grad(set_to_none=True)
    tokens, seqs = trainer._counts(samples, list(range(len(samples))))
    total = 0.0
    for micro in trainer._plan(samples, list(range(len(samples)))):
        mb = pack(samples, micro)
        loss, _ = trainer.sft_loss(mb, trainer._forward(module, mb).logits, tokens, seqs)
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return total, grads


def test_gradient_checkpointing_is_on_and_changes_no_loss_or_gradient(
    tiny_policy, samples_factory
) -> None:
    samples = samples_factory(4)
    plain = PolicyTrainer(str(tiny_policy), _cfg())
    checked = PolicyTrainer(str(tiny_policy), _cfg(), gradient_checkpointing=True)
    assert not any(layer.gradient_checkpointing for layer in plain.policy.module.model.layers)
    assert all(layer.gradient_checkpointing for layer in checked.policy.module.model.layers)
    # It really recomputes: each decoder layer runs again in the backward pass.
    calls = _layer_calls(checked.policy.module)
    loss_checked, grads_checked = _loss_and_grads(checked, samples)
    micro_batches = len(checked._plan(samples, list(range(len(samples)))))
    assert calls[0] == 2 * micro_batches
    calls_plain = _layer_calls(plain.policy.module)
    loss_plain, grads_plain = _loss_and_grads(plain, samples)
    assert calls_plain[0] == micro_batches
    assert loss_checked == pytest.approx(loss_plain, rel=1e-6)
    for name, grad in grads_plain.items():
        assert torch.allclose(grads_checked[name], grad, rtol=1e-5, atol=1e-7), name


# ------------------------------------------------------------------ attention for packed rows


def test_varlen_kwargs_mark_the_sequence_boundaries(samples_factory) -> None:
    samples = samples_factory(3)
    mb = pack(samples, [0, 1, 2])
    kwargs = mb.varlen_kwargs()
    lengths = [len(s) for s in samples]
    expected = [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    assert kwargs["cu_seq_lens_q"].tolist() == expected
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["cu_seq_lens_k"] is kwargs["cu_seq_lens_q"]
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == max(lengths)
    assert mb.seq_starts == expected[:-1]


def test_sdpa_packed_loss_and_gradient_equal_one_sequence_at_a_time(
    tiny_policy, samples_factory
) -> None:
    trainer = PolicyTrainer(str(tiny_policy), _cfg())
    module = trainer.policy.module
    assert trainer.attn_implementation == SDPA
    assert module.config._attn_implementation == SDPA
    samples = samples_factory(3)
    tokens, seqs = trainer._counts(samples, [0, 1, 2])

    def loss_and_grads(groups: list[list[int]]) -> tuple[float, dict[str, torch.Tensor]]:
        module.zero_grad(set_to_none=True)
        total = 0.0
        for indices in groups:
            mb = pack(samples, indices)
            loss, _ = trainer.sft_loss(mb, trainer._forward(module, mb).logits, tokens, seqs)
            loss.backward()
            total += float(loss.detach())
        return total, {n: p.grad.detach().clone() for n, p in module.named_parameters()}

    packed_loss, packed_grads = loss_and_grads([[0, 1, 2]])
    alone_loss, alone_grads = loss_and_grads([[0], [1], [2]])
    assert packed_loss == pytest.approx(alone_loss, rel=1e-5)
    for name, grad in alone_grads.items():
        assert torch.allclose(packed_grads[name], grad, rtol=1e-4, atol=1e-6), name


def test_shared_prompts_give_the_loss_and_gradient_of_one_sequence_at_a_time(
    tiny_policy, group_samples_factory
) -> None:
    """RL loss over GRPO groups packed with each prompt once equals the loss of each sample
    alone, and so does the gradient; the shared rows compute fewer tokens."""
    trainer = PolicyTrainer(str(tiny_policy), _cfg(micro_batch_tokens=4096))
    assert trainer.share_prompts
    module = trainer.policy.module
    samples = group_samples_factory(groups=2, per_group=4, lone=1, with_rl=True)
    indices = list(range(len(samples)))
    tokens, seqs = trainer._counts(samples, indices)

    def loss_and_grads(groups: list[list[int]], share: bool):
        module.zero_grad(set_to_none=True)
        total, computed = 0.0, 0
        for micro in groups:
            mb = pack(samples, micro, share_prompts=share)
            computed += mb.num_tokens
            loss, _ = trainer.rl_loss(mb, trainer._forward(module, mb).logits, tokens, seqs)
            loss.backward()
            total += float(loss.detach())
        return total, computed, {n: p.grad.detach().clone() for n, p in module.named_parameters()}

    shared_loss, shared_tokens, shared_grads = loss_and_grads(trainer._plan(samples, indices),
                                                              True)
    alone_loss, alone_tokens, alone_grads = loss_and_grads([[i] for i in indices], False)
    assert shared_loss == pytest.approx(alone_loss, rel=1e-5)
    for name, grad in alone_grads.items():
        assert torch.allclose(shared_grads[name], grad, rtol=1e-4, atol=1e-6), name
    assert shared_tokens < 0.7 * alone_tokens
    # The trainer's own step reports the smaller count, and the flash path never shares.
    assert trainer.rl_step(samples)["tokens_computed"] == shared_tokens
    assert not PolicyTrainer(str(tiny_policy), _cfg(shared_prompts=False)).share_prompts


# ------------------------------------------------------------------ ZeRO-3 weight export


def test_plan_gather_groups_bounds_each_group() -> None:
    assert plan_gather_groups([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert plan_gather_groups([4, 20, 4], 8) == [[0], [1], [2]]  # too big: alone
    assert plan_gather_groups([1, 2, 3], 100) == [[0, 1, 2]]
    assert plan_gather_groups([], 8) == []


def test_zero3_export_gathers_in_groups_and_equals_the_model(tiny_policy, samples_factory):
    import deepspeed

    trainer = PolicyTrainer(str(tiny_policy), _cfg(zero_stage=3))
    trainer.sft_step(samples_factory(4))  # weights now differ from the files on disk
    engine = trainer.policy
    module = engine.module
    # The reference: the whole model gathered at once (what the export used to do).
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        reference = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    layer_bytes = sum(p.ds_numel * p.element_size()
                      for p in module.model.layers[0].parameters())
    engine.export_group_bytes = layer_bytes  # about one decoder layer per gather
    exported = trainer.state_dict_for_export()
    assert engine.export_groups >= len(module.model.layers)
    assert list(exported) == list(reference)  # same keys (tied lm_head too), same order
    for name, tensor in reference.items():
        assert tensor.numel() > 0, name
        assert torch.equal(exported[name], tensor), name
    # After the export every parameter is partitioned again (nothing left gathered).
    assert all(p.ds_status.name == "NOT_AVAILABLE" for p in module.parameters())
    # The default bound gathers a model this small in one group.
    engine.export_group_bytes = 1 << 30
    assert trainer.state_dict_for_export().keys() == reference.keys()
    assert engine.export_groups == 1
