"""`forage score --data-source D --solution S --ground-truth G`: one reward, for debugging.

Runs in this process's main thread (math_verify's timeouts work there). Prints a JSON line
{"score": ..., "components": {...}}; exit status 2 for an unknown data source or a reward that
raised.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from services.common.cli_args import add_config_args


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-source", required=True, help="e.g. nq, countdown, synth_math")
    parser.add_argument("--solution", required=True,
                        help="the response text ('-' reads it from stdin)")
    parser.add_argument("--ground-truth", required=True,
                        help="JSON when it parses as JSON (e.g. '{\"target\": [\"Paris\"]}'), "
                             "else a plain string; text starting with {, [ or \" must be "
                             "valid JSON")
    parser.add_argument("--extra-info", default=None, help="JSON map passed as extra_info")
    # optional: a run config whose scorer.rewards table to use
    add_config_args(parser, required=False)
    parser.set_defaults(handler=_score)


def parse_ground_truth(text: str) -> Any:
    """The rule: JSON when the text parses as JSON (`{"target": ["Paris"]}`, `9`, `"1/2"`), else
    the text itself as a plain string (`Paris`, `1/2`, `\\frac{1}{2}`). Text that starts with
    `{`, `[` or `"` is meant as JSON, so if it does not parse it is an error (a quoting slip in
    the shell would otherwise be scored as a string that matches nothing). A blank value or
    JSON null is an error too: nothing can match it."""
    stripped = text.strip()
    if not stripped:
        raise ValueError("--ground-truth is empty")
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError as exc:
        if stripped[0] in "{[\"":
            raise ValueError(f"--ground-truth {_clip(text)} starts with {stripped[0]!r} but is "
                             f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        return text
    except RecursionError:
        raise ValueError(f"--ground-truth {_clip(text)} is nested too deeply") from None
    if value is None:
        raise ValueError("--ground-truth null: a ground truth cannot be null")
    return value


def parse_extra_info(text: str | None) -> dict[str, Any] | None:
    """`--extra-info` as the map verl passes reward functions: a JSON object, or None."""
    if text is None or not text.strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--extra-info {_clip(text)} is not valid JSON ({exc.msg} at column "
                         f"{exc.colno}); give a JSON object, e.g. '{{\"split\": \"test\"}}'"
                         ) from None
    except RecursionError:
        raise ValueError(f"--extra-info {_clip(text)} is nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"--extra-info must be a JSON object (a map), got "
                         f"{type(value).__name__} {_clip(text)}")
    return value


def _clip(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _score(args: argparse.Namespace) -> int:
    from services.common.cli_args import config_from_args
    from services.scorer.rewards.registry import RewardTable
    from services.scorer.scoring import Scorer

    config = config_from_args(args)
    try:
        ground_truth = parse_ground_truth(args.ground_truth)
        extra = parse_extra_info(args.extra_info)
    except ValueError as exc:
        print(f"forage score: error: {exc}", file=sys.stderr)
        return 2
    solution = sys.stdin.read() if args.solution == "-" else args.solution
    try:
        table = RewardTable(config.scorer.rewards)
    except ValueError as exc:
        print(f"forage score: error: {exc}", file=sys.stderr)
        return 2
    scorer = Scorer(table, pool=None, inner_timeout_s=max(1, int(config.scorer.math_timeout_s)))
    result = scorer.score_one(args.data_source, solution, ground_truth, extra)
    if result.error:
        print(f"forage score: error: {result.error}", file=sys.stderr)
        return 2
    print(json.dumps({
        "score": None if math.isnan(result.score) else result.score,
        "components": {k: (None if math.isnan(v) else v) for k, v in result.components.items()},
        "timeouts": result.timeouts,
    }))
    return 0
