"""The `forage` command's manners: --version, "did you mean" for sub-commands and options, and a
help text for every flag of every sub-command."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version

import pytest

from services.cli import COMMAND_GROUPS, build_parser

FORAGE = [sys.executable, "-m", "services.cli"]


def forage(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FORAGE, *args], capture_output=True, text=True, timeout=120)


def test_version() -> None:
    for flag in ("--version", "-V"):
        done = forage(flag)
        assert done.returncode == 0
        assert done.stdout.startswith(f"forage {version('forage')} (python ")


@pytest.mark.parametrize(("args", "hint"), [
    (["lerner", "train"], "unknown command 'lerner' (did you mean learner?)"),
    (["data", "chek", "x.parquet"], "invalid choice: 'chek' (choose from "),
    (["data", "chek", "x.parquet"], "(did you mean check?)"),
    (["retriever", "srve"], "(did you mean serve?)"),
    (["up", "--confg", "x.yaml"], "required: --config (did you mean --config?)"),
    (["report", "runs/x", "--smothing", "0.5"], "unrecognized arguments: --smothing 0.5 "
                                                "(did you mean --smoothing?)"),
])
def test_did_you_mean(args: list[str], hint: str) -> None:
    done = forage(*args)
    assert done.returncode == 2
    assert hint in done.stderr


def _walk(parser: argparse.ArgumentParser, name: str):
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for sub_name, sub in action.choices.items():
                yield f"{name} {sub_name}", helps.get(sub_name)
                yield from _walk(sub, f"{name} {sub_name}")
            continue
        yield f"{name} {'/'.join(action.option_strings) or action.dest}", action.help


def test_every_flag_and_sub_command_has_help() -> None:
    missing = []
    for group in COMMAND_GROUPS:
        for where, text in _walk(build_parser(group), f"forage {group}"):
            if not text or text == argparse.SUPPRESS or not text.strip():
                missing.append(where)
    assert not missing, f"no help text: {missing}"
