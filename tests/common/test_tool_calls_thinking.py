"""A leading `<think>...</think>` block is reasoning, not an action: the rollout's parser
(`parse_turn`) and the scorer's answer rule (`final_answer`) skip it alike."""

from __future__ import annotations

import pytest

from services.common.tool_calls import (
    ToolCall,
    after_reasoning,
    final_answer,
    parse_turn,
    turn_format,
)
from services.common.tools import tool_specs

SPECS = tool_specs(("search", "calculator"))
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "Brixol"}}\n</tool_call>'


@pytest.mark.parametrize(("text", "rest"), [
    ("<think>x</think>\nA", "\nA"),
    ("\n  <think>\nx\n</think>\n\nA", "\n\nA"),
    ("A <think>x</think> B", "A <think>x</think> B"),  # not leading: kept
    ("<think> never closed <answer> 1 </answer>", "<think> never closed <answer> 1 </answer>"),
    ("no block", "no block"),
])
def test_after_reasoning(text, rest):
    assert after_reasoning(text) == rest


def test_a_call_after_thinking_parses_and_a_draft_answer_in_the_block_is_not_the_answer():
    turn = "<think>\nMaybe <answer> Dunmore </answer>? Search first.\n</think>\n\n" + CALL
    parsed = parse_turn(turn, SPECS)
    assert parsed.action == "tool" and parsed.answer is None
    assert parsed.calls == [ToolCall("search", {"query": "Brixol"}, parsed.calls[0].raw)]
    assert turn_format(turn, SPECS) == "tool"


def test_an_answer_after_thinking_and_a_considered_call_in_the_block():
    turn = f"<think>\nI could call {CALL} but I know it.\n</think>\n\n<answer> Corvale </answer>"
    parsed = parse_turn(turn, SPECS)
    assert (parsed.action, parsed.answer, parsed.calls) == ("answer", "Corvale", [])
    assert turn_format(turn, SPECS) == "answer"
    response = (turn + "<|im_end|>")
    assert final_answer(response) == "Corvale"


def test_final_answer_skips_a_draft_in_the_last_turns_think_block():
    response = ("<think> draft <answer> Dunmore </answer> </think>\n" + CALL + "<|im_end|>\n"
                "<|im_start|>tool\nDoc 1 ...<|im_end|>\n<|im_start|>assistant\n"
                "<think> the passage says <answer> Ashby </answer> </think>\n"
                "<answer> Corvale </answer><|im_end|>")
    assert final_answer(response) == "Corvale"
    # a last turn that only drafted an answer while thinking, then called a tool: no answer
    assert final_answer("<think><answer> Ashby </answer></think>" + CALL) is None
