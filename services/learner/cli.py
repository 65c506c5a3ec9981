"""`forage learner ...`: RL training (the stream loop) and the SFT warm start.

Heavy imports (torch, deepspeed, transformers) happen inside the handlers, so `--help` is quick.
"""

from __future__ import annotations

import argparse

from services.common.cli_args import add_config_args, config_from_args


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command")

    sft = sub.add_parser("sft", help="supervised warm start on demonstration rows (parquet)")
    add_config_args(sft)
    sft.add_argument("--data", required=True, help="SFT parquet: prompt, segments")
    sft.add_argument("--out", default=None, help="output dir (default: RUN_DIR/sft)")
    sft.add_argument("--resume", action="store_true",
                     help="continue from the last complete checkpoint under OUT/checkpoints")
    sft.set_defaults(handler=_sft)

    # `forage learner train --config FILE [--resume]`: the RL stream loop, added here by the
    # loop's module (it builds on services.learner.trainer.PolicyTrainer and .checkpoint).
    register_train(sub)


def register_train(sub: argparse._SubParsersAction) -> None:
    """Place for the `train` sub-command (the RL loop); not built in this module yet."""
    return None


def _sft(args: argparse.Namespace) -> int:
    from services.common.logs import setup_logging
    from services.learner.sft import run_sft

    cfg = config_from_args(args)
    setup_logging("learner", cfg.run_id, cfg.log_level)
    out = args.out or f"{cfg.run_dir}/sft"
    return run_sft(cfg, args.data, out, resume=args.resume)
