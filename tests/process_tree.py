"""Stopping a launcher with everything under it, for tests that start torchrun."""

from __future__ import annotations

import subprocess

import psutil


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and every process under it, then reap it. torchrun starts each rank in a
    session of its own, so killing torchrun's process group would leave the ranks running."""
    try:
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
