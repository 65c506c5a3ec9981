"""Attention kernels for packed rows (services/learner/attention.py).

What is checked here, on CPU:
  - the choice: auto takes flash, then flex, then sdpa, from the availability passed in; a
    named kernel the machine cannot train with stops with an error that says why;
  - the FlexAttention masks are the SDPA masks: a shared row's `kv_reach` rule equals its dense
    tree mask on many tree layouts, and the block masks (ours for shared rows, transformers'
    for plain rows) allow exactly the dense mask's pairs and visit every tile that holds one,
    in the forward (kv-major) and backward (q-major) block lists;
  - a model through transformers' flex_attention (compiled by inductor for CPU, forward only)
    gives the per-token log-probs of the SDPA dense-mask path on a packed row of 3 documents
    and on a shared-prefix row.
Gradients through flex cannot be computed on CPU: torch refuses the backward there
(`test_torch_refuses_flex_backward_on_cpu` keeps that premise visible). The gradient on a GPU
rests on the masks above being identical, tile lists included, and on torch's kernel.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from services.common.config.learner import LearnerSection
from services.learner.attention import (
    FLASH_ATTENTION,
    FLEX_ATTENTION,
    SDPA,
    AttentionUnavailable,
    choose_attention,
    flex_installed,
    forward_kwargs,
    prefix_block_mask,
)
from services.learner.logprobs import forward_logits, token_logprobs
from services.learner.packing import MicroBatch, Sample, pack
from tests.suite_rules import MISSING_PACKAGE

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

needs_flex = pytest.mark.skipif(not flex_installed("cpu"), reason=f"{MISSING_PACKAGE} torch or "
                                "transformers has no FlexAttention (make install's have it)")


# ----------------------------------------------------------------------------- the choice


@pytest.mark.parametrize(
    ("device", "dtype", "flash", "flex", "expected"),
    [
        ("cuda", BF16, True, True, FLASH_ATTENTION),
        ("cuda", FP16, True, False, FLASH_ATTENTION),
        ("cuda", FP32, True, True, FLEX_ATTENTION),  # flash-attn: half precision only
        ("cuda", BF16, False, True, FLEX_ATTENTION),
        ("cuda", BF16, False, False, SDPA),
        ("cuda", FP32, True, False, SDPA),
        ("cpu", BF16, True, True, SDPA),  # neither trains on CPU
        ("cpu", FP32, False, True, SDPA),
    ],
)
def test_auto_prefers_flash_then_flex_then_sdpa(device, dtype, flash, flex, expected) -> None:
    choice = choose_attention("auto", device, dtype, flash_installed=flash, flex_installed=flex)
    assert choice.implementation == expected
    assert choice.reason.startswith("auto")


def test_auto_says_what_it_skipped_and_why() -> None:
    flex = choose_attention("auto", "cuda", BF16, flash_installed=False, flex_installed=True)
    assert flex.reason == ("auto; no flash: the flash_attn package is not installed "
                           "(pip install flash-attn --no-build-isolation)")
    cpu = choose_attention("auto", "cpu", FP32, flash_installed=False, flex_installed=True)
    assert "no flash:" in cpu.reason and "no flex: FlexAttention has no backward pass on cpu" \
        in cpu.reason
    first = choose_attention("auto", "cuda", BF16, flash_installed=True, flex_installed=True)
    assert first.reason == "auto"


def test_a_named_kernel_that_can_run_is_used() -> None:
    kinds = {"flash": ("cuda", BF16), "flex": ("cuda", FP32), "sdpa": ("cpu", FP32)}
    for name, (device, dtype) in kinds.items():
        choice = choose_attention(name, device, dtype, flash_installed=True, flex_installed=True)
        assert choice.reason == f"learner.attention={name}"
    # sdpa when asked for, even where flash and flex could run.
    sdpa = choose_attention("sdpa", "cuda", BF16, flash_installed=True, flex_installed=True)
    assert sdpa.implementation == SDPA


@pytest.mark.parametrize(
    ("requested", "device", "dtype", "flash", "flex", "why"),
    [
        ("flash", "cuda", BF16, False, True, "the flash_attn package is not installed"),
        ("flash", "cpu", BF16, True, True, "flash-attn runs only on CUDA (device: cpu)"),
        ("flash", "cuda", FP32, True, True, "flash-attn needs bf16/fp16 weights"),
        ("flex", "cuda", BF16, True, False, "this torch/transformers has no FlexAttention"),
        ("flex", "cpu", FP32, True, True, "FlexAttention has no backward pass on cpu"),
    ],
)
def test_a_named_kernel_that_cannot_run_stops_with_the_reason(
    requested, device, dtype, flash, flex, why
) -> None:
    with pytest.raises(AttentionUnavailable) as error:
        choose_attention(requested, device, dtype, flash_installed=flash, flex_installed=flex)
    message = str(error.value)
    assert message.startswith(f"learner.attention={requested} is unavailable: {why}")
    assert "learner.attention=auto" in message


def test_unknown_kernel_names_are_rejected() -> None:
    assert LearnerSection().attention == "auto"
    assert LearnerSection(attention="flex").attention == "flex"
    with pytest.raises(ValidationError):
        LearnerSection(attention="xformers")
    with pytest.raises(ValueError, match="auto, flash, flex or sdpa"):
        choose_attention("xformers", "cuda", BF16, flash_installed=True, flex_installed=True)


def test_what_each_choice_implies_for_packing() -> None:
    flash = choose_attention("flash", "cuda", BF16, flash_installed=True, flex_installed=True)
    flex = choose_attention("flex", "cuda", BF16, flash_installed=True, flex_installed=True)
    sdpa = choose_attention("sdpa", "cuda", BF16, flash_installed=True, flex_installed=True)
    assert (flash.shares_prompts, flex.shares_prompts, sdpa.shares_prompts) == (False, True, True)
    assert (flash.dense_mask, flex.dense_mask, sdpa.dense_mask) == (False, False, True)


@needs_flex
def test_torch_refuses_flex_backward_on_cpu() -> None:
    """Why flex is never chosen on CPU. If a torch release lifts this, this test fails: then
    attention.flex_problem may allow CPU and the model tests below may compare gradients."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 1, 8, 4, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, q, q)


def test_the_trainer_fails_fast_and_logs_its_kernel(tiny_policy, caplog) -> None:
    from services.learner.trainer import PolicyTrainer

    for name in ("flash", "flex"):  # neither can train on this CPU
        with pytest.raises(AttentionUnavailable, match=f"learner.attention={name} is unavail"):
            PolicyTrainer(str(tiny_policy), LearnerSection(attention=name))
    with caplog.at_level(logging.INFO, logger="forage.learner.trainer"):
        trainer = PolicyTrainer(str(tiny_policy), LearnerSection(attention="sdpa"))
    assert trainer.attn_implementation == SDPA
    assert trainer.policy.module.config._attn_implementation == SDPA
    assert "attention sdpa (learner.attention=sdpa)" in caplog.text


# ----------------------------------------------------------------------------- the masks


def _nested_prompt_samples(seed: int) -> list[Sample]:
    """Samples whose prompts share prefixes at several depths: an instruction, then one of a few
    task heads, then a group prompt repeated by a few samples, some prompts a strict prefix
    of others (so a branch leaves the tree midway), and a lone sample."""
    rng = np.random.default_rng(seed)
    instruction = rng.integers(5, 400, int(rng.integers(3, 12)))
    heads = [rng.integers(5, 400, int(rng.integers(1, 8))) for _ in range(int(rng.integers(1, 4)))]
    samples = []
    for group in range(int(rng.integers(2, 6))):
        head = heads[int(rng.integers(len(heads)))]
        prompt = np.concatenate([instruction, head, rng.integers(5, 400, int(rng.integers(1, 9)))])
        if group % 3 == 2:  # a prompt that is the start of the previous group's
            prompt = samples[-1].input_ids[: max(2, samples[-1].prompt_len - 3)]
        for _ in range(int(rng.integers(1, 5))):
            response = rng.integers(5, 400, int(rng.integers(2, 20)))
            ids = np.concatenate([prompt, response])
            mask = np.concatenate([np.zeros(len(prompt)), np.ones(len(response))])
            samples.append(Sample(ids, mask, prompt_len=len(prompt), uid=f"g{group}"))
    samples.append(Sample(rng.integers(5, 400, 17), np.ones(17), prompt_len=5, uid="lone"))
    order = rng.permutation(len(samples))
    return [samples[i] for i in order]


def _reach_mask(kv_reach: torch.Tensor) -> torch.Tensor:
    """(N, N) bool from the O(N) rule: q sees k iff k <= q < reach[k]."""
    reach = kv_reach.reshape(-1).long()
    q = torch.arange(len(reach))[:, None]
    k = torch.arange(len(reach))[None, :]
    return (k <= q) & (q < reach[None, :])


def _documents_mask(mb: MicroBatch) -> torch.Tensor:
    """(N, N) bool: the block-diagonal causal mask SDPA gets for a plain row."""
    n = mb.num_tokens
    doc = torch.zeros(n, dtype=torch.long)
    for number, (start, length) in enumerate(zip(mb.seq_starts, mb.seq_lens, strict=True)):
        doc[start : start + length] = number
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    return (k <= q) & (doc[:, None] == doc[None, :])


def test_kv_reach_is_the_dense_tree_mask(group_samples_factory) -> None:
    layouts = [_nested_prompt_samples(seed) for seed in range(40)]
    layouts += [group_samples_factory(groups=g, per_group=p, lone=lone, seed=g + p)
                for g, p, lone in [(1, 2, 0), (2, 3, 1), (3, 5, 2), (1, 1, 3)]]
    shared_rows = 0
    for samples in layouts:
        indices = list(range(len(samples)))
        mb = pack(samples, indices, share_prompts=True)
        if not mb.is_shared:
            assert mb.kv_reach is None
            continue
        shared_rows += 1
        assert mb.kv_reach.dtype == torch.int32 and mb.kv_reach.shape == (1, mb.num_tokens)
        assert torch.equal(_reach_mask(mb.kv_reach), mb.attention_mask[0, 0])
        # Without the dense mask: the same row and the same reach, and SDPA cannot be fed it.
        light = pack(samples, indices, share_prompts=True, dense_mask=False)
        assert light.attention_mask is None and torch.equal(light.kv_reach, mb.kv_reach)
        assert torch.equal(light.input_ids, mb.input_ids)
        with pytest.raises(ValueError, match="without its dense mask"):
            light.mask_kwargs()
    assert shared_rows >= 35
    plain = pack(layouts[0], [0, 1, 2])
    assert plain.kv_reach is None and plain.attention_mask is None


def _tiles(num_blocks: torch.Tensor, indices: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(rows, cols) bool of the tiles a BlockMask block list visits (batch 0, head 0)."""
    out = torch.zeros(rows, cols, dtype=torch.bool)
    for row in range(rows):
        out[row, indices[0, 0, row, : int(num_blocks[0, 0, row])].long()] = True
    return out


def _assert_block_mask_is(block_mask, dense: torch.Tensor) -> None:
    """`block_mask` allows exactly `dense`'s pairs, visits every tile holding one (partial
    tiles with the mask applied, full tiles only where every pair is allowed), and its
    q-major lists (the backward's) are the transposes of its kv-major ones."""
    from torch.nn.attention.flex_attention import create_mask

    n = dense.shape[0]
    assert block_mask.seq_lengths == (n, n)
    assert torch.equal(create_mask(block_mask.mask_mod, 1, 1, n, n)[0, 0], dense)
    size_q, size_kv = block_mask.BLOCK_SIZE
    rows, cols = -(-n // size_q), -(-n // size_kv)
    padded = torch.zeros(rows * size_q, cols * size_kv, dtype=torch.bool)
    padded[:n, :n] = dense
    tiles = padded.reshape(rows, size_q, cols, size_kv).transpose(1, 2)
    some, every = tiles.any(-1).any(-1), tiles.all(-1).all(-1)
    partial = _tiles(block_mask.kv_num_blocks, block_mask.kv_indices, rows, cols)
    full = _tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, rows, cols)
    assert not (partial & full).any()
    assert torch.equal(partial | full, some)  # no allowed pair is skipped, no empty tile run
    assert not (full & ~every).any()  # a full tile skips the mask: it must hold no masked pair
    assert torch.equal(_tiles(block_mask.q_num_blocks, block_mask.q_indices, cols, rows),
                       partial.T)
    assert torch.equal(_tiles(block_mask.full_q_num_blocks, block_mask.full_q_indices, cols, rows),
                       full.T)


def _long_shared_row(group_samples_factory) -> MicroBatch:
    """A shared row of several 128-token tiles: one long GRPO group (a 150-token prompt), two
    ordinary groups and lone samples."""
    samples = group_samples_factory(groups=2, per_group=4, lone=2, seed=3)
    rng = np.random.default_rng(7)
    prompt = rng.integers(5, 400, 150)
    for length in (40, 120, 9):
        response = rng.integers(5, 400, length)
        samples.append(Sample(np.concatenate([prompt, response]),
                              np.concatenate([np.zeros(150), np.ones(length)]), prompt_len=150))
    mb = pack(samples, list(range(len(samples))), share_prompts=True)
    assert mb.is_shared and mb.num_tokens > 3 * 128
    return mb


@needs_flex
def test_shared_row_block_mask_is_the_dense_tree_mask(group_samples_factory) -> None:
    mb = _long_shared_row(group_samples_factory)
    _assert_block_mask_is(prefix_block_mask(mb.kv_reach), mb.attention_mask[0, 0])
    for seed in range(6):
        samples = _nested_prompt_samples(100 + seed)
        row = pack(samples, list(range(len(samples))), share_prompts=True)
        if row.is_shared:
            _assert_block_mask_is(prefix_block_mask(row.kv_reach), row.attention_mask[0, 0])


def _tiny_config(attn_implementation: str):
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=400, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024)
    config._attn_implementation = attn_implementation
    return config


def _documents(lengths: list[int], seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [Sample(rng.integers(5, 400, n), np.ones(n), prompt_len=4) for n in lengths]


@needs_flex
@pytest.mark.slow  # inductor compiles create_block_mask for CPU: ~14 s cold, ~7 s cached
def test_the_compiled_block_mask_builder_gives_the_same_mask(group_samples_factory) -> None:
    """On CUDA the shared row's block mask comes from the compiled create_block_mask; the
    same builder, compiled for CPU here, gives the dense tree mask too."""
    mb = _long_shared_row(group_samples_factory)
    _assert_block_mask_is(prefix_block_mask(mb.kv_reach, compiled=True), mb.attention_mask[0, 0])


@needs_flex
@pytest.mark.slow  # inductor compiles the CPU kernels: ~7-17 s cold, ~6 s cached
def test_transformers_builds_the_documents_block_mask_from_position_ids() -> None:
    """Plain rows on the flex path carry no mask: transformers' masking_utils detects the
    position-id restarts and builds the block mask. That mask is SDPA's block-diagonal one."""
    from transformers.masking_utils import create_causal_mask

    mb = pack(_documents([150, 40, 197]), [0, 1, 2])
    config = _tiny_config(FLEX_ATTENTION)
    block_mask = create_causal_mask(config, torch.zeros(1, mb.num_tokens, 64), None, None,
                                    position_ids=mb.position_ids)
    _assert_block_mask_is(block_mask, _documents_mask(mb))


# ------------------------------------------------------------------ a model through both paths


@pytest.fixture(scope="module")
def sdpa_and_flex_models():
    """One tiny Qwen2, twice: through SDPA and through transformers' flex_attention."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    sdpa = Qwen2ForCausalLM(_tiny_config(SDPA)).eval()
    flex = Qwen2ForCausalLM(_tiny_config(FLEX_ATTENTION)).eval()
    flex.load_state_dict(sdpa.state_dict())
    assert flex.config._attn_implementation == FLEX_ATTENTION
    return sdpa, flex


@needs_flex
@pytest.mark.slow  # inductor compiles the CPU kernels: ~7-17 s cold, ~6 s cached
def test_flex_logprobs_equal_sdpa_on_packed_rows(sdpa_and_flex_models,
                                                 group_samples_factory) -> None:
    """Per-token log-probs over a whole packed row, flex (inductor's CPU kernel, forward only)
    against SDPA's dense mask: a plain row of 3 documents of different lengths and a shared
    row; both rows have the same length, so the flex kernel compiles once."""
    sdpa, flex = sdpa_and_flex_models
    shared = _long_shared_row(group_samples_factory)
    n = shared.num_tokens
    plain = pack(_documents([150, 40, n - 190]), [0, 1, 2])
    light = dataclasses.replace(shared, attention_mask=None)  # as the flex path packs it
    with torch.no_grad():
        for dense_row, flex_row in ((plain, plain), (shared, light)):
            want = token_logprobs(forward_logits(sdpa, dense_row), dense_row.input_ids)
            got = token_logprobs(forward_logits(flex, flex_row), flex_row.input_ids)
            assert torch.allclose(got, want, atol=2e-5, rtol=0), (got - want).abs().max()
        # And the test can fail: one causal mask over the whole shared row (no tree) differs.
        wrong = dataclasses.replace(light, kv_reach=torch.full_like(light.kv_reach, n))
        want = token_logprobs(forward_logits(sdpa, shared), shared.input_ids)
        got = token_logprobs(forward_logits(flex, wrong), wrong.input_ids)
        assert (got - want).abs().max() > 1e-3


def test_forward_kwargs_per_kernel(group_samples_factory) -> None:
    samples = group_samples_factory(groups=1, per_group=3, lone=1)
    indices = list(range(len(samples)))
    shared = pack(samples, indices, share_prompts=True)
    plain = pack(samples, indices)
    assert forward_kwargs(SDPA, shared)["attention_mask"] is shared.attention_mask
    assert forward_kwargs(SDPA, plain) == {}
    assert forward_kwargs(FLEX_ATTENTION, plain) == {}  # transformers reads the position ids
    assert set(forward_kwargs(FLASH_ATTENTION, plain)) == {
        "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    with pytest.raises(ValueError, match="share_prompts"):
        forward_kwargs(FLASH_ATTENTION, shared)
    if flex_installed("cpu"):
        from torch.nn.attention.flex_attention import BlockMask

        mask = forward_kwargs(FLEX_ATTENTION, shared)["attention_mask"]
        assert isinstance(mask, BlockMask) and mask.seq_lengths == (shared.num_tokens,) * 2
