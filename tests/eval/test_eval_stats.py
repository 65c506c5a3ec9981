"""The pure metric and statistics functions of `forage eval` (services/eval/stats.py)."""

from __future__ import annotations

import math

import pytest

from services.eval import stats
from services.scorer.rewards.qa import qa_em


@pytest.mark.parametrize(("response", "gold", "em", "subem"), [
    ("<answer> The Eiffel Tower! </answer>", ["eiffel tower"], 1.0, 1.0),
    ("<answer> Paris, France </answer>", ["Paris"], 0.0, 1.0),
    ("<answer> a </answer> <answer> Paris </answer>", ["paris"], 1.0, 1.0),
    ("Paris", ["Paris"], 0.0, 0.0),  # no answer tag: 0, as in training
])
def test_scores_follow_the_scorers_rules(response, gold, em, subem) -> None:
    scores = stats.score_response(response, {"target": gold})
    assert scores["em"] == em == qa_em(response, {"target": gold})
    assert scores["subem"] == subem


def test_f1_is_squad_token_f1_on_the_last_answer() -> None:
    scores = stats.score_response("<answer> the city of Paris </answer>", {"target": ["Paris"]})
    assert scores["f1"] == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))


def test_wilson_interval_known_values() -> None:
    low, high = stats.wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.27753, abs=1e-4)
    low, high = stats.wilson_interval(5, 10)
    assert (low, high) == (pytest.approx(0.23659, abs=1e-4), pytest.approx(0.76341, abs=1e-4))
    assert stats.wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        stats.wilson_interval(11, 10)


def test_bootstrap_is_seeded_and_brackets_the_mean() -> None:
    values = [0.0, 0.5, 1.0, 0.25, 0.75] * 8
    first = stats.bootstrap_interval(values)
    assert first == stats.bootstrap_interval(values)
    assert first[0] < stats.mean(values) < first[1]
    assert stats.bootstrap_interval([1.0] * 5) == (1.0, 1.0)


def test_mcnemar_exact_is_the_two_sided_sign_test() -> None:
    assert stats.mcnemar_exact(0, 0) == 1.0
    assert stats.mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    assert stats.mcnemar_exact(9, 1) == pytest.approx(2 * (1 + 10) / 1024)
    assert stats.mcnemar_exact(3, 3) == 1.0
    assert stats.mcnemar_exact(1, 9) == stats.mcnemar_exact(9, 1)
    assert stats.mcnemar_exact(0, 60) == pytest.approx(2 * 0.5 ** 60)
    assert not math.isnan(stats.mcnemar_exact(500, 520))


def test_paired_counts_discordant_questions() -> None:
    out = stats.paired([1, 1, 0, 0, 1], [1, 0, 1, 0, 0])
    assert (out["n"], out["a_only"], out["b_only"]) == (5, 2, 1)
    assert out["difference"] == pytest.approx(0.2)
    assert out["p_value"] == stats.mcnemar_exact(2, 1)
    with pytest.raises(ValueError):
        stats.paired([1], [1, 0])
