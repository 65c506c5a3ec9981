"""The `forage` command: one sub-command group per service, nothing else.

Each group lives in its own service package (``services/<service>/cli.py``) and exposes
``register(parser)``; this module imports only the group the user named, so `forage score`
does not pay for importing torch and faiss, and services stay independent of each other.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from services.common.config import ConfigError

# group name -> (module that registers it, one-line help)
COMMAND_GROUPS: dict[str, tuple[str, str]] = {
    "demo": ("services.launch.cli_demo", "the embedded default, end to end (make demo)"),
    "up": ("services.launch.cli_up", "all services for one run, as local processes"),
    "retriever": ("services.retriever.cli", "build a search index, serve /retrieve"),
    "rollout": ("services.rollout.cli", "serve the rollout worker (agent loop + engine)"),
    "scorer": ("services.scorer.cli", "serve the scorer worker and /score"),
    "learner": ("services.learner.cli", "train (RL), SFT warm start"),
    "data": ("services.tasks.cli_data", "synthesise or convert task data"),
    "model": ("services.tasks.cli_model", "tokenizer + tiny policy for tests and the demo"),
    "score": ("services.scorer.cli_score", "score one solution, for debugging"),
    "report": ("services.launch.cli_report", "plots and a summary of a run"),
    "inspect": ("services.launch.cli_inspect", "read the trajectories a run logged"),
    "streams": ("services.launch.cli_streams", "dead-lettered messages, decoded, with reasons"),
}


def _top_level_help() -> str:
    width = max(len(name) for name in COMMAND_GROUPS)
    lines = ["usage: forage COMMAND [ARGS...]", "", "commands:"]
    for name, (_, help_text) in COMMAND_GROUPS.items():
        lines.append(f"  {name:<{width}}  {help_text}")
    lines.append("")
    lines.append("Run `forage COMMAND --help` for the options of one command.")
    return "\n".join(lines)


def build_parser(group: str) -> argparse.ArgumentParser:
    """Build the parser of one command group by importing only that group's module."""
    module_name, help_text = COMMAND_GROUPS[group]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"forage {group}", description=help_text)
    module.register(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_top_level_help())
        return 0
    group, rest = args[0], args[1:]
    if group not in COMMAND_GROUPS:
        print(f"forage: unknown command {group!r}\n\n{_top_level_help()}", file=sys.stderr)
        return 2
    try:
        parser = build_parser(group)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("services."):
            print(f"forage {group}: not built yet ({exc.name} is missing)", file=sys.stderr)
            return 3
        raise
    namespace = parser.parse_args(rest)
    handler: Callable[[argparse.Namespace], int | None] | None = getattr(namespace, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        result = handler(namespace)
    except ConfigError as exc:  # bad config or input path found at start: one line, exit 2
        print(f"forage {group}: error: {exc}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
