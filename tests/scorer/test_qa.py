"""Search-R1 QA rewards, table-driven, including the reference's pitfalls."""

from __future__ import annotations

import pytest

from services.common.formats import search_r1_prompt
from services.scorer.rewards import qa
from services.scorer.rewards.text import gold_answers, last_answer, normalize_answer

GT = {"target": ["Paris", "City of Light"]}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The  Eiffel-Tower!", "eiffeltower"),  # punctuation dropped, not spaced
        ("An apple a day", "apple day"),
        ("  THE end.  ", "end"),
        ("theatre", "theatre"),  # articles only as whole words
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<think>hm</think><answer> Paris </answer>", 1.0),
        ("<answer>the paris.</answer>", 1.0),
        ("<answer> city of light </answer>", 1.0),
        ("<answer>Lyon</answer>", 0.0),
        ("no answer tag, Paris", 0.0),
        ("<answer>Lyon</answer> then <answer>Paris</answer>", 1.0),  # the last answer counts
        ("<answer>Paris</answer> then <answer>Lyon</answer>", 0.0),
        ("<answer>Paris</answer>\n", 1.0),  # a newline after the answer does not matter
        ("<answer>\nParis\n</answer>", 1.0),
        ("<answer>Paris is the capital</answer>", 0.0),  # EM, not substring
    ],
)
def test_qa_em(response, expected):
    assert qa.qa_em(response, GT) == expected


def test_prompt_example_answer_never_counts():
    """Search-R1's template shows `<answer> Beijing </answer>`; it is not the model's answer."""
    prompt = search_r1_prompt("What is the capital of China")
    gt = {"target": ["Beijing"]}
    assert qa.qa_em(prompt + "<think>no idea</think>", gt) == 0.0
    chat = "<|im_start|>user\n" + prompt + "<|im_end|>\n<|im_start|>assistant\n<think>x</think>"
    assert qa.qa_em(chat, gt) == 0.0
    assert qa.qa_em(chat + "<answer> Beijing </answer>", gt) == 1.0
    assert qa.qa_em(prompt + "<answer> Beijing </answer>", gt) == 1.0


@pytest.mark.parametrize(
    ("ground_truth", "golds"),
    [({"target": ["a", "b"]}, ["a", "b"]), ("x", ["x"]), (["x", 3], ["x", "3"]), (7, ["7"])],
)
def test_gold_shapes(ground_truth, golds):
    assert gold_answers(ground_truth) == golds


def test_gold_without_target_is_an_error():
    with pytest.raises(ValueError, match="target"):
        gold_answers({"answer": "x"})


def test_subem_and_f1():
    assert qa.qa_subem("<answer>it is Paris, France</answer>", GT) == 1.0
    assert qa.qa_subem("<answer>Lyon</answer>", GT) == 0.0
    assert qa.qa_f1("<answer>Paris France</answer>", {"target": ["Paris"]}) == pytest.approx(2 / 3)
    assert qa.qa_f1("<answer>the Paris</answer>", {"target": ["paris"]}) == 1.0
    assert qa.qa_f1("nothing", GT) == 0.0
    assert last_answer("<answer> a </answer>") == "a"


VALID = ("<think>a</think>\n<search> q </search>\n\n<information>Doc 1(Title: x) Paris here"
         "</information>\n\n<think>b</think>\n<answer> {} </answer>")
INVALID = "<answer> {} </answer>"  # no think first


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (VALID.format("Paris"), 1.0),                       # valid + correct
        (INVALID.format("Paris"), 0.8),                     # invalid + correct: 1 - structure
        (VALID.format("Lyon"), 0.2 + 0.05),                 # valid + wrong: structure + retrieval
        (INVALID.format("Lyon"), 0.1),                      # invalid + wrong: final format
        ("<think>a</think> stray <answer>Paris</answer>", 0.8),  # text between blocks
        ("<think>a</think><think>b</think><answer>Paris</answer>", 0.8),  # think twice
        ("<think>a</think>", 0.0),                          # no answer, not valid
    ],
)
def test_qa_em_format_table(response, expected):
    score = qa.qa_em_format(response, GT, structure_format_score=0.2, final_format_score=0.1,
                            retrieval_score=0.05)
    assert score == pytest.approx(expected)


def test_is_valid_sequence():
    assert qa.is_valid_sequence(VALID.format("x"))
    assert not qa.is_valid_sequence("<think>a</think><answer>x</answer> trailing words")
    assert qa.is_valid_sequence("<think>a</think><answer>x</answer>\n\n")
    assert not qa.is_valid_sequence("<think>a</think><search>q</search><answer>x</answer>")
    assert not qa.is_valid_sequence("<think>a<answer>x</answer>")
