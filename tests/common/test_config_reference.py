"""docs/config.md is generated from the config classes (services/common/config_reference.py):
it must be current, complete (every key has a meaning) and its "read by" claims must name code
that mentions the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.cli import main
from services.common.config import RunConfig
from services.common.config_reference import READER_COMMANDS, render, rows

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "config.md"
# Reader label -> the package whose sources read the key (services/common serves them all).
PACKAGES = {"retriever": "retriever", "rollout": "rollout", "scorer": "scorer",
            "learner": "learner", "up": "launch", "eval": "eval", "data": "tasks"}


def all_rows():
    out = []
    for name, field in RunConfig.model_fields.items():
        section = field.annotation
        if isinstance(section, type) and hasattr(section, "model_fields"):
            out.extend(rows(section, name + "."))
    return out


def test_docs_config_md_is_current() -> None:
    assert PAGE.read_text() == render(RunConfig), (
        "docs/config.md is out of date with services/common/config/*.py: regenerate it with "
        "`forage config reference > docs/config.md`")


def test_every_key_has_a_meaning() -> None:
    missing = [row.key for row in all_rows() if not row.meaning.strip()]
    assert not missing, ("config keys without a meaning: give each a one-line comment on its "
                         f"line (or the line above) in services/common/config/: {missing}")


def test_reader_claims_name_code_that_mentions_the_key() -> None:
    assert set(PACKAGES) == set(READER_COMMANDS)
    sources = {label: "\n".join(p.read_text() for p in (REPO / "services" / pkg).rglob("*.py"))
               for label, pkg in PACKAGES.items()}
    # services/common, the config classes' own methods (sft_step_budget) included
    common = "\n".join(p.read_text() for p in (REPO / "services" / "common").rglob("*.py")
                       if p.name != "config_reference.py")
    wrong = []
    for row in all_rows():
        name = re.sub(r"\[\]|\.<[^>]+>", "", row.key).split(".")[-1]
        said = re.compile(rf"[.\"']{re.escape(name)}\b")
        for reader in row.readers:
            if not (said.search(sources[reader]) or said.search(common)):
                wrong.append(f"{row.key}: {reader}")
    assert not wrong, f"docs/config.md says these read a key their code never names: {wrong}"


def test_reference_command_checks_a_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    stale = tmp_path / "config.md"
    stale.write_text("# old\n")
    assert main(["config", "reference", "--check", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert main(["config", "reference", "--check", str(PAGE)]) == 0
