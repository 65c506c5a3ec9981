"""Probe scoring: suffix prepended, format credit 0, p_k / AUC / overconfidence."""

from __future__ import annotations

import math

import numpy as np
import pytest

from services.common.formats import PROBE_SUFFIX_BOXED, PROBE_SUFFIX_GSM8K, PROBE_SUFFIX_TAGGED
from services.common.trajectory import Probe
from services.scorer.rewards.probe import (
    auc,
    default_suffix,
    overconfidence,
    score_probe,
    summarize,
)

FRACTIONS = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]


@pytest.mark.parametrize(
    ("curve", "expected"),
    [
        ([0.5] * 6, 0.0),                              # flat: weights sum to 0
        ([1, 0, 0, 0, 0, 0], 0.5),                     # all at the start
        ([0, 0, 0, 0, 0, 1], -0.5),
        ([1, 1, 1, 0, 0, 0], 0.5 + 0.3 + 0.1),
        ([1, 1, 1, 1, 1, 1], 0.0),
    ],
)
def test_overconfidence(curve, expected):
    assert overconfidence(curve) == pytest.approx(expected)


def test_overconfidence_bound_for_n5():
    assert overconfidence([1, 1, 1, 0, 0, 0]) == pytest.approx(0.9)
    assert np.linspace(0.5, -0.5, 6).sum() == pytest.approx(0.0)


def test_auc():
    assert auc(FRACTIONS, [0, 0.2, 0.4, 0.6, 0.8, 1.0]) == pytest.approx(0.5)
    assert auc(FRACTIONS, [1.0] * 6) == pytest.approx(1.0)
    assert auc([0.0], [0.7]) == pytest.approx(0.7)


def test_qa_probe_prepends_the_suffix_and_gives_no_format_credit():
    probe = Probe(
        fractions=[0.0, 0.5, 1.0],
        samples=[
            [" Lyon </answer>", " Rome </answer>"],
            [" Paris </answer>", " Rome </answer>"],
            [" Paris </answer>", " Paris </answer>"],
        ],
    )
    scores = score_probe("nq", probe, {"target": ["Paris"]}, PROBE_SUFFIX_TAGGED)
    assert scores.per_fraction == [0.0, 0.5, 1.0]
    assert scores.auc == pytest.approx(0.5)
    assert scores.overconfidence == pytest.approx(-0.5)


def test_countdown_probe_format_credit_zero():
    probe = Probe(fractions=[0.0, 1.0], samples=[[" 1 + 2 </answer>"], [" (1 + 2) * 3 </answer>"]])
    scores = score_probe("countdown", probe, {"target": 9, "numbers": [1, 2, 3]}, None)
    assert scores.per_fraction == [0.0, 1.0]


def test_math_probe_uses_the_boxed_suffix():
    assert default_suffix("synth_math") == PROBE_SUFFIX_BOXED
    assert default_suffix("openai/gsm8k") == PROBE_SUFFIX_GSM8K  # `#### n` form (docs/probe.md)
    assert default_suffix("nq") == PROBE_SUFFIX_TAGGED
    assert default_suffix("nq", "custom") == "custom"
    probe = Probe(fractions=[0.0, 1.0], samples=[["7}", "12}"], ["12}. Done", "12}"]])
    scores = score_probe("synth_math", probe, "12", None)
    assert scores.per_fraction == [0.5, 1.0]
    gsm = score_probe("openai/gsm8k", probe, "12", None)  # flexible read of "\n#### 12}"
    assert gsm.per_fraction == [0.5, 1.0]


def test_empty_fraction_is_nan():
    result = summarize([0.0, 1.0], [[], [1.0]])
    assert math.isnan(result.per_fraction[0]) and math.isnan(result.overconfidence)


def test_mismatched_probe_is_an_error():
    with pytest.raises(ValueError):
        score_probe("nq", Probe(fractions=[0.0, 1.0], samples=[["x"]]), {"target": ["a"]})
