"""The `forage` command: one sub-command group per service, nothing else.

Each group lives in its own service package (``services/<service>/cli.py``) and exposes
``register(parser)``; this module imports only the group the user named, so `forage score`
does not pay for importing torch and faiss, and services stay independent of each other.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import signal
import sys
from collections.abc import Callable, Iterable, Sequence

from services.common.cli_args import take_bare_overrides
from services.common.cli_errors import report_failure
from services.common.config import RunConfig, register_subsection
from services.common.threads import ThreadSettingError, apply_thread_policy

# `learner.algorithm` is a free-form map typed by the learner's algorithms package; checking it
# whenever any command loads a config makes a typo there fail at `forage up`, not minutes later
# when the learner starts. Registered by name here, the composition root, because
# services/common imports no service (services/common/config/subsections.py).
register_subsection("learner.algorithm", "services.learner.algorithms.config:AlgorithmSettings")

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
    "eval": ("services.eval.cli", "Search-R1's evaluation: EM/F1 per dataset, direct/rag/agent"),
    "streams": ("services.launch.cli_streams", "dead-lettered messages, decoded, with reasons"),
    "config": ("services.common.cli_config", "the merged config of --config files + overrides"),
    "redis": ("services.common.cli_redis", "Redis ACL users per role and their passwords"),
    "tls": ("services.common.cli_tls", "the certificates of the deploy files' TLS"),
    "doctor": ("services.common.cli_doctor", "check this node's driver, CUDA, torch, vLLM, faiss"),
    "plan": ("services.common.cli_plan", "GPU and host memory per service: will it fit"),
}


def _top_level_help() -> str:
    width = max(len(name) for name in COMMAND_GROUPS)
    lines = ["usage: forage COMMAND [ARGS...]", "", "commands:"]
    for name, (_, help_text) in COMMAND_GROUPS.items():
        lines.append(f"  {name:<{width}}  {help_text}")
    lines.append("")
    lines.append("Run `forage COMMAND --help` for the options of one command; "
                 "`forage --version` prints the version.")
    return "\n".join(lines)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        number = package_version("forage")
    except PackageNotFoundError:  # run from a checkout that was never installed
        number = "unknown (not installed)"
    return f"forage {number} (python {sys.version.split()[0]})"


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest of `choices`, or ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


class ForageParser(argparse.ArgumentParser):
    """argparse with "did you mean" for a mistyped sub-command, option or override section;
    sub-parsers made with add_subparsers() are of this class too."""

    argv: Sequence[str] = ()  # the words being parsed, for hints on errors argparse raises

    def error(self, message: str) -> None:  # type: ignore[override]
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            message += did_you_mean(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
        elif "arguments are required" in message:  # often a mistyped option: `--confg`
            known = set(_option_strings(self))
            message += "".join(_hint(self, word) for word in ForageParser.argv
                               if word.startswith("--") and word.split("=")[0] not in known)
        super().error(message)

    def reject(self, words: Sequence[str]) -> None:
        """The unrecognised-arguments error, with a suggestion for each word."""
        hints = [_hint(self, word) for word in words]
        super().error(f"unrecognized arguments: {' '.join(words)}{''.join(hints)}")


def _hint(parser: argparse.ArgumentParser, word: str) -> str:
    if word.startswith("-"):
        return did_you_mean(word.split("=", 1)[0], _option_strings(parser))
    head = word.split("=", 1)[0].lstrip("+").split(".", 1)
    if "=" in word and len(head) == 2:  # an override whose section is mistyped
        close = difflib.get_close_matches(head[0], list(RunConfig.model_fields), n=1)
        if close:
            return f" (did you mean {close[0]}.{word.split('.', 1)[1]}?)"
    return ""


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    found = []
    for action in parser._actions:
        found.extend(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.extend(_option_strings(sub))
    return found


def build_parser(group: str) -> ForageParser:
    """Build the parser of one command group by importing only that group's module."""
    module_name, help_text = COMMAND_GROUPS[group]
    module = importlib.import_module(module_name)
    parser = ForageParser(prog=f"forage {group}", description=help_text)
    module.register(parser)
    return parser


def _reader_went_away() -> int:
    """stdout's reader closed the pipe (`forage doctor --json | head`): stop quietly, with the
    status a process killed by SIGPIPE has (`yes | head`), and point stdout at /dev/null so the
    interpreter's last flush does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_top_level_help())
        return 0
    if args[0] in ("-V", "--version"):
        print(version())
        return 0
    group, rest = args[0], args[1:]
    if group not in COMMAND_GROUPS:
        hint = did_you_mean(group, COMMAND_GROUPS)
        print(f"forage: unknown command {group!r}{hint}\n\n{_top_level_help()}", file=sys.stderr)
        return 2
    try:  # before any group imports torch or faiss: libgomp reads its variables at load
        apply_thread_policy()
    except ThreadSettingError as exc:
        print(f"forage {group}: error: {exc}", file=sys.stderr)
        return 2
    try:
        parser = build_parser(group)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("services."):
            print(f"forage {group}: not built yet ({exc.name} is missing)", file=sys.stderr)
            return 3
        raise
    ForageParser.argv = rest
    namespace, extras = parser.parse_known_args(rest)
    unknown = take_bare_overrides(namespace, extras, rest)  # `learner.lr=1e-6`, Hydra style
    if unknown:
        parser.reject(unknown)
    handler: Callable[[argparse.Namespace], int | None] | None = getattr(namespace, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        result = handler(namespace)
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
    except KeyboardInterrupt:
        print(f"forage {group}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _reader_went_away()
    except Exception as exc:  # one line for an expected failure, a traceback for a bug
        return report_failure(group, exc)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
