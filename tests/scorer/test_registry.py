"""Dispatch by data source, custom module:function rewards, weights, None → NaN."""

from __future__ import annotations

import math
import sys
import types

import pytest

from services.scorer.rewards import compute_score
from services.scorer.rewards.registry import (
    DEFAULT_DATA_SOURCES,
    RewardTable,
    UnknownDataSource,
    combine,
)

QA = "<think>x</think><answer> Paris </answer>"


@pytest.mark.parametrize(
    ("data_source", "solution", "ground_truth", "expected"),
    [
        ("nq", QA, {"target": ["Paris"]}, 1.0),
        ("searchR1_hotpotqa", QA, {"target": ["Paris"]}, 1.0),
        ("synth_single", QA, {"target": ["Paris"]}, 1.0),
        ("synth_multihop", QA, {"target": ["Lyon"]}, 0.0),
        ("countdown", "<answer>(1 + 2) * 3</answer>", {"target": 9, "numbers": [1, 2, 3]}, 1.0),
        ("openai/gsm8k", "#### 9", "9", 1.0),
        ("synth_math", "so \\boxed{12}", "12", 1.0),
        ("lighteval/MATH", "\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ],
)
def test_compute_score_dispatch(data_source, solution, ground_truth, expected):
    assert compute_score(data_source, solution, ground_truth) == expected


def test_unknown_data_source_names_it_and_the_known_ones():
    with pytest.raises(UnknownDataSource) as info:
        compute_score("no_such_source", "x", "y")
    message = str(info.value)
    assert "no_such_source" in message and "nq" in message and "countdown" in message


def test_required_sources_are_known():
    for name in ["nq", "hotpotqa", "triviaqa", "popqa", "2wikimultihopqa", "musique",
                 "bamboogle", "searchR1_nq", "countdown", "openai/gsm8k", "lighteval/MATH",
                 "synth_single", "synth_multihop", "synth_math"]:
        assert name in DEFAULT_DATA_SOURCES


@pytest.fixture()
def custom_module():
    """A real importable module holding users' reward functions in verl's signature."""
    module = types.ModuleType("forage_test_rewards")

    def length_bonus(data_source, solution_str, ground_truth, extra_info=None):
        return min(1.0, len(solution_str) / 100)

    def abstain(data_source, solution_str, ground_truth, extra_info=None):
        return None

    def detailed(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5, "acc": 1.0, "note": "text is dropped"}

    module.length_bonus, module.abstain, module.detailed = length_bonus, abstain, detailed
    sys.modules[module.__name__] = module
    yield module.__name__
    del sys.modules[module.__name__]


def test_weighted_components_none_and_dicts(custom_module):
    table = RewardTable({
        "nq": [
            {"function": "qa_em", "weight": 1.0},
            {"function": f"{custom_module}:length_bonus", "weight": 0.5},
            {"function": f"{custom_module}:abstain", "weight": 3.0},
            {"function": f"{custom_module}:detailed", "weight": 2.0},
        ],
        "my_task": [{"function": f"{custom_module}:length_bonus"}],
    })
    result = compute_score("nq", "x" * 50 + QA, {"target": ["Paris"]}, table=table)
    assert result["qa_em"] == 1.0
    assert result[f"{custom_module}:length_bonus"] == pytest.approx(0.9)
    assert math.isnan(result[f"{custom_module}:abstain"])  # None -> NaN, left out of the sum
    assert result[f"{custom_module}:detailed/acc"] == 1.0
    assert result["score"] == pytest.approx(1.0 + 0.5 * 0.9 + 2.0 * 0.5)
    assert compute_score("my_task", "y" * 10, None, table=table) == pytest.approx(0.1)


def test_options_reach_builtins():
    table = RewardTable({"nq": [{"function": "qa_em", "options": {"format_score": 0.25}}]})
    assert compute_score("nq", "<answer>Lyon</answer>", {"target": ["Paris"]}, table=table) == 0.25


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"function": "no_such_reward"}, "unknown reward function"),
        ({"function": "json:no_such_function"}, "has no"),
        ({"function": "no_such_module_xyz:f"}, "cannot import"),
        ({"function": "json"}, "unknown reward function"),
    ],
)
def test_bad_function_names(spec, match):
    with pytest.raises(ValueError, match=match):
        RewardTable({"nq": [spec]})


def test_combine_all_none_is_nan():
    """TRL: a row every reward function returned None for is unscorable (NaN), not 0."""
    table = RewardTable()
    total, recorded = combine(table.components("nq"), [None])
    assert math.isnan(total) and math.isnan(recorded["qa_em"])
