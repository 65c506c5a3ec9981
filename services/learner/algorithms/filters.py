"""Group filter: drop prompt groups whose rewards are all equal (DAPO dynamic sampling).

Such a group has zero advantage under every group-relative estimator (GRPO, RLOO, ...), so it
only dilutes the batch; the learner drops it and tops the batch up from later groups. verl's
DAPO keeps a group iff its reward std > 0 or it has a single sample (`keep_singletons=True`);
rllm's unified rejection sampling also drops groups of fewer than two (`keep_singletons=False`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence


def filter_groups(
    rewards_by_uid: Mapping[Hashable, Sequence[float]],
    *,
    keep_singletons: bool = True,
    atol: float = 0.0,
) -> list[Hashable]:
    """uids whose rewards differ (max - min > atol), in input order; empty groups are dropped.

    NaN rewards (unscorable, TRL) are left out, as they are of the estimators' baselines."""
    kept: list[Hashable] = []
    for uid, rewards in rewards_by_uid.items():
        values = [float(r) for r in rewards if not math.isnan(float(r))]
        if not values:
            continue
        if len(values) == 1:
            if keep_singletons:
                kept.append(uid)
            continue
        if max(values) - min(values) > atol:
            kept.append(uid)
    return kept
