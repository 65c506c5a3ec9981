"""The probe curve's summary rules, shared by the scorer (which scores probe completions) and
the learner (which aggregates them per batch): what counts as a correct forced answer, the
curve's area and its overconfidence (services/scorer/rewards/probe.py explains the probe)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# A forced answer is correct when its reward reaches this (TinyZero-PRM's rule).
CORRECT_THRESHOLD = 1.0


def overconfidence_weights(num_points: int) -> np.ndarray:
    return np.linspace(0.5, -0.5, num_points)


def overconfidence(per_fraction: Sequence[float]) -> float:
    """sum_k w_k p_k with w = linspace(0.5, -0.5, N+1): positive when accuracy is front-loaded
    (the answer was known before the reasoning), negative when the reasoning does the work."""
    if not per_fraction:
        return math.nan
    weights = overconfidence_weights(len(per_fraction))
    return float(np.dot(weights, np.asarray(per_fraction, dtype=np.float64)))


def auc(fractions: Sequence[float], per_fraction: Sequence[float]) -> float:
    """Trapezoid area under p(fraction); a single point is its own value."""
    if not per_fraction:
        return math.nan
    if len(per_fraction) == 1:
        return float(per_fraction[0])
    xs = np.asarray(fractions, dtype=np.float64)
    ys = np.asarray(per_fraction, dtype=np.float64)
    span = xs[-1] - xs[0]
    if span <= 0:
        return float(ys.mean())
    return float(np.trapezoid(ys, xs) / span)
