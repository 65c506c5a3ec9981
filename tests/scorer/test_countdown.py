"""Countdown: TinyZero semantics with a safe AST evaluator; bombs return a score, fast."""

from __future__ import annotations

import time

import pytest

from services.scorer.rewards.countdown import EquationError, countdown, evaluate_equation

GT = {"target": 24, "numbers": [3, 4, 6, 1]}


def ans(equation: str) -> str:
    return f"<think>working</think>\n<answer>{equation}</answer>"


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (ans("6 / (1 - 3 / 4)"), 1.0),        # 24 exactly, rational arithmetic
        (ans("(6 - 4 + 1) * 3 + 1"), 0.1),    # right numbers, wrong value (10)
        (ans("6 * 4 * 1"), 0.1),              # 3 unused
        (ans("6 * 4 * 1 * 3 / 3"), 0.1),      # 3 used twice
        (ans("6 * 4 * (3 - 1 - 1)"), 0.1),    # 1 used twice
        (ans("(6 - 3 + 1) * 4 + 8 - 8"), 0.1),  # numbers not given
        ("<think>6 / (1 - 3 / 4)</think>", 0.0),  # no answer tag
        (ans("6 / (1 - 3 / 4)") + ans("6 * 4"), 0.1),  # the last answer counts
        (ans("6 * 4") + ans("6 / (1 - 3 / 4)"), 1.0),
    ],
)
def test_countdown_table(response, expected):
    assert countdown(response, GT) == expected


@pytest.mark.parametrize(
    ("response", "gt", "expected"),
    [
        (ans("6 / (1 - 3 / 4)"), GT, 1.0),
        (ans("(6 * 4) * (3 - 1 - 1)") , {"target": 24, "numbers": [6, 4, 3, 1, 1]}, 1.0),
        (ans("44 + 19 + 35") + "\n", {"target": 98, "numbers": [44, 19, 35]}, 1.0),  # newline
        (ans("1.5 * 2"), {"target": 3, "numbers": [1, 5, 2]}, 0.1),  # 1.5 is not 1 and 5
        (ans("2**99**99"), {"target": 3, "numbers": [2, 99, 99]}, 0.1),
        (ans("9" * 400), {"target": 3, "numbers": [9]}, 0.1),
        (ans("(" * 300 + "1" + ")" * 300), {"target": 1, "numbers": [1]}, 0.1),
        (ans("-" * 450 + "1"), {"target": 1, "numbers": [1]}, 0.1),
        (ans("5 / (3 - 3)"), {"target": 1, "numbers": [5, 3, 3]}, 0.1),
        (ans("__import__('os')"), {"target": 1, "numbers": [1]}, 0.1),
        (ans("True + 2"), {"target": 3, "numbers": [2]}, 0.1),
        (ans("[1, 2]"), {"target": 3, "numbers": [1, 2]}, 0.1),
        (ans("10 - 3 * 2"), {"target": 4, "nums": [10, 3, 2]}, 1.0),
    ],
)
def test_countdown_pitfalls(response, gt, expected):
    started = time.perf_counter()
    assert countdown(response, gt) == expected
    assert time.perf_counter() - started < 0.5


def test_format_score_option_and_marker():
    assert countdown(ans("6 * 4 * 1"), GT, format_score=0.0) == 0.0
    prompt = "User: make 24 <answer> (1 + 2) / 3 </answer>\nAssistant: Let me solve"
    assert countdown(prompt + ans("6 / (1 - 3 / 4)"), GT) == 1.0
    assert countdown(prompt + " nothing", GT) == 0.0  # the prompt's example is not an answer


def test_evaluate_equation():
    value, literals = evaluate_equation("(1 + 2) * -3 / 4")
    assert float(value) == -2.25 and literals == [1, 2, 3, 4]
    for bad in ["2 ** 3", "a + 1", "1 // 2", "1 % 2", "x" * 600, "1 +"]:
        with pytest.raises(EquationError):
            evaluate_equation(bad)


def test_bad_ground_truth_is_an_error():
    with pytest.raises(ValueError):
        countdown(ans("1"), {"target": 1})
