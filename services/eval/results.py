"""The output directory of `forage eval`: its config, the per-question lines, resume.

OUT/config.json    what was asked (models by fingerprint, data by checksum, modes, settings);
                   a rerun with anything different is refused: results of two configs never mix.
OUT/samples.jsonl  one line per (row, question), appended as each question finishes: the scores
                   and the decoded trajectory in the learner's samples format, so
                   `forage inspect OUT` reads it (its `step` is the row's number in the table).
                   A rerun skips the (row, question) pairs already there; a half-written last
                   line (a killed run) is dropped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
SAMPLES_FILE = "samples.jsonl"


class ConfigMismatch(ValueError):
    """OUT holds an evaluation with another config."""


def _differences(old: Any, new: Any, where: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(set(old) | set(new)):
            found.extend(_differences(old.get(key), new.get(key), f"{where}.{key}".lstrip(".")))
        return found
    return [] if old == new else [f"{where or 'config'}: {old!r} -> {new!r}"]


def check_config(out: Path, config: dict[str, Any]) -> bool:
    """Write OUT/config.json, or check it equals `config`; True when resuming."""
    path = out / CONFIG_FILE
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            raise ConfigMismatch(f"{path} is not JSON; use a new --out") from None
        diffs = _differences(old, config)
        if diffs:
            raise ConfigMismatch(
                f"{out} holds an evaluation with another config ({'; '.join(diffs[:4])}"
                f"{'; ...' if len(diffs) > 4 else ''}); use a new --out, or the same options "
                "to resume it")
        return True
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return False


def read_samples(out: Path) -> list[dict[str, Any]]:
    """The finished lines; a garbled line (the last one of a killed run) is dropped from the
    file so the next append starts on a clean line."""
    path = out / SAMPLES_FILE
    if not path.is_file():
        return []
    rows, bad = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(row, dict) and "row" in row and "qid" in row:
            rows.append(row)
        else:
            bad += 1
    if bad:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                       encoding="utf-8")
        os.replace(tmp, path)
    return rows


class SampleWriter:
    """Appends one line per finished question, flushed at once (the resume point)."""

    def __init__(self, out: Path) -> None:
        self._handle = (out / SAMPLES_FILE).open("a", encoding="utf-8")

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            self._handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()
