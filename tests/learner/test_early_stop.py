"""The RL loop's early stop on a held-out plateau (services/learner/early_stop.py)."""

from __future__ import annotations

import pytest

from services.common.config.learner import LearnerSection
from services.learner.early_stop import plateau_message, plateau_reached

# The demo's seed-0 curve with its skilled warm start (eval every 25 steps).
CURVE = [(0, 0.150), (25, 0.507), (50, 0.550), (75, 0.543)]


def test_stops_when_the_last_evaluations_add_nothing() -> None:
    assert plateau_reached(CURVE, min_steps=50, patience=1)
    assert "0.550 at step 50" in plateau_message(CURVE, 1)


def test_a_run_still_learning_is_never_cut() -> None:
    rising = [(0, 0.10), (25, 0.30), (50, 0.31), (75, 0.33), (100, 0.34)]
    for end in range(1, len(rising) + 1):
        assert not plateau_reached(rising[:end], min_steps=0, patience=1)
    # slower learners set a new best only every other evaluation: patience 2 keeps them going
    stepwise = [(0, 0.1), (25, 0.3), (50, 0.29), (75, 0.35), (100, 0.34), (125, 0.4)]
    for end in range(1, len(stepwise) + 1):
        assert not plateau_reached(stepwise[:end], min_steps=0, patience=2)
    assert plateau_reached(stepwise[:5], min_steps=0, patience=1)


def test_min_steps_min_delta_and_off() -> None:
    assert not plateau_reached(CURVE, min_steps=100, patience=1)  # too early
    assert not plateau_reached(CURVE[:3], min_steps=0, patience=1)  # 0.550 is a new best
    assert plateau_reached(CURVE[:3], min_steps=0, patience=1, min_delta=0.05)  # by < 0.05
    assert not plateau_reached(CURVE, min_steps=0, patience=0)  # off
    assert not plateau_reached(CURVE[:1], min_steps=0, patience=1)  # nothing to compare


def test_config_needs_evaluations_to_compare() -> None:
    with pytest.raises(ValueError, match="early_stop_patience needs learner.eval_every"):
        LearnerSection(early_stop_patience=2, eval_every=0)
    assert LearnerSection(early_stop_patience=2, eval_every=25).early_stop_patience == 2


def test_demo_console_says_when_rl_stopped_early() -> None:
    from services.launch.demo import early_stop_line

    records = [{"kind": "eval", "step": s, "eval/em": em} for s, em in CURVE]
    records += [{"kind": "train", "step": s} for s in range(1, 76)]
    line = early_stop_line(records, total_steps=100)
    assert line and "RL stopped at step 75 of 100" in line and "55.0% at step 50" in line
    assert early_stop_line(records, total_steps=75) is None  # ran to the end
    assert early_stop_line([], total_steps=100) is None
