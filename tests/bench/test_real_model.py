"""bench/real_model.py end to end at toy size: the imported SmolLM2, a synthetic world, a real
retriever process, the agent loop; the report's fields and the last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_zero_shot_bench_reports_the_recipe_figures(smollm2_dir, tmp_path):
    out = tmp_path / "bench"
    out.mkdir()
    # the session's import is reused (same source file): the bench does not import again
    (out / "smollm2-135m-instruct").symlink_to(smollm2_dir)
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "real_model.py"), "--out", str(out),
         "--questions", "3", "--max-turns", "1", "--tokens-per-turn", "16", "--batch", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("zero_shot_em: ")
    result = json.loads((out / "zero_shot.json").read_text())
    assert result["questions"] == 3 and 0.0 <= result["em"] <= 1.0
    assert sum(result["finish_reasons"].values()) == 3
    assert result["response_tokens_per_question"] > 0 and result["examples"]
