"""Pure metric and statistics functions of `forage eval` (no I/O, no torch).

Per question the scores are the scorer's own rules (services/scorer/rewards/qa.py, Search-R1's
normalisation): EM and sub-EM ("cover EM": a normalised gold answer occurs inside the
normalised prediction) and SQuAD token F1, all on the last `<answer>...</answer>` of the
response; a response without one scores 0 on all three, as in training. A `tool_calls`
response (`--protocol tool_calls`) is read as the scorer reads it: decoded with the chat
template's special tokens kept, its answer is the last assistant turn's
(services.common.tool_calls.final_answer), never an `<answer>` quoted in a tool result.

Intervals are 95%:
- EM and sub-EM are proportions: the Wilson score interval, which stays inside [0, 1] and
  behaves at 0 and 1 and for small n, where the normal approximation does not;
- F1 is a mean of values in [0, 1]: a percentile bootstrap with a fixed seed, so the same
  scores always give the same interval (eval.json is reproducible bit for bit).

A paired comparison of two rows on the same questions uses the exact McNemar test: under the
null the discordant questions (right in one row only) split like a fair coin, so the two-sided
p-value is the binomial sign test on them; it needs no large-sample approximation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from services.scorer.rewards.qa import qa_em, qa_f1, qa_subem

Z_95 = 1.959963984540054  # the 97.5% quantile of the standard normal
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def score_response(response: str, ground_truth: Any, protocol: str = "tags") -> dict[str, float]:
    """EM, sub-EM and F1 of one decoded response, exactly as the scorer computes them.
    `protocol` "tool_calls": `response` must be decoded with special tokens kept (the turn
    markers), as the scorer's `response_text` decodes it."""
    return {"em": float(qa_em(response, ground_truth, protocol=protocol)),
            "subem": float(qa_subem(response, ground_truth, protocol=protocol)),
            "f1": float(qa_f1(response, ground_truth, protocol=protocol))}


def mean(values: Sequence[float]) -> float:
    """The mean, 0.0 for no values (an empty data source never reaches the table)."""
    return float(sum(values) / len(values)) if values else 0.0


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a proportion; (0, 1) when n is 0 (nothing is known)."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_interval(values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean, seeded so it is reproducible. Resamples are
    drawn in chunks, so a 50k-question test set needs little memory."""
    import numpy as np

    n = len(values)
    if n == 0:
        return 0.0, 1.0
    data = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    chunk = max(1, min(resamples, 4_000_000 // n))
    means: list[np.ndarray] = []
    for start in range(0, resamples, chunk):
        size = min(chunk, resamples - start)
        means.append(data[rng.integers(0, n, size=(size, n))].mean(axis=1))
    ordered = np.sort(np.concatenate(means))
    tail = (1 - level) / 2
    low = ordered[int(math.floor(tail * (resamples - 1)))]
    high = ordered[int(math.ceil((1 - tail) * (resamples - 1)))]
    return float(low), float(high)


def mcnemar_exact(a_only: int, b_only: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (right in A only, in B only):
    2 * P(X <= min) for X ~ Binomial(a_only + b_only, 1/2), capped at 1; 1.0 when none differ."""
    if a_only < 0 or b_only < 0:
        raise ValueError("discordant counts must be non-negative")
    n = a_only + b_only
    if n == 0:
        return 1.0
    k = min(a_only, b_only)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return float(min(1.0, 2 * tail))


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, float | int]:
    """Paired comparison of two rows' 0/1 scores on the same questions, in the same order."""
    if len(a) != len(b):
        raise ValueError(f"paired scores need the same questions ({len(a)} vs {len(b)})")
    a_only = sum(1 for x, y in zip(a, b, strict=True) if x >= 1 and y < 1)
    b_only = sum(1 for x, y in zip(a, b, strict=True) if y >= 1 and x < 1)
    return {"n": len(a), "a_only": a_only, "b_only": b_only,
            "difference": mean(a) - mean(b), "p_value": mcnemar_exact(a_only, b_only)}
