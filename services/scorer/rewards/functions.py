"""The built-in reward functions in verl's signature, `(data_source, solution_str,
ground_truth, extra_info=None, **options)`, so built-ins and users' `module:function` rewards
are called the same way. `options` carry each rule's constants (format credit etc.)."""

from __future__ import annotations

from typing import Any

from services.common.tool_calls import specs_from_schemas
from services.common.tools import tool_specs
from services.scorer.rewards import countdown as _countdown
from services.scorer.rewards import gsm8k as _gsm8k
from services.scorer.rewards import math as _math
from services.scorer.rewards import qa as _qa


def _protocol(extra_info: dict | None, options: dict[str, Any]) -> dict[str, Any]:
    """The QA rewards' protocol: the `protocol` option, else `extra_info["protocol"]` (the
    scorer service sets it from the trajectory), else "tags"."""
    if "protocol" not in options:
        protocol = (extra_info or {}).get("protocol") or "tags"
        options = {**options, "protocol": protocol}
    return options


def _tools(extra_info: dict | None, options: dict[str, Any]) -> dict[str, Any]:
    """qa_em_format's tool set for tool_calls: the `tools` option (built-in names), else
    `extra_info["tool_specs"]` ({name: argument schema}, the run's rollout.tools as the scorer
    service passes them; `extra_info["tool_specs_open"]` when MCP servers add tools it cannot
    see), else the built-ins."""
    options = dict(options)
    names = options.pop("tools", None)
    info = extra_info or {}
    if names is not None:
        options["tools"] = tool_specs(list(names))
    elif isinstance(info.get("tool_specs"), dict):
        options["tools"] = specs_from_schemas(info["tool_specs"])
        options.setdefault("open_tool_names", bool(info.get("tool_specs_open")))
    return options


def qa_em(data_source: str, solution_str: str, ground_truth: Any,
          extra_info: dict | None = None, **options: Any) -> float:
    return _qa.qa_em(solution_str, ground_truth, **_protocol(extra_info, options))


def qa_subem(data_source: str, solution_str: str, ground_truth: Any,
             extra_info: dict | None = None, **options: Any) -> float:
    return _qa.qa_subem(solution_str, ground_truth, **_protocol(extra_info, options))


def qa_f1(data_source: str, solution_str: str, ground_truth: Any,
          extra_info: dict | None = None, **options: Any) -> float:
    return _qa.qa_f1(solution_str, ground_truth, **_protocol(extra_info, options))


def qa_em_format(data_source: str, solution_str: str, ground_truth: Any,
                 extra_info: dict | None = None, **options: Any) -> float:
    options = _tools(extra_info, _protocol(extra_info, options))
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
