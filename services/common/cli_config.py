"""`forage config show --config FILE [--config FILE ...] [key=value ...]`: the merged config.
`forage config reference [--check FILE]`: docs/config.md, every key generated from the classes.

What every service of the run would read after the files are merged and the overrides applied
(Hydra's `--cfg job`), validated: a bad key exits 2 with the error naming it and its source.
`--sources` adds, per key set by a file, an override or the environment, where it came from.
Secrets are shown as `***` (tokens, passwords, header values, a URL's password:
services/common/redact.py).
"""

from __future__ import annotations

import argparse

import yaml

from services.common.cli_args import add_config_args, config_from_args


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command")
    show = sub.add_parser("show", help="print the merged, validated config as YAML")
    add_config_args(show, required=False)
    show.add_argument("--sources", action="store_true",
                      help="list where each set key came from (file, command line, environment)")
    show.set_defaults(handler=_show)
    reference = sub.add_parser("reference", help="every config key with its type, default, "
                                                 "readers and meaning (docs/config.md)")
    reference.add_argument("--check", metavar="FILE",
                           help="exit 1 when FILE differs from the generated reference")
    reference.set_defaults(handler=_reference)


def _show(args: argparse.Namespace) -> int:
    from services.common.config import load_config_layers
    from services.common.redact import redact

    cfg = config_from_args(args)
    print(yaml.safe_dump(redact(cfg.model_dump(mode="json")), sort_keys=False), end="")
    if args.sources:
        print("# sources:")
        for key, source in load_config_layers(args.config, args.overrides).items():
            print(f"#   {key}: {source}")
    return 0


def _reference(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from services.common.config import RunConfig
    from services.common.config_reference import render

    page = render(RunConfig)
    if not args.check:
        print(page, end="")
        return 0
    path = Path(args.check)
    if path.is_file() and path.read_text() == page:
        return 0
    print(f"forage config reference: {path} is out of date; regenerate it: "
          f"forage config reference > {path}", file=sys.stderr)
    return 1
