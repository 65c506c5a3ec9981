"""`forage up --config FILE [--set k=v ...] [--rollouts N]`."""

from __future__ import annotations

import argparse

from services.common.cli_args import add_config_args, config_from_args


def register(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)
    parser.add_argument("--rollouts", type=int, default=1, help="rollout replicas (1)")
    parser.set_defaults(handler=_up)


def _up(args: argparse.Namespace) -> int:
    from services.common.logs import setup_logging
    from services.launch.progress import MetricsFollower
    from services.launch.up import run_up

    cfg = config_from_args(args)
    setup_logging("launch", cfg.run_id, cfg.log_level)
    if args.rollouts < 1:
        raise SystemExit("forage up: --rollouts must be at least 1")
    follower = MetricsFollower(f"{cfg.run_dir}/metrics.jsonl",
                               total_steps=cfg.learner.total_steps)
    return run_up(cfg, rollouts=args.rollouts, on_tick=lambda _sup: follower.poll())
