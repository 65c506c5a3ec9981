"""GSM8K strict/flexible extraction, verl upstream semantics."""

from __future__ import annotations

import pytest

from services.scorer.rewards.gsm8k import extract_solution, gsm8k


@pytest.mark.parametrize(
    ("text", "method", "expected"),
    [
        ("so the answer is\n#### 72", "strict", "72"),
        ("#### 1,000", "strict", "1000"),
        ("#### -3.5", "strict", "-3.5"),
        ("#### 1 then #### 2", "strict", "2"),          # upstream: the last match
        ("The answer is 72", "strict", None),
        ("The answer is 72", "flexible", "72"),
        ("it costs 1,000 dollars", "flexible", "1,000"),  # commas kept in flexible mode
        ("we get 72.", "flexible", "72."),
        ("x" * 400 + "#### 5", "strict", "5"),
        ("#### 5" + "x" * 400, "strict", None),           # only the last 300 characters
        ("nothing here", "flexible", None),
    ],
)
def test_extract(text, method, expected):
    assert extract_solution(text, method) == expected


@pytest.mark.parametrize(
    ("text", "gt", "kwargs", "expected"),
    [
        ("#### 72", "72", {}, 1.0),
        ("#### 71", "72", {}, 0.0),
        ("#### 71", "72", {"format_score": 0.1}, 0.1),
        ("no number", "72", {"format_score": 0.1}, 0.0),
        ("we get 72.", "72", {"method": "flexible"}, 0.0),  # "72." != "72": upstream pitfall
        ("is \\boxed{72}", "72", {"method": "flexible"}, 1.0),
        ("#### 1,000", "1000", {}, 1.0),
    ],
)
def test_gsm8k(text, gt, kwargs, expected):
    assert gsm8k(text, gt, **kwargs) == expected


def test_bad_method():
    with pytest.raises(ValueError):
        extract_solution("#### 1", "loose")
