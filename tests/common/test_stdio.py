"""result_stdout: while a command works, everything written to stdout (Python prints, native
writes, child processes) goes to stderr; the result printed after it is stdout's only content."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = f"""
import json, os, sys
sys.path.insert(0, {str(REPO)!r})
from services.common.stdio import result_stdout
print("before")
with result_stdout():
    print("a library's print")
    sys.stdout.write("a library's write\\n")
    os.write(1, b"a native write\\n")
    os.system("echo a child process")
print(json.dumps({{"result": 1}}))
"""


def test_only_the_result_reaches_stdout() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60, check=True)
    lines = done.stdout.splitlines()
    assert lines[0] == "before"
    assert json.loads("\n".join(lines[1:])) == {"result": 1}
    for text in ("a library's print", "a library's write", "a native write", "a child process"):
        assert text in done.stderr
