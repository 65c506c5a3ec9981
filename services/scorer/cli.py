"""`forage scorer serve --config FILE [--set key=value ...]`."""

from __future__ import annotations

import argparse

from services.common.cli_args import add_config_args, config_from_args


def register(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="score the rollouts stream into the scored stream; POST /score",
        description="Consume {ns}:rollouts in group `scorer`, write {ns}:scored.",
    )
    add_config_args(serve)
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from services.scorer.worker import serve

    return serve(config_from_args(args))
