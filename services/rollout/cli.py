"""`forage rollout serve --config FILE [--set k=v ...]`."""

from __future__ import annotations

import argparse

from services.common.cli_args import add_config_args, config_from_args


def register(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="command")
    serve = commands.add_parser("serve", help="consume prompt groups, publish trajectories")
    add_config_args(serve)
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from services.rollout.worker import serve

    return serve(config_from_args(args))
