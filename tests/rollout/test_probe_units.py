"""Probe helpers: reasoning span, cut points, suffix choice (pure functions)."""

from __future__ import annotations

from services.common.formats import PROBE_SUFFIX_BOXED, PROBE_SUFFIX_TAGGED
from services.rollout.probe import (
    answer_marker,
    cut_points,
    probe_prompts,
    probe_suffix,
    reasoning_length,
)


def test_cut_points_round_half_up_and_cover_both_ends():
    assert cut_points(10, 5) == [0, 2, 4, 6, 8, 10]
    assert cut_points(5, 2) == [0, 3, 5]  # 2.5 rounds up
    assert cut_points(0, 4) == [0] * 5


def test_suffix_by_task_and_override():
    assert probe_suffix("nq") == PROBE_SUFFIX_TAGGED
    assert probe_suffix("openai/gsm8k") == PROBE_SUFFIX_BOXED
    assert probe_suffix("countdown") == PROBE_SUFFIX_TAGGED
    assert probe_suffix("gsm8k", "X") == "X"
    assert answer_marker(PROBE_SUFFIX_BOXED) == "\\boxed{"


def test_reasoning_length_stops_before_the_last_marker(engine):
    tok = engine.tokenizer
    before = "<think> 3 + 4 = 7 </think> <answer> 6 </answer> wait <think> again </think> "
    ids = tok.encode(before + "<answer> 7 </answer>", add_special_tokens=False)
    length = reasoning_length(tok, ids, "<answer>")
    assert tok.decode(ids[:length]) == before
    boxed = tok.encode("so it is 7. The answer is \\boxed{7}.", add_special_tokens=False)
    cut = reasoning_length(tok, boxed, "\\boxed{")
    assert tok.decode(boxed[:cut]).rstrip().endswith("The answer is")
    none = tok.encode("no marker here", add_special_tokens=False)
    assert reasoning_length(tok, none, "<answer>") == len(none)


def test_probe_prompts_are_prompt_plus_prefix_plus_suffix():
    prompts = probe_prompts([1, 2], [10, 11, 12, 13], 4, 2, [99])
    assert prompts == [[1, 2, 99], [1, 2, 10, 11, 99], [1, 2, 10, 11, 12, 13, 99]]
