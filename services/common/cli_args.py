"""The `--config FILE` / `--set key=value` pair that every config-driven command shares."""

from __future__ import annotations

import argparse
import sys

from services.common.config import ConfigError, RunConfig, load_config


def add_config_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--config", required=required, help="run config (YAML)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set learner.lr=1e-6 (repeatable)",
    )


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Load the config named on the command line; exit with the error text when it is bad."""
    try:
        return load_config(getattr(args, "config", None), getattr(args, "overrides", []))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
