"""`forage demo [--quick] [--out DIR] [--set k=v ...] [--fresh] [--rollouts N]`."""

from __future__ import annotations

import argparse


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="the same path at toy size (a few minutes; configs/demo_quick.yaml): "
                             "checks the plumbing, does not learn")
    parser.add_argument("--out", default=None,
                        help="output directory (default runs/demo or runs/demo-quick)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a demo config key (repeatable)")
    parser.add_argument("--fresh", action="store_true",
                        help="rebuild world, policy and SFT even if OUT already has them")
    parser.add_argument("--rollouts", type=int, default=1, help="rollout replicas (1)")
    parser.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace) -> int:
    from services.common.logs import setup_logging
    from services.launch.demo import main_entry

    setup_logging("demo", "demo", "WARNING")
    # A bad --set raises ConfigError: `forage demo: error: invalid config: ...` on stderr,
    # exit code 2, as every command (services/common/cli_errors.py).
    return main_entry(args.out, args.quick, args.overrides, args.fresh, args.rollouts)
