"""The built-in reward functions in verl's signature, `(data_source, solution_str,
ground_truth, extra_info=None, **options)`, so built-ins and users' `module:function` rewards
are called the same way. `options` carry each rule's constants (format credit etc.)."""

from __future__ import annotations

from typing import Any

from services.scorer.rewards import countdown as _countdown
from services.scorer.rewards import gsm8k as _gsm8k
from services.scorer.rewards import math as _math
from services.scorer.rewards import qa as _qa


def qa_em(data_source: str, solution_str: str, ground_truth: Any,
          extra_info: dict | None = None, **options: Any) -> float:
    return _qa.qa_em(solution_str, ground_truth, **options)


def qa_subem(data_source: str, solution_str: str, ground_truth: Any,
             extra_info: dict | None = None, **options: Any) -> float:
    return _qa.qa_subem(solution_str, ground_truth, **options)


def qa_f1(data_source: str, solution_str: str, ground_truth: Any,
          extra_info: dict | None = None, **options: Any) -> float:
    return _qa.qa_f1(solution_str, ground_truth, **options)


def qa_em_format(data_source: str, solution_str: str, ground_truth: Any,
                 extra_info: dict | None = None, **options: Any) -> float:
    return _qa.qa_em_format(solution_str, ground_truth, **options)


def countdown(data_source: str, solution_str: str, ground_truth: Any,
              extra_info: dict | None = None, **options: Any) -> float:
    return _countdown.countdown(solution_str, ground_truth, **options)


def gsm8k(data_source: str, solution_str: str, ground_truth: Any,
          extra_info: dict | None = None, **options: Any) -> float:
    return _gsm8k.gsm8k(solution_str, ground_truth, **options)


def math_verify(data_source: str, solution_str: str, ground_truth: Any,
                extra_info: dict | None = None, **options: Any) -> float:
    return _math.math_verify_reward(solution_str, ground_truth, **options)
