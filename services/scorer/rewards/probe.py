"""Faithfulness-probe scoring (docs/architecture.md): accuracy of forced answers per truncation.

Each completion is scored as `suffix + completion` (the suffix opened the answer markup, e.g.
`<answer>` or `\\boxed{`, so the completion alone would not parse) with format credit 0, and
counts as correct when its score is >= 1 (TinyZero-PRM's rule). Per fraction k:
p_k = correct / samples. AUC is the trapezoid area of p over the fraction grid; overconfidence
is sum_k w_k p_k with w = linspace(0.5, -0.5, N+1): positive when accuracy is front-loaded
(the answer was known before the reasoning), negative when the reasoning does the work, 0 for
a flat curve.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.formats import probe_suffix
from services.common.probe_curve import (  # noqa: F401 (this module's public names)
    CORRECT_THRESHOLD,
    auc,
    overconfidence,
    overconfidence_weights,
)
from services.common.trajectory import Probe


@dataclass
class ProbeScores:
    per_fraction: list[float]
    auc: float
    overconfidence: float


def default_suffix(data_source: str, override: str | None = None) -> str:
    """The probe suffix for a data source: the one rule the rollout side also uses."""
    return probe_suffix(data_source, override)


def summarize(fractions: Sequence[float], scores: Sequence[Sequence[float]]) -> ProbeScores:
    """ProbeScores from the per-sample scores at each fraction (a fraction with no samples
    gives NaN, which propagates to AUC and overconfidence)."""
    per_fraction = [
        (sum(1 for s in group if s >= CORRECT_THRESHOLD) / len(group)) if group else math.nan
        for group in scores
    ]
    return ProbeScores(per_fraction, auc(fractions, per_fraction), overconfidence(per_fraction))


def probe_texts(probe: Probe, suffix: str) -> list[list[str]]:
    return [[suffix + completion for completion in group] for group in probe.samples]


ScoreMany = Callable[[str, list[str], Any], list[float]]


def score_probe(data_source: str, probe: Probe, ground_truth: Any, suffix: str | None = None,
                *, score_many: ScoreMany | None = None) -> ProbeScores:
    """Score every probe completion with the data source's reward, format credit 0.

    `score_many(data_source, texts, ground_truth) -> scores` lets the service route the work
    through its process pool; by default the rewards run in this process.
    """
    if len(probe.samples) != len(probe.fractions):
        raise ValueError("probe.samples must hold one list per fraction")
    texts = probe_texts(probe, default_suffix(data_source, suffix))
    flat = [text for group in texts for text in group]
    scores = (score_many or _score_in_process)(data_source, flat, ground_truth)
    grouped: list[list[float]] = []
    position = 0
    for group in texts:
        grouped.append(list(scores[position : position + len(group)]))
        position += len(group)
    return summarize(probe.fractions, grouped)


def _score_in_process(data_source: str, texts: list[str], ground_truth: Any) -> list[float]:
    from services.scorer.rewards import call_component, default_table
    from services.scorer.rewards.registry import combine

    components = default_table().components(data_source)
    results = []
    for text in texts:
        values = [call_component(c, data_source, text, ground_truth, None, for_probe=True)
                  for c in components]
        results.append(combine(components, values)[0])
    return results
