"""`forage data synth` holds a fixed slice of train questions out of sft.parquet and writes
good demonstrations of them to sft_heldout.parquet (issue 15): the SFT gate measures on them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.tasks.synth import heldout_indices

FORAGE = [sys.executable, "-m", "services.cli"]


def test_heldout_indices_are_a_fixed_slice() -> None:
    assert heldout_indices(636, seed=0) == heldout_indices(636, seed=0)
    assert heldout_indices(636, seed=0) != heldout_indices(636, seed=7)
    assert len(heldout_indices(636, seed=0)) == 63  # 10% when that is fewer than 64
    assert len(heldout_indices(2000, seed=0)) == 64
    assert len(heldout_indices(30, seed=0)) == 3
    assert len(heldout_indices(5, seed=0)) == 1
    assert heldout_indices(100, seed=0, count=0) == []
    assert len(heldout_indices(10, seed=0, count=50)) == 9  # never every question
    picked = heldout_indices(636, seed=3)
    assert picked == sorted(set(picked)) and all(0 <= i < 636 for i in picked)


@pytest.mark.slow  # builds a world and its retriever index (~30 s)
def test_synth_writes_disjoint_good_heldout_demonstrations(tmp_path: Path) -> None:
    from services.tasks.datasets import load_rows

    proc = subprocess.run([*FORAGE, "data", "synth", "--out", str(tmp_path), "--seed", "3",
                           "--quiet", "--sft-heldout", "40"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    train = load_rows(tmp_path / "train.parquet")
    sft = load_rows(tmp_path / "sft.parquet", kind="sft")
    held = load_rows(tmp_path / "sft_heldout.parquet", kind="sft")
    assert summary["sft"]["heldout"] == len(held) == 40
    assert len(sft) + len(held) == len(train) == summary["train_questions"]

    def question(row: dict) -> str:
        return row["prompt"][0]["content"]

    assert not {question(r) for r in held} & {question(r) for r in sft}
    expected = heldout_indices(len(train), seed=3, count=40)
    assert [r["extra_info"]["index"] for r in held] == expected
    for row, index in zip(held, expected, strict=True):
        assert question(row) == train[index]["prompt"][0]["content"]  # still an RL question
        assert row["extra_info"]["strategy"] == "good"
        assert row["extra_info"]["split"] == "heldout"
        assert row["segments"][-1]["text"].endswith(" </answer>")
    assert sum(r["extra_info"]["correct"] for r in held) >= 0.9 * len(held)
