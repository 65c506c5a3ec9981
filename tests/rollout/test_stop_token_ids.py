"""A chat template's end of turn that is not the model's EOS (`<|im_end|>` with a base model's
tokenizer, whose EOS is `<|endoftext|>`): the tool_calls turn must stop on its token id, not
only on a stop string. vLLM matches stop strings on text decoded without special tokens, where
`<|im_end|>` never shows, so `SamplingParams.stop_token_ids` carries it to vLLM
(`vllm_engine.sampling_kwargs`, tested without vLLM) and the transformers engine stops on it
as on EOS. The tiny policy plays the base model: its engine's EOS ids are set to
`<|endoftext|>` only."""

from __future__ import annotations

import json

from services.common.tool_calls import TOOL_CORRECTIVE_MESSAGE
from services.common.trajectory import PromptGroup
from services.rollout.agent import AgentLoop, LoopSettings
from services.rollout.engine import GenerationRequest, SamplingParams, run_to_completion
from services.rollout.vllm_engine import map_completion, sampling_kwargs

from .test_agent import spans

CALC = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1907 - 1900"}}\n'
        "</tool_call>")


def test_sampling_kwargs_carry_stop_token_ids_to_vllm():
    plain = sampling_kwargs(SamplingParams(temperature=0.5, top_k=0, stop=("</answer>",)))
    assert "stop_token_ids" not in plain and plain["top_k"] == -1
    assert plain["stop"] == ["</answer>"] and plain["include_stop_str_in_output"] is True
    kwargs = sampling_kwargs(SamplingParams(stop=("</tool_call>", "<|im_end|>"),
                                            stop_token_ids=(7, 3, 7)))
    assert kwargs["stop_token_ids"] == [3, 7]
    assert kwargs["stop"] == ["</tool_call>", "<|im_end|>"]
    assert json.dumps(kwargs)  # plain values only
    # vLLM reports a stop token id as finish "stop" with the id as stop_reason: EOS for Forage
    assert map_completion("stop", 3, [5, 3], [{5: -0.1}, {3: -0.2}]).cause == "eos"


def base_model_engine(engine):
    tok = engine.tokenizer
    end, eos = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    engine.eos_ids = frozenset({eos})  # a base model: <|im_end|> is not its EOS
    return end, eos


def test_transformers_engine_stops_on_a_stop_token_id(engine):
    end, _ = base_model_engine(engine)
    tok = engine.tokenizer
    tail = tok.encode(" text the policy never gets to write", add_special_tokens=False)
    forced = tok.encode("It is 7.", add_special_tokens=False) + [end] + tail
    engine.forced_tokens = lambda request: forced
    try:
        free, stopped = run_to_completion(engine, [
            GenerationRequest([1, 5, 6], SamplingParams(max_tokens=len(forced))),
            GenerationRequest([1, 5, 6], SamplingParams(max_tokens=len(forced),
                                                        stop_token_ids=(end,)))])
    finally:
        engine.forced_tokens = None
    assert free.finish == "length" and free.token_ids == forced  # not EOS: runs on
    assert stopped.finish == "eos" and stopped.token_ids[-1] == end
    assert stopped.token_ids == forced[: forced.index(end) + 1]


def test_tool_turns_stop_on_the_end_of_turn_id_and_never_insert_it_twice(engine):
    end, eos = base_model_engine(engine)
    tok = engine.tokenizer
    turns = [CALC + "<|im_end|> and more", "It is 7.<|im_end|> and more after the end of turn",
             "<answer> 7 </answer><|im_end|>"]
    encoded = [tok.encode(t, add_special_tokens=False) for t in turns]
    seen, step = [], engine.step

    def recorded():
        outputs = step()
        seen.extend((list(o.token_ids), o.finish) for o in outputs if o.request.tag[0] == "turn")
        return outputs

    engine.step = recorded
    engine.forced_tokens = lambda request: encoded[min(len(request.tag[1].turns), 2)]
    loop = AgentLoop(engine, LoopSettings(protocol="tool_calls", tools=("calculator",),
                                          max_turns=4, max_tokens_per_turn=150))
    try:
        params, _ = loop._group_params(PromptGroup(uid="g", data_source="nq", prompt="q",
                                                   ground_truth="7"))
        assert params.stop_token_ids == (end,) and "<|im_end|>" in params.stop
        assert sampling_kwargs(params)["stop_token_ids"] == [end]
        assert loop.tool_stop_ids == (end,) and eos not in loop.tool_stop_ids
        [traj] = loop.run([PromptGroup(uid="t", data_source="nq", ground_truth="7",
                                       prompt="What is 1907 - 1900?")])
    finally:
        loop.close()
        engine.forced_tokens = None
        del engine.step
    assert traj.finish_reason == "answer" and [t.action for t in traj.turns] == [
        "tool", "invalid", "answer"]
    # every turn ended on <|im_end|> (finish eos), nothing after it
    assert [finish for _, finish in seen] == ["eos", "eos", "eos"]
    assert seen[1][0][-1] == end and tok.decode(seen[1][0]) == "It is 7.<|im_end|>"
    response = traj.response_ids.tolist()
    inserted = [tok.decode(response[a:b]) for a, b in spans(traj.loss_mask, 0)]
    assert inserted == [
        "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\n" + TOOL_CORRECTIVE_MESSAGE + "<|im_end|>\n<|im_start|>assistant\n"]
    assert "<|im_end|><|im_end|>" not in tok.decode(response)


def test_tags_protocol_has_no_stop_token_ids(engine):
    loop = AgentLoop(engine, LoopSettings())
    try:
        params, _ = loop._group_params(PromptGroup(uid="g", data_source="nq", prompt="q",
                                                   ground_truth="x"))
        assert params.stop_token_ids == () and loop.tool_stop_ids == ()
    finally:
        loop.close()
