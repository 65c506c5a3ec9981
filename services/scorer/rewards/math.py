"""`\\boxed{}` answers checked with math_verify (gold first: `verify` is asymmetric).

math_verify bounds its parse/verify steps with SIGALRM, which only works on a process's main
thread; on any other thread it raises, and verl's wrapper turned that into a silent 0 for every
sample. So: `math_verify_reward` refuses to run off the main thread (the scorer runs it in its
worker-process pool, services.scorer.pool, which also puts a killable wall-clock limit around
C-level work SIGALRM cannot interrupt), and a math_verify timeout raises `RewardTimeout` instead
of returning 0, so every timeout is counted.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any

# Seconds math_verify may spend in each parse/verify step (SIGALRM takes whole seconds).
DEFAULT_INNER_TIMEOUT_S = 2


class RewardTimeout(Exception):
    """A reward function ran out of time; the scorer scores it 0 and counts it."""


@lru_cache(maxsize=1)
def _math_verify() -> Any:
    import math_verify  # heavy (sympy); imported on first use only

    return math_verify


def gold_latex(ground_truth: object) -> str:
    """The gold as LaTeX math_verify can anchor on: bare answers are wrapped in `\\boxed{}`."""
    if isinstance(ground_truth, dict) and "target" in ground_truth:
        ground_truth = ground_truth["target"]
    if isinstance(ground_truth, list | tuple):
        if not ground_truth:
            raise ValueError("math ground truth is an empty list")
        ground_truth = ground_truth[0]
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, str | int | float):
        raise ValueError(f"math ground truth must be a string or number, "
                         f"got {type(ground_truth).__name__}")
    text = str(ground_truth).strip()
    if "\\boxed" in text or "$" in text or "\\[" in text:
        return text
    return "\\boxed{" + text + "}"


def math_verify_reward(solution_str: str, ground_truth: object,
                       timeout_s: int = DEFAULT_INNER_TIMEOUT_S) -> float:
    """1.0 when the response's answer equals the gold under math_verify, else 0.0."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "math_verify needs the main thread (SIGALRM timeouts); score math through the "
            "scorer's process pool (services.scorer.pool.RewardPool)"
        )
    mv = _math_verify()
    timeout_s = max(1, int(timeout_s))
    gold_text = gold_latex(ground_truth)
    try:
        gold = mv.parse(gold_text, extraction_config=[mv.LatexExtractionConfig()],
                        parsing_timeout=timeout_s, raise_on_error=True)
    except mv.errors.TimeoutException as exc:  # a BaseException in math_verify
        raise RewardTimeout(f"math_verify timed out parsing the gold ({timeout_s}s)") from exc
    except Exception as exc:
        raise ValueError(f"math_verify cannot parse the gold answer {gold_text!r}: {exc}") from None
    if not gold:
        raise ValueError(f"math_verify cannot parse the gold answer {gold_text!r}")
    try:
        prediction = mv.parse(
            solution_str,
            extraction_config=[mv.ExprExtractionConfig(), mv.LatexExtractionConfig()],
            parsing_timeout=timeout_s,
            raise_on_error=True,
        )
        if not prediction:
            return 0.0
        equal = mv.verify(gold, prediction, timeout_seconds=timeout_s, raise_on_error=True)
    except mv.errors.TimeoutException as exc:
        raise RewardTimeout(f"math_verify timed out after {timeout_s}s") from exc
    except Exception:
        # sympy failing on an odd prediction means it is not the gold: 0, as upstream does.
        return 0.0
    return 1.0 if equal else 0.0


def warm_up() -> None:
    """Import math_verify and run it once, so a worker's first real item is not slow."""
    math_verify_reward("\\boxed{1}", "1")
