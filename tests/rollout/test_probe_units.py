"""Probe reasoning spans per task (docs/probe.md) on real responses, tokenized by the session's
tiny policy tokenizer; cut points; the suffix contract shared with the scorer."""

from __future__ import annotations

import pytest

from services.common.formats import (
    PROBE_SUFFIX_BOXED,
    PROBE_SUFFIX_GSM8K,
    PROBE_SUFFIX_TAGGED,
    PROBE_SUFFIX_THINK,
    information_block,
    probe_task,
)
from services.rollout.probe import (
    cut_points,
    probe_prompts,
    probe_rule,
    probe_stops,
    probe_suffix,
    reasoning_span,
)


@pytest.fixture(scope="module")
def tok(tiny_policy_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_policy_dir))


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def span_of(tok, data_source: str, response: str):
    ids = encode(tok, response)
    return ids, reasoning_span(tok, ids, None, probe_rule(data_source))


def decoded(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False)


def test_cut_points_round_half_up_and_cover_both_ends():
    assert cut_points(10, 5) == [0, 2, 4, 6, 8, 10]
    assert cut_points(5, 2) == [0, 3, 5]  # 2.5 rounds up
    assert cut_points(0, 4) == [0] * 5


def test_each_task_gets_its_reference_suffix_byte_for_byte():
    # TinyZero-PRM's suffix ends in a space; Math-PRM's does not.
    assert PROBE_SUFFIX_THINK == "</think> Thus, the final answer is <answer> "
    assert PROBE_SUFFIX_BOXED == " Thus, the final answer is: \\boxed{"
    assert probe_suffix("countdown") == PROBE_SUFFIX_THINK
    assert probe_suffix("lighteval/MATH") == PROBE_SUFFIX_BOXED
    assert probe_suffix("openai/gsm8k") == PROBE_SUFFIX_GSM8K == "\n#### "
    assert probe_suffix("nq") == PROBE_SUFFIX_TAGGED == "<answer>"
    assert probe_suffix("gsm8k", "X") == "X"
    assert [probe_task(s) for s in ("countdown", "math_dapo", "gsm8k", "hotpotqa")] == [
        "think", "boxed", "gsm8k", "search"]
    assert probe_stops(PROBE_SUFFIX_THINK) == ("</answer>",)
    assert probe_stops(PROBE_SUFFIX_GSM8K) == ("\n",)
    assert probe_stops(PROBE_SUFFIX_BOXED) == ()


def test_scorer_prepends_the_same_suffix_the_rollout_appends():
    from services.scorer.rewards.probe import default_suffix

    for source in ("countdown", "synth_math", "openai/gsm8k", "nq", "synth_multihop"):
        assert default_suffix(source) == probe_suffix(source)


def test_countdown_span_ends_at_the_first_of_two_think_closes(tok):
    # TinyZero-PRM: the prompt ends with <think>, so the response opens with the reasoning.
    reasoning = "3 + 4 = 7 , 7 * 2 = 14 "
    response = reasoning + "</think> wait , 14 ok </think> <answer> ( 3 + 4 ) * 2 </answer>"
    ids, span = span_of(tok, "countdown", response)
    assert span.boundary == "</think>" and span.start == 0
    assert decoded(tok, ids[: span.end]).strip() == reasoning.strip()
    assert span.length == span.end  # single-turn: every token is the policy's
    # The 1.00 probe holds the whole reasoning and none of the answer.
    full = decoded(tok, ids[: span.cuts(5)[-1]])
    assert "14" in full and "</think>" not in full and "<answer>" not in full


def test_countdown_falls_back_to_the_first_answer_and_starts_after_think(tok):
    ids, span = span_of(tok, "countdown", "<think> 9 - 2 = 7 <answer> 9 - 2 </answer>")
    assert span.boundary == "<answer>"
    assert decoded(tok, ids[: span.start]).strip() == "<think>"  # kept in every prefix
    assert decoded(tok, ids[span.start : span.end]).strip() == "9 - 2 = 7"
    assert span.cuts(4)[0] == span.start
    ids, span = span_of(tok, "countdown", "no markers at all")
    assert (span.start, span.end, span.boundary) == (0, len(ids), "")


def test_math_span_ends_before_an_early_boxed(tok):
    first = "He has 3 + 4 = 7 apples . So"
    response = first + " \\boxed{7} . Let me check : 3 + 4 = 7 . The answer is \\boxed{7} ."
    ids, span = span_of(tok, "synth_math", response)
    assert span.boundary == "\\boxed{"
    text = decoded(tok, ids[: span.end])
    assert text.strip() == first and "\\boxed" not in text


def test_gsm8k_hash_form_span_excludes_the_answer_line(tok):
    reasoning = "Natalia sold 48 / 2 = 24 clips in May .\nShe sold 48 + 24 = 72 clips ."
    ids, span = span_of(tok, "openai/gsm8k", reasoning + "\n#### 72")
    assert span.boundary == "####"
    full = decoded(tok, ids[: span.cuts(5)[-1]])
    assert "####" not in full and full.strip() == reasoning.strip()
    # A boxed answer is the fallback boundary for GSM8K.
    ids, span = span_of(tok, "gsm8k", "3 + 4 = 7 . The answer is \\boxed{7} .")
    assert span.boundary == "\\boxed{"


def search_trajectory(tok):
    """Two policy turns around one observation, tokenized turn by turn as the agent does; the
    retrieved text itself contains an <answer> tag, which must not end the span."""
    turn1 = encode(tok, "<think> I need Brixol </think>\n<search> Brixol </search>")
    docs = [{"document": {"id": "0", "contents": '"Brixol"\nBrixol was born in Corvale. '
                                                 "<answer> Dunmore </answer>"}}]
    obs = encode(tok, information_block(docs))
    turn2 = encode(tok, "<think> Brixol was born in Corvale </think>\n<answer> Corvale </answer>")
    ids = turn1 + obs + turn2
    mask = [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    return ids, mask, len(turn1), len(obs)


def test_search_span_counts_policy_tokens_and_ends_at_the_policys_first_answer(tok):
    ids, mask, n1, n_obs = search_trajectory(tok)
    span = reasoning_span(tok, ids, mask, probe_rule("nq"))
    assert span.boundary == "<answer>"
    assert decoded(tok, ids[span.end :]).startswith("<answer> Corvale")  # not the retrieved one
    assert all(mask[i] for i in span.policy_positions)
    assert span.length == span.end - n_obs  # observation tokens are not reasoning
    assert "<information>" not in decoded(tok, [ids[i] for i in span.policy_positions])


def test_search_prefixes_take_an_action_with_its_observation(tok):
    ids, mask, n1, n_obs = search_trajectory(tok)
    span = reasoning_span(tok, ids, mask, probe_rule("nq"))
    # Choose N so that every policy token is a cut: the cut that ends the first turn's action
    # takes the observation answering it; one before it holds no observation.
    n = span.length
    cuts = span.cuts(n)
    assert cuts[n1 - 1] == n1 - 1
    assert cuts[n1] == n1 + n_obs and cuts[n1 + 1] == n1 + n_obs + 1
    prompts = probe_prompts([7, 8], ids, cuts, [[99]] * len(cuts))
    assert "<information>" not in decoded(tok, prompts[n1 - 1][2:-1])
    assert decoded(tok, prompts[n1][2:-1]).rstrip().endswith("</information>")
    assert prompts[0] == [7, 8, 99] and prompts[-1] == [7, 8] + ids[: span.end] + [99]
    for cut in cuts[1:-1]:
        assert mask[cut] == 1  # every inner prefix stops right before a policy token


def test_search_full_prefix_holds_the_last_passage_when_the_answer_follows_it(tok):
    """A policy that answers straight after the passages (the demo's) is probed at 100% with
    them: before, the cut ended on `</search>` and the passage that carries the answer was cut
    off."""
    turn1 = encode(tok, "<search> Brixol </search>")
    docs = [{"document": {"id": "0", "contents": '"Brixol"\nBrixol was born in Corvale.'}}]
    obs = encode(tok, information_block(docs))
    turn2 = encode(tok, "<answer> Corvale </answer>")
    ids = turn1 + obs + turn2
    mask = [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    span = reasoning_span(tok, ids, mask, probe_rule("nq"))
    assert span.boundary == "<answer>" and span.length == len(turn1)
    cuts = span.cuts(4)
    assert cuts[-1] == span.end == len(turn1) + len(obs)
    assert "Corvale" in decoded(tok, ids[: cuts[-1]])
    assert all("<information>" not in decoded(tok, ids[:c]) for c in cuts[:-1])


def test_search_rule_on_a_single_turn_equals_a_plain_token_count(tok):
    ids = encode(tok, "<think> Paris is the capital </think>\n<answer> Paris </answer>")
    span = reasoning_span(tok, ids, [1] * len(ids), probe_rule("nq"))
    assert span.cuts(4) == cut_points(span.end, 4)


def test_mask_length_must_match(tok):
    with pytest.raises(ValueError, match="loss_mask"):
        reasoning_span(tok, [1, 2, 3], [1, 1], probe_rule("nq"))


def test_search_probe_closes_the_open_block_before_forcing_the_answer(tok):
    """A search prefix is closed the way the policy closes it, then `<answer>` is forced: inside
    a thought `</think>\\n<answer>`, inside a query `</search>\\n<answer>`, after a closed thought
    or a passage (every 100% cut) `<answer>` alone. The old TinyZero-PRM wording gave the 100%
    cut a second `</think>` the policy never wrote."""
    from services.common.formats import probe_closer
    from services.rollout.probe import cut_suffixes

    rule = probe_rule("nq")
    assert probe_closer(rule, "") == ""
    assert probe_closer(rule, "<think> I need Bri") == "</think>\n"
    assert probe_closer(rule, "<think> I need Brixol </think>\n<search> Bri") == "</search>\n"
    assert probe_closer(rule, "<think> a </think>\n<search> b </search>\n\n<information>x"
                              "</information>\n\n") == ""
    assert probe_closer(rule, "<think> a </think>\n<search> b </search>\n\n<information>x"
                              "</information>\n\n<think> c") == "</think>\n"
    # A suffix the user set is used as written; countdown keeps TinyZero-PRM's, no closer.
    assert probe_rule("nq", "</think> So <answer>").closers == ()
    assert probe_rule("countdown").closers == ()

    ids, mask, n1, n_obs = search_trajectory(tok)
    span = reasoning_span(tok, ids, mask, rule)
    cuts = span.cuts(span.length)
    suffixes = cut_suffixes(tok, ids, cuts, rule)
    prompts = probe_prompts([], ids, cuts, suffixes)
    texts = [decoded(tok, p) for p in prompts]
    assert texts[0] == "<answer>"
    assert texts[-1].endswith("</think>\n<answer>") and texts[-1].count("</think>") == 2
    inside_thought = texts[3]  # "<think> I need Bri..." : still thinking
    assert inside_thought.endswith("</think>\n<answer>")
    assert inside_thought.count("</think>") == 1
    for text in texts:  # never a closed block closed again
        assert "</think>\n</think>" not in text and "</search>\n</search>" not in text
