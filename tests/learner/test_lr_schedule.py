"""The LR multiplier's horizon is counted in the unit the scheduler steps in (optimizer steps)."""

from __future__ import annotations

import math

from services.common.config.learner import LearnerSection
from services.learner.engine import lr_multiplier


def test_cosine_reaches_zero_at_the_last_optimizer_step_of_the_run() -> None:
    """4 RL steps x 3 updates: the decay spans 12 optimizer steps, not 4 (the old horizon put
    every update from RL step 2 on at LR 0)."""
    cfg = LearnerSection(lr_schedule="cosine")
    factor = lr_multiplier(cfg, total_steps=4, warmup_ratio=None, updates_per_step=3)
    assert factor(0) == 1.0
    assert math.isclose(factor(6), 0.5, abs_tol=1e-12)  # half-way through 12 optimizer steps
    assert factor(5) > 0.5 > factor(7) > 0.0
    assert factor(12) == 0.0


def test_warmup_steps_stay_in_optimizer_steps() -> None:
    cfg = LearnerSection(lr_schedule="constant", warmup_steps=3)
    factor = lr_multiplier(cfg, total_steps=10, warmup_ratio=None, updates_per_step=4)
    assert [factor(i) for i in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_ratio_warmup_counts_training_steps() -> None:
    cfg = LearnerSection(lr_schedule="constant")
    factor = lr_multiplier(cfg, total_steps=10, warmup_ratio=0.2, updates_per_step=5)
    # W = int(0.2 x 10) = 2 training steps; every update of training step t runs at t / W.
    assert [factor(i) for i in (0, 4, 5, 9, 10, 49)] == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0]
