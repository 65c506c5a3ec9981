"""Say so in the log while DeepSpeed waits on a C++ op build lock.

On CPU, DeepSpeed's engine set-up JIT-compiles C++ ops (the shm_comm collective, cpu_adam) with
torch.utils.cpp_extension into TORCH_EXTENSIONS_DIR, behind a `lock` file in each op's build
folder; any other process wanting the op waits until that file is gone. A first build takes
1-2 minutes on a small CPU, with nothing in the learner's log meanwhile, and a build that was
killed leaves its lock behind, so the next learner waits forever, silently (measured: a `forage
up` learner sat there with an empty log). While the engine is being set up, `watch_build_locks`
reports every lock it finds, with its age and what to do, once after `after_s` and then every
`every_s`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("forage.learner")

FIRST_WARNING_S = 20.0
REPEAT_S = 60.0


def extensions_root() -> Path:
    """Where torch.utils.cpp_extension builds ops (its own rule: TORCH_EXTENSIONS_DIR, else
    <default root>/py<version>_<accelerator>), without creating anything."""
    explicit = os.environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return Path(explicit)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def held_locks(root: Path) -> list[tuple[Path, float]]:
    """(lock file, seconds since it was made) of every op build lock under `root`."""
    now = time.time()
    found = []
    for lock in sorted(root.glob("*/lock")):
        try:
            found.append((lock, max(now - lock.stat().st_mtime, 0.0)))
        except OSError:  # released while we looked
            continue
    return found


def lock_message(lock: Path, age_s: float) -> str:
    return (f"waiting for the build lock of the C++ op {lock.parent.name!r} ({lock}, made "
            f"{age_s:.0f} s ago): another process is compiling it (the first build takes 1-2 "
            "minutes on a small CPU), or one that was killed left the lock behind; if no build "
            "is running on this machine, delete that file and the learner goes on")


@contextmanager
def watch_build_locks(after_s: float | None = None,
                      every_s: float | None = None) -> Iterator[None]:
    """Warn about held op build locks while the body runs (a daemon thread; nothing is said if
    the body is done within `after_s`, default FIRST_WARNING_S; then every `every_s`, default
    REPEAT_S)."""
    after_s = FIRST_WARNING_S if after_s is None else after_s
    every_s = REPEAT_S if every_s is None else every_s
    done = threading.Event()
    root = extensions_root()

    def watch() -> None:
        wait = after_s
        while not done.wait(wait):
            for lock, age in held_locks(root):
                log.warning(lock_message(lock, age))
            wait = every_s

    thread = threading.Thread(target=watch, name="op-build-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1.0)
