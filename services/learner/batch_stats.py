"""Per-step metrics of a batch of scored trajectories (pure: lists in, flat dict out).

Names are the JSON-line keys of `RUN_DIR/metrics.jsonl` (docs/learner.md) and, for the probe,
TinyZero-PRM's (docs/architecture.md). "Correct" means reward >= 1, the same rule the scorer applies to
probe completions, so EM here and the probe's correct/incorrect split agree.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from services.common.probe_curve import CORRECT_THRESHOLD, overconfidence
from services.common.trajectory import FINISH_REASONS, ScoredTrajectory


def is_correct(item: ScoredTrajectory) -> bool:
    return float(item.reward) >= CORRECT_THRESHOLD


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return float(np.mean(values)) if values else 0.0


def _std(values: Iterable[float]) -> float:
    values = list(values)
    return float(np.std(values)) if values else 0.0


def trajectory_metrics(
    items: Sequence[ScoredTrajectory], current_version: int | None = None, prefix: str = ""
) -> dict[str, float]:
    """Reward / EM per data source, lengths, turns, searches, invalid actions, finish reasons,
    and (given the learner's current version) staleness = current - behaviour version."""
    if not items:
        return {}
    out: dict[str, float] = {}
    # NaN = unscorable (every reward function returned None): left out, as TRL logs rewards.
    rewards = [r for r in (float(i.reward) for i in items) if not np.isnan(r)]
    out[f"{prefix}reward/mean"] = _mean(rewards)
    out[f"{prefix}reward/std"] = _std(rewards)
    out[f"{prefix}em/mean"] = _mean(float(is_correct(i)) for i in items)
    by_source: dict[str, list[ScoredTrajectory]] = defaultdict(list)
    for item in items:
        by_source[item.trajectory.data_source].append(item)
    for source, group in sorted(by_source.items()):
        out[f"{prefix}reward/{source}/mean"] = _mean(
            float(i.reward) for i in group if not np.isnan(float(i.reward)))
        out[f"{prefix}em/{source}"] = _mean(float(is_correct(i)) for i in group)
    trajs = [i.trajectory for i in items]
    out[f"{prefix}response_length/mean"] = _mean(len(t.response_ids) for t in trajs)
    out[f"{prefix}response_length/max"] = float(max(len(t.response_ids) for t in trajs))
    out[f"{prefix}policy_tokens/mean"] = _mean(t.num_policy_tokens for t in trajs)
    out[f"{prefix}turns/mean"] = _mean(len(t.turns) for t in trajs)
    out[f"{prefix}searches/mean"] = _mean(t.num_searches for t in trajs)
    out[f"{prefix}invalid/mean"] = _mean(t.num_invalid for t in trajs)
    for reason in FINISH_REASONS:
        out[f"{prefix}finish/{reason}"] = _mean(float(t.finish_reason == reason) for t in trajs)
    if current_version is not None:
        staleness = [current_version - int(t.policy_version) for t in trajs]
        out[f"{prefix}staleness/mean"] = _mean(staleness)
        out[f"{prefix}staleness/max"] = float(max(staleness))
    return out


def pass_at_samples(questions: Sequence[Sequence[ScoredTrajectory]], prefix: str = "eval/"
                    ) -> dict[str, float]:
    """`pass@k` for questions sampled k times each: the share of questions that at least one
    of their samples answered exactly (verl's best@k with every sample drawn), overall and per
    data source. The mean over samples (mean@k) is `em/mean` of the flattened samples."""
    questions = [q for q in questions if q]
    if not questions:
        return {}
    k = max(len(q) for q in questions)
    solved = [(q[0].trajectory.data_source, any(is_correct(i) for i in q)) for q in questions]
    out = {f"{prefix}pass@{k}": _mean(float(hit) for _, hit in solved)}
    by_source: dict[str, list[bool]] = defaultdict(list)
    for source, hit in solved:
        by_source[source].append(hit)
    for source, hits in sorted(by_source.items()):
        out[f"{prefix}pass@{k}/{source}"] = _mean(float(hit) for hit in hits)
    return out


def generated_metrics(trained: Sequence[ScoredTrajectory],
                      filtered: Sequence[ScoredTrajectory]) -> dict[str, float]:
    """`generated/*`: what the policy played since the last step, the groups it trains plus
    those the group filter dropped (all samples scored the same).

    A filtered batch's own `reward/mean` is biased towards the middle (every group it keeps
    has a spread), so it cannot show the policy improving; these can. Reward, EM and searches,
    overall and per data source, with the group counts behind them."""
    items = list(trained) + list(filtered)
    found = trajectory_metrics(items, prefix="generated/")
    keep = ("generated/reward/", "generated/em/", "generated/searches/mean")
    out = {k: v for k, v in found.items() if k.startswith(keep)}
    for source, count in Counter(i.trajectory.data_source for i in items).items():
        out[f"generated/n/{source}"] = float(count)
    out["generated/trajectories"] = float(len(items))
    out["generated/filtered_trajectories"] = float(len(filtered))
    return out


def _curve_metrics(split: str, fractions: Sequence[float], curves: list[list[float]]
                   ) -> dict[str, float]:
    if not curves:
        return {}
    curve = np.mean(np.asarray(curves, dtype=np.float64), axis=0)
    out = {f"probe_{split}/score_at_{f:.2f}": float(v) for f, v in zip(fractions, curve,
                                                                        strict=True)}
    out[f"probe_{split}/mean_score"] = float(curve.mean())
    out[f"probe_{split}/overconf"] = float(overconfidence(curve.tolist()))
    return out


def probe_metrics(items: Sequence[ScoredTrajectory]) -> dict[str, float]:
    """The probe curve (accuracy vs fraction of reasoning seen) over probed trajectories, for
    all / correct / incorrect ones, with overconfidence; {} when nothing in the batch was probed.
    Trajectories probed on a different fraction grid than the first one are left out."""
    out = evidence_metrics(items)
    probed = [i for i in items if i.probe_scores is not None and i.trajectory.probe is not None]
    if not probed:
        return out
    fractions = list(probed[0].trajectory.probe.fractions)
    probed = [i for i in probed if list(i.trajectory.probe.fractions) == fractions
              and len(i.probe_scores) == len(fractions)]
    correct = [list(map(float, i.probe_scores)) for i in probed if is_correct(i)]
    incorrect = [list(map(float, i.probe_scores)) for i in probed if not is_correct(i)]
    out.update(_curve_metrics("all", fractions, correct + incorrect))
    out.update(_curve_metrics("correct", fractions, correct))
    out.update(_curve_metrics("incorrect", fractions, incorrect))
    out["probe_all/n_correct"] = float(len(correct))
    out["probe_all/n_incorrect"] = float(len(incorrect))
    return out


def overconfidence_per_row(items: Sequence[ScoredTrajectory]) -> list[float | None]:
    """Each trajectory's overconfidence (None when it was not probed), for probe shaping."""
    out: list[float | None] = []
    for item in items:
        if item.probe_scores:
            out.append(float(overconfidence([float(s) for s in item.probe_scores])))
        else:
            out.append(None)
    return out


def evidence_metrics(items: Sequence[ScoredTrajectory]) -> dict[str, float]:
    """The evidence-reliance probe over the batch's probed trajectories (probe.evidence;
    docs/probe.md): mean EM of the real answer and of the `none` / `swapped` rewrites, the
    mean gap real - swapped (over those with a swapped variant), and how many were probed;
    {} when none was."""
    probed = [i.evidence_scores for i in items if i.evidence_scores]
    if not probed:
        return {}
    out = {"probe/evidence_count": float(len(probed)),
           "probe/evidence_real_em": _mean(e["real"] for e in probed if "real" in e)}
    for variant in ("none", "swapped"):
        values = [e[variant] for e in probed if variant in e]
        if values:
            out[f"probe/evidence_{variant}_em"] = _mean(values)
    gaps = [e["gap"] for e in probed if "gap" in e]
    if gaps:
        out["probe/evidence_gap"] = _mean(gaps)
        out["probe/evidence_swapped_count"] = float(len(gaps))
    return out


def memory_answers(items: Sequence[ScoredTrajectory]) -> list[float | None]:
    """Per trajectory, for probe.evidence.coeff: 1 when its own answer is right and survives
    swapped evidence (EM(real) * EM(swapped): answered from memory, not from what it read),
    a fraction with several rewrites, 0 when it relies on its evidence or is wrong; None when
    no swapped variant was scored."""
    out: list[float | None] = []
    for item in items:
        e = item.evidence_scores
        out.append(float(e["real"]) * float(e["swapped"])
                   if e and "real" in e and "swapped" in e else None)
    return out
