"""The `--config FILE ...` / `--set key=value` / bare `key=value` trio that every config-driven
command shares.

`--config` may be given several times: the files merge in order, a later one overriding keys
of an earlier one (maps merge, other values replace: services/common/config/layers.py). An
override is `--set learner.lr=1e-6` or, as verl/Hydra users type it, a bare `learner.lr=1e-6`
anywhere on the command line; overrides apply after every file, in the order given.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from services.common.config import RunConfig, is_bare_override, load_config


def add_config_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument(
        "--config",
        required=required,
        action="append",
        metavar="FILE",
        help="run config (YAML); repeat to merge several files in order, later ones winning",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set learner.lr=1e-6 (repeatable; a bare "
             "learner.lr=1e-6 works too)",
    )


def take_bare_overrides(namespace: argparse.Namespace, extras: Sequence[str],
                        argv: Sequence[str] = ()) -> list[str]:
    """Move bare `key=value` words that argparse did not recognise into `namespace.overrides`
    (for commands that take overrides) and put all overrides in command-line order (`argv`),
    so the last one given for a key wins; return the words that are still unrecognised."""
    overrides = getattr(namespace, "overrides", None)
    if not isinstance(overrides, list):
        return list(extras)
    left = []
    for word in extras:
        if is_bare_override(word):
            overrides.append(word)
        else:
            left.append(word)
    position = {}
    for index, token in reversed(list(enumerate(argv))):
        position[token.removeprefix("--set=")] = index
    overrides.sort(key=lambda override: position.get(override, len(argv)))
    return left


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Load the config named on the command line. A bad one raises ConfigError, which the
    `forage` command prints as `forage GROUP: error: invalid config: ...` and ends with exit
    code 2 (services/common/cli_errors.py)."""
    return load_config(getattr(args, "config", None), getattr(args, "overrides", []))
