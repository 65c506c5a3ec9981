"""Thinking blocks in `rollout.protocol: tool_calls` with a Qwen3-style chat template, written
into a copy of the tiny policy's tokenizer directory.

Qwen3's template renders an assistant message by its position: the last one (and any after
the last user query that has reasoning) opens with `<think>\\n...\\n</think>\\n\\n`, earlier
ones lose their reasoning. So rendering "prompt + assistant" and "prompt + assistant + tool"
disagree on the assistant turn itself, which the loop never renders into the ids: what must
hold is that the ids trained on are the generated tokens (think blocks as generated) plus the
template's tool-turn tokens, and that `<think>...</think>` before a call or an answer parses
(a draft answer inside the block is not the answer)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.common.tool_calls import TOOL_CORRECTIVE_MESSAGE, final_answer
from services.common.tools import tool_specs
from services.common.trajectory import PromptGroup
from services.rollout.agent import AgentLoop, LoopSettings
from services.rollout.tools import PLACEHOLDER, ChatTurns
from tests.rollout.scripted_turns import record_generated_turns

from .test_agent import spans

# Qwen3's chat template (tools, the last-query scan, reasoning split and placement, tool
# responses in a user turn), without its multimodal and tool_calls-field branches.
QWEN3_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
# The same template in non-thinking mode: every generation prompt holds an empty think block.
QWEN3_NO_THINK = QWEN3_TEMPLATE.replace(
    "{%- if enable_thinking is defined and enable_thinking is false %}", "{%- if true %}")

QUESTION = [{"role": "user", "content": "How many years after 1900 is 1907, doubled?"}]
TOOLS = ("calculator",)


def calc(expression: str) -> str:
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{body}\n</tool_call>"


@pytest.fixture(scope="module")
def qwen3_dirs(tiny_policy_dir, tmp_path_factory):
    """Copies of the tiny policy whose tokenizer carries the Qwen3-style template (thinking,
    and non-thinking)."""
    from transformers import AutoTokenizer

    out = {}
    for name, template in (("think", QWEN3_TEMPLATE), ("no_think", QWEN3_NO_THINK)):
        target = tmp_path_factory.mktemp(f"qwen3-{name}") / "policy"
        shutil.copytree(tiny_policy_dir, target)
        tok = AutoTokenizer.from_pretrained(str(target))
        tok.chat_template = template
        tok.save_pretrained(str(target))
        out[name] = target
    return out


def load(path):
    from services.rollout.transformers_engine import TransformersEngine

    torch.set_num_threads(1)
    return TransformersEngine.from_pretrained(str(path), max_batch_size=2, seed=0)


def play(engine, turns: list[str]):
    """Force the policy's turns, each ending on <|im_end|>; returns the trajectory and each
    turn's generated ids."""
    tok = engine.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    encoded = [tok.encode(t, add_special_tokens=False) + [eos] for t in turns]
    engine.forced_tokens = lambda r: encoded[min(len(r.tag[1].turns), len(encoded) - 1)]
    seen = record_generated_turns(engine)
    loop = AgentLoop(engine, LoopSettings(protocol="tool_calls", tools=TOOLS,
                                          max_tokens_per_turn=200))
    try:
        [traj] = loop.run([PromptGroup(uid="q", data_source="nq", ground_truth="14",
                                       prompt=QUESTION)])
    finally:
        loop.close()
        engine.forced_tokens = None
        del engine.step
    return traj, seen


TOOL_TURN = ("\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n")


def test_think_blocks_with_a_qwen3_template(qwen3_dirs):
    engine = load(qwen3_dirs["think"])
    tok = engine.tokenizer
    chat = ChatTurns(tok, tool_specs(TOOLS))
    # why the assistant turn itself is never rendered: the template opens the last assistant
    # message with an empty think block, and an earlier one without
    alone = chat.render([*QUESTION, {"role": "assistant", "content": PLACEHOLDER}], False)
    followed = chat.render([*QUESTION, {"role": "assistant", "content": PLACEHOLDER},
                            {"role": "tool", "content": "7"}], True)
    assert f"<think>\n\n</think>\n\n{PLACEHOLDER}" in alone
    assert f"<|im_start|>assistant\n{PLACEHOLDER}" in followed and not followed.startswith(alone)

    turns = ["<think>\nFirst the difference.\n</think>\n\n" + calc("1907 - 1900"),
             "<think>\nIt is 7, so <answer> 7 </answer>? No: doubled.\n</think>\n\n" + calc("7 * 2"),
             "<think>\nA draft said <tool_call> here; done.\n</think>\n\n<answer> 14 </answer>"]
    traj, seen = play(engine, turns)
    assert traj.finish_reason == "answer" and traj.error is None
    assert [(t.action, t.query) for t in traj.turns] == [
        ("tool", calc("1907 - 1900").split("\n")[1]), ("tool", calc("7 * 2").split("\n")[1]),
        ("answer", "14")]
    assert [tok.decode(s) for s in seen] == [t + "<|im_end|>" for t in turns]
    response = traj.response_ids.tolist()
    inserted = [response[a:b] for a, b in spans(traj.loss_mask, 0)]
    # trained ids = generated ids (think blocks as generated) + the template's tool turns
    assert response == seen[0] + inserted[0] + seen[1] + inserted[1] + seen[2]
    assert [response[a:b] for a, b in spans(traj.loss_mask, 1)] == seen
    assert inserted == [tok.encode(TOOL_TURN.format(r), add_special_tokens=False)
                        for r in ("7", "14")]
    assert traj.prompt_ids.tolist() == tok.encode(
        tok.apply_chat_template(QUESTION, tools=[s.schema() for s in tool_specs(TOOLS)],
                                add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)
    whole = tok.decode(response, skip_special_tokens=False)
    assert "It is 7, so <answer> 7 </answer>? No: doubled." in whole  # kept as generated
    assert final_answer(whole) == "14"  # the scorer's reading: not the draft in the block


def test_corrective_turn_keeps_the_earlier_reasoning_as_generated(qwen3_dirs):
    engine = load(qwen3_dirs["think"])
    tok = engine.tokenizer
    turns = ["<think>\nhmm, I know this\n</think>\n\nIt is 14.",
             "<think>\nright format\n</think>\n\n<answer> 14 </answer>"]
    traj, seen = play(engine, turns)
    assert [t.action for t in traj.turns] == ["invalid", "answer"]
    response = traj.response_ids.tolist()
    [inserted] = [response[a:b] for a, b in spans(traj.loss_mask, 0)]
    # the turn ended on <|im_end|> itself: only the rest of the closer, the user turn and the
    # next header are inserted
    assert inserted == tok.encode("\n<|im_start|>user\n" + TOOL_CORRECTIVE_MESSAGE
                                  + "<|im_end|>\n<|im_start|>assistant\n",
                                  add_special_tokens=False)
    assert response == seen[0] + inserted + seen[1]
    # Re-rendered, the template would drop the first turn's reasoning (it precedes the last
    # user message); the trained tokens keep what the policy saw and wrote.
    rendered = tok.apply_chat_template(
        [*QUESTION, {"role": "assistant", "content": turns[0]},
         {"role": "user", "content": TOOL_CORRECTIVE_MESSAGE},
         {"role": "assistant", "content": turns[1]}],
        tools=[s.schema() for s in tool_specs(TOOLS)], tokenize=False)
    assert "hmm, I know this" not in rendered
    assert "hmm, I know this" in tok.decode(response)


def test_non_thinking_template_empty_think_in_every_header(qwen3_dirs):
    engine = load(qwen3_dirs["no_think"])
    tok = engine.tokenizer
    traj, seen = play(engine, [calc("1907 - 1900"), "<answer> 7 </answer>"])
    assert tok.decode(traj.prompt_ids.tolist()).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    response = traj.response_ids.tolist()
    [inserted] = [response[a:b] for a, b in spans(traj.loss_mask, 0)]
    assert tok.decode(inserted) == TOOL_TURN.format("7") + "<think>\n\n</think>\n\n"
    assert response == seen[0] + inserted + seen[1]
    assert [t.action for t in traj.turns] == ["tool", "answer"]
