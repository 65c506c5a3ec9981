"""The SFT skill gate's rules (issue 15): which skills exist, when thresholds are reached and
how a measurement reads in a log line. Shared by the SFT loop (services/learner/sft.py, which
measures the skills in services/learner/sft_skills.py) and `forage demo`'s console line
(services/launch/demo.py), which may not import the learner."""

from __future__ import annotations

from collections.abc import Mapping

SKILLS: tuple[str, ...] = ("format", "first_query", "query", "answer")


def reached(skills: Mapping[str, float], thresholds: Mapping[str, float]) -> bool:
    """Every thresholded skill measured and at or above its threshold."""
    return all(skill in skills and skills[skill] >= need for skill, need in thresholds.items())


def describe(skills: Mapping[str, float], thresholds: Mapping[str, float] | None = None) -> str:
    """`format 1.00, query 0.88, answer 0.84` (+ ` (thresholds 0.95 / 0.80 / 0.80)`)."""
    order = [s for s in SKILLS if s in skills or (thresholds and s in thresholds)]
    if thresholds:
        order = [s for s in order if s in thresholds] + [
            s for s in order if s not in thresholds]
    text = ", ".join(f"{s} {skills[s]:.2f}" if s in skills else f"{s} n/a" for s in order)
    if thresholds:
        text += " (thresholds " + " / ".join(
            f"{thresholds[s]:.2f}" for s in order if s in thresholds) + ")"
    return text


def shortfall(skills: Mapping[str, float], thresholds: Mapping[str, float]) -> str:
    """`query 0.41 < 0.80, answer 0.30 < 0.80`: the skills below their thresholds."""
    parts = [f"{s} {skills[s]:.2f} < {need:.2f}" if s in skills else f"{s} not measured"
             for s, need in thresholds.items() if not (s in skills and skills[s] >= need)]
    return ", ".join(parts)


def check_thresholds(thresholds: Mapping[str, float]) -> None:
    """Unknown skill names or values outside [0, 1] raise ValueError naming them."""
    unknown = sorted(set(thresholds) - set(SKILLS))
    if unknown:
        raise ValueError(f"learner.sft_until: unknown skills {unknown}; known: {list(SKILLS)}")
    bad = {k: v for k, v in thresholds.items() if not 0 <= float(v) <= 1}
    if bad:
        raise ValueError(f"learner.sft_until: thresholds must be in [0, 1], got {bad}")

