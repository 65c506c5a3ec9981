"""`forage learner ...`: RL training (the stream loop) and the SFT warm start.

Heavy imports (torch, deepspeed, transformers) happen inside the handlers, so `--help` is quick.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

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

    register_train(sub)

    ops = sub.add_parser("build-ops", help="build DeepSpeed's CPU ops now (a learner on CPU "
                         "otherwise builds them at its first start, 1-2 minutes on 2 cores)")
    ops.set_defaults(handler=_build_ops)


def register_train(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="the RL stream loop (rank 0 serves weights)")
    add_config_args(train)
    train.add_argument("--resume", action="store_true",
                       help="continue from the last complete checkpoint (learner.checkpoint_dir)")
    train.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    from services.common.logs import setup_logging
    from services.learner.loop import train

    cfg = config_from_args(args)
    setup_logging("learner", cfg.run_id, cfg.log_level)
    try:
        return _ranks_lost_is_temporary("train", lambda: train(cfg, resume=args.resume))
    except ValueError as exc:  # config problems found at start-up (estimator, paths, data)
        print(f"forage learner train: error: {exc}", file=sys.stderr)
        return 2


def _sft(args: argparse.Namespace) -> int:
    from services.common.logs import setup_logging
    from services.learner.sft import run_sft

    cfg = config_from_args(args)
    setup_logging("learner", cfg.run_id, cfg.log_level)
    out = args.out or f"{cfg.run_dir}/sft"
    return _ranks_lost_is_temporary("sft", lambda: run_sft(cfg, args.data, out,
                                                          resume=args.resume))


def _build_ops(args: argparse.Namespace) -> int:
    from services.common.logs import setup_logging
    from services.learner.op_build_watch import build_cpu_ops

    setup_logging("learner", "build-ops", "INFO")
    print("building DeepSpeed's CPU ops (1-2 minutes on a small CPU the first time)", flush=True)
    for builder, seconds in build_cpu_ops():
        print(f"{builder.NAME}: ready in {seconds:.1f}s")
    return 0


def _ranks_lost_is_temporary(command: str, run: Callable[[], int]) -> int:
    """`run()`, ending with one line and exit 75 (EX_TEMPFAIL) when a collective failed
    because other ranks are gone (a node lost, a rank killed).

    Why not a traceback: on several nodes that is an expected failure, not a bug in Forage,
    and one that a restart of every node with --resume repairs, so supervisors (Kubernetes,
    `forage up`) should restart the learner, as they do for the other exit-75 failures."""
    from services.common.cli_errors import TEMPORARY_FAILURE
    from services.learner.distributed import lost_peer

    try:
        return run()
    except Exception as exc:
        message = lost_peer(exc)
        if message is None:
            raise
        print(f"forage learner {command}: error: {message}", file=sys.stderr)
        return TEMPORARY_FAILURE
