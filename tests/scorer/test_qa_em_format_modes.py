"""`qa_em_format`: `mode="search_r1"` against Search-R1 v0.3's `qa_em_format.compute_score_em`
case for case, and the default's documented differences (docs/scorer.md).

The expected values were derived by reading Search-R1's code (PeterGriffinJin/Search-R1 at
a14dc3a, verl/utils/reward_score/qa_em_format.py), as its reward manager calls it: on the
decoded prompt + response (main_ppo_format.py), with its prompt (a Qwen chat template around
the instruction of scripts/data_process/nq_search.py). A response given alone is scored as the
response to that prompt. Per case: (id, text, gold, retrieval_score, Search-R1, Forage default);
structure_format_score 0.2 and final_format_score 0.1 as in Search-R1's v0.3 scripts.

How Search-R1 arrives at each value:
- validity: the text after the FIRST `<|im_start|>assistant` must be think → (search →
  information → think)* → answer with balanced tags and only whitespace outside the blocks,
  nothing after `</answer>`; no marker → invalid.
- answer: all `<answer>…</answer>` of the WHOLE text; fewer than two → None, else the last.
  Its prompt holds two (`<answer> and </answer>`, `<answer> Beijing </answer>`), so a response
  without a complete answer is read as answering "Beijing".
- retrieval credit (valid only): a gold inside any `<information>` block of the WHOLE text,
  the prompt's `<information> and </information>` included.
- table: no answer → 0.2 (+retrieval) if valid else 0; right → 1 if valid else 0.8;
  wrong → 0.2 (+retrieval) if valid else 0.1.
"""

from __future__ import annotations

import pytest

from services.common.formats import search_r1_prompt
from services.scorer.rewards import RewardTable, compute_score
from services.scorer.rewards.qa import qa_em, qa_em_format

G = ["Corvale"]
PROMPT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
          + search_r1_prompt("Where was Brixol born") + "<|im_end|>\n<|im_start|>assistant\n")
SEARCH = ('<think> who is Brixol </think>\n<search> Brixol </search>\n\n<information>Doc 1(Title: '
          '"Brixol") Brixol was born in Corvale.</information>\n\n<think> so </think>\n'
          "<answer> {} </answer>")
THINK = "<think> x </think>\n"

CASES = [
    # id, text, gold, retrieval_score, Search-R1, Forage default
    ("no_answer", "<think> I do not know </think>", G, 0.0, 0.1, 0.0),
    ("empty_response", "", G, 0.0, 0.1, 0.0),
    ("unclosed_answer", THINK + "<answer> Corvale", G, 0.0, 0.1, 0.0),
    ("no_answer_gold_is_the_example", THINK, ["Beijing"], 0.0, 0.8, 0.0),
    ("search_not_executed", THINK + "<search> Brixol </search>", G, 0.0, 0.1, 0.0),
    ("valid_correct", THINK + "<answer> Corvale </answer>", G, 0.0, 1.0, 1.0),
    ("valid_wrong", THINK + "<answer> Dunmore </answer>", G, 0.0, 0.2, 0.2),
    ("text_after_answer", THINK + "<answer> Corvale </answer>\nI am sure.", G, 0.0, 0.8, 0.8),
    ("text_after_wrong_answer", THINK + "<answer> Dunmore </answer> done", G, 0.0, 0.1, 0.1),
    ("whitespace_after_answer", THINK + "<answer> Corvale </answer>\n\n", G, 0.0, 1.0, 1.0),
    ("two_answers_last_right",
     THINK + "<answer> Dunmore </answer>\n<answer> Corvale </answer>", G, 0.0, 0.8, 0.8),
    ("two_answers_last_wrong",
     THINK + "<answer> Corvale </answer>\n<answer> Dunmore </answer>", G, 0.0, 0.1, 0.1),
    ("answer_before_think", "<answer> Corvale </answer>\n<think> x </think>", G, 0.0, 0.8, 0.8),
    ("answer_inside_think", "<think> x <answer> Corvale </answer> </think>", G, 0.0, 0.8, 0.8),
    ("text_between_blocks", "<think> x </think> so <answer> Corvale </answer>", G, 0.0, 0.8, 0.8),
    ("unbalanced_think", "<think> x <think> y </think>\n<answer> Corvale </answer>", G, 0.0,
     0.8, 0.8),
    ("answer_right_after_information",
     "<think> a </think>\n<search> q </search>\n\n<information> Corvale </information>\n\n"
     "<answer> Corvale </answer>", G, 0.0, 0.8, 0.8),
    ("search_flow_correct", SEARCH.format("Corvale"), G, 0.1, 1.0, 1.0),
    ("search_flow_wrong_gold_retrieved", SEARCH.format("Dunmore"), G, 0.1, 0.3, 0.3),
    ("search_flow_wrong_gold_not_retrieved", SEARCH.format("Dunmore"), ["Pellam"], 0.1, 0.2, 0.2),
    # Search-R1 finds the gold "and" in its prompt's `<information> and </information>`.
    ("retrieval_credit_from_the_prompt", SEARCH.format("Dunmore"), ["and"], 0.1, 0.3, 0.2),
    # prompt + response, as Search-R1's reward manager passes them
    ("full_text_correct", PROMPT + THINK + "<answer> Corvale </answer>", G, 0.0, 1.0, 1.0),
    ("full_text_no_answer", PROMPT + "<think> x </think>", G, 0.0, 0.1, 0.0),
    ("full_text_wrong", PROMPT + THINK + "<answer> Dunmore </answer>", G, 0.0, 0.2, 0.2),
    # a second assistant turn: Search-R1 reads from the first marker, Forage from the last
    ("two_assistant_turns", PROMPT + THINK + "<answer> Corvale </answer><|im_end|>\n"
     "<|im_start|>assistant\n<think> y </think>\n<answer> Dunmore </answer>", G, 0.0, 0.1, 0.2),
    # a prompt without a chat template: no `<|im_start|>assistant`, never valid in Search-R1
    ("plain_prompt_assistant_marker", search_r1_prompt("Where was Brixol born")
     + "Assistant: " + THINK + "<answer> Corvale </answer>", G, 0.0, 0.8, 1.0),
    ("plain_prompt_no_answer", search_r1_prompt("Where was Brixol born") + THINK, G, 0.0,
     0.1, 0.0),
]


def score(text, gold, retrieval, mode):
    return qa_em_format(text, {"target": gold}, structure_format_score=0.2,
                        final_format_score=0.1, retrieval_score=retrieval, mode=mode)


@pytest.mark.parametrize(("text", "gold", "retrieval", "search_r1", "forage"),
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_search_r1_mode_reproduces_search_r1_and_default_differs_as_documented(
        text, gold, retrieval, search_r1, forage):
    assert score(text, gold, retrieval, "search_r1") == pytest.approx(search_r1)
    assert score(text, gold, retrieval, "forage") == pytest.approx(forage)


def test_mode_is_an_option_of_the_reward_table():
    table = RewardTable({"nq": [{"function": "qa_em_format", "options": {"mode": "search_r1"}}]})
    assert compute_score("nq", "<think> x </think>", {"target": G}, table=table) == 0.1
    assert compute_score("nq", "<think> x </think>", {"target": G}) == 0.0  # qa_em default
    bad = RewardTable({"nq": [{"function": "qa_em_format", "options": {"mode": "searchr1"}}]})
    with pytest.raises(ValueError, match="mode must be 'forage' or 'search_r1', got 'searchr1'"):
        compute_score("nq", "x", {"target": G}, table=bad)


def test_the_instruction_never_answers_for_the_response():
    """Prompt + response without an assistant marker: the instruction's `<answer> and
    </answer>` is not the response's answer (it used to be read as "and")."""
    text = search_r1_prompt("Where was Brixol born") + THINK
    assert qa_em(text, {"target": ["and"]}) == 0.0
    assert qa_em(text + "<answer> and </answer>", {"target": ["and"]}) == 1.0
