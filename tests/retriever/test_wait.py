"""`forage retriever wait`: the start-up gate gives up with a clear line when asked to, and
needs an address to wait for (the waiting-then-ready path runs in tests/deploy/test_k8s_steps.py
against a retriever that answers 503, then 200)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again when the block ends


def test_wait_gives_up_after_its_timeout_and_says_what_it_waited_for():
    url = f"http://127.0.0.1:{_closed_port()}/retrieve"
    res = subprocess.run([str(BIN / "forage"), "retriever", "wait", "--url", url, "--timeout",
                          "1", "--interval", "0.2"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"waiting for the retriever at {url[:-len('retrieve')]}healthz")
    assert res.stderr.startswith("forage retriever wait: error: the retriever at ")
    assert "not ready after" in res.stderr


def test_wait_without_an_address_is_a_usage_error():
    res = subprocess.run([str(BIN / "forage"), "retriever", "wait"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "give --config FILE" in res.stderr, res.stderr
