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


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-source", required=True, help="e.g. nq, countdown, synth_math")
    parser.add_argument("--solution", required=True,
                        help="the response text ('-' reads it from stdin)")
    parser.add_argument("--ground-truth", required=True,
                        help="JSON when it parses as JSON (e.g. '{\"target\": [\"Paris\"]}'), "
                             "else a plain string")
    parser.add_argument("--extra-info", default=None, help="JSON map passed as extra_info")
    parser.add_argument("--config", default=None,
                        help="run config whose scorer.rewards table to use (optional)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config key (repeatable)")
    parser.set_defaults(handler=_score)


def parse_ground_truth(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _score(args: argparse.Namespace) -> int:
    from services.common.cli_args import config_from_args
    from services.scorer.rewards.registry import RewardTable
    from services.scorer.scoring import Scorer

    config = config_from_args(args)
    solution = sys.stdin.read() if args.solution == "-" else args.solution
    extra = json.loads(args.extra_info) if args.extra_info else None
    try:
        table = RewardTable(config.scorer.rewards)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    scorer = Scorer(table, pool=None, inner_timeout_s=max(1, int(config.scorer.math_timeout_s)))
    result = scorer.score_one(args.data_source, solution, parse_ground_truth(args.ground_truth),
                              extra)
    if result.error:
        print(f"error: {result.error}", file=sys.stderr)
        return 2
    print(json.dumps({
        "score": None if math.isnan(result.score) else result.score,
        "components": {k: (None if math.isnan(v) else v) for k, v in result.components.items()},
        "timeouts": result.timeouts,
    }))
    return 0
