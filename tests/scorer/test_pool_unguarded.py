"""A script without an `if __name__ == "__main__":` guard that scores math from a thread: the
spawned reward worker re-runs it and dies; the caller is told exactly that and how to fix it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = '''
import threading

from services.scorer.rewards import compute_score

result = {}


def go():
    try:
        result["score"] = compute_score("synth_math", "\\\\boxed{4}", "4")
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"


thread = threading.Thread(target=go)
thread.start()
thread.join()
print("RESULT", result, flush=True)
result["score"]  # stops an unguarded run: inside a worker this kills the worker at start
'''


@pytest.mark.slow
def test_unguarded_script_gets_an_error_naming_the_fix(tmp_path):
    script = tmp_path / "score_math.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    caller = lines[-1]  # the worker's own run prints first
    assert "PoolError: reward worker died at start (exit code 1)" in caller, proc.stdout
    assert str(script) in caller and 'if __name__ == "__main__":' in caller
