"""Say so in the log while DeepSpeed waits on a C++ op build lock.

On CPU, DeepSpeed's engine set-up JIT-compiles C++ ops (the shm_comm collective, cpu_adam) with
torch.utils.cpp_extension into TORCH_EXTENSIONS_DIR, behind a `lock` file in each op's build
folder; any other process wanting the op waits until that file is gone. A first build takes
1-2 minutes on a small CPU, with nothing in the learner's log meanwhile, and a build that was
killed leaves its lock behind, so the next learner waits forever, silently (measured: a `forage
up` learner sat there with an empty log). While the engine is being set up, `watch_build_locks`
reports every lock it finds, with its age and what to do, once after `after_s` and then every
`every_s`.

A lock no build is behind is removed: torch takes the lock in every process that loads an op,
even when nothing needs compiling, so a learner killed at that moment (a fault drill, a timeout,
a machine shut down) leaves one behind whose op is fully built. A lock counts as left behind
when it is older than `STALE_AFTER_S` (no real step between taking the lock and starting the
compiler takes that long) and no process on the machine works in its folder (ninja and the
compiler run there for the whole build). When some process's folder cannot be read (not root),
the lock is kept and only reported. Left locks are looked for every `POLL_S` while a learner
waits, so one costs it about STALE_AFTER_S, not the next report's time (with 60 s and checks
only at the reports, learners in the test suite waited 80-120 s behind such locks).
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
from typing import Any

log = logging.getLogger("forage.learner")

FIRST_WARNING_S = 20.0
REPEAT_S = 60.0
STALE_AFTER_S = 20.0
POLL_S = 2.0
PROC = Path("/proc")


def own_extensions_dir() -> Path:
    """The folder this install's ops are built in: TORCH_EXTENSIONS_DIR when the user set it,
    else <torch's default root>/forage-<key>, the key a hash of where torch and DeepSpeed are
    installed as this process sees them.

    Why: torch keys an op's build folder by the op's name only, while the build's flags hold
    those paths. Two checkouts' venvs on one machine (or one venv reached through a symlink)
    wrote one folder with different flags, so each learner start rebuilt the op the other had
    just built (1-2 minutes on 2 cores each time; measured: five rebuilds in 25 minutes)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    import hashlib

    import deepspeed
    import torch

    where = f"{Path(torch.__file__).parent}\n{Path(deepspeed.__file__).parent}"
    return extensions_root() / f"forage-{hashlib.sha256(where.encode()).hexdigest()[:12]}"


@contextmanager
def in_own_extensions_dir() -> Iterator[Path]:
    """TORCH_EXTENSIONS_DIR set to `own_extensions_dir()` while DeepSpeed loads its ops, and
    put back after: left in os.environ it would reach every child process, whose own paths
    (and so its build flags) may differ, and the folders would be shared again."""
    folder = own_extensions_dir()
    before = {name: os.environ.get(name) for name in ("TORCH_EXTENSIONS_DIR", "PATH")}
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    os.environ["PATH"] = ninja_first_path(os.environ.get("PATH", ""))
    try:
        yield folder
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def ninja_first_path(path: str) -> str:
    """PATH with this Python's scripts folder first when it holds `ninja` (the pip package
    DeepSpeed installs), so every process of an install builds with the same ninja. torch runs
    whichever `ninja` PATH finds, and ninja 1.12+ hashes command lines differently from 1.11
    in .ninja_log: with Debian's 1.11 on some processes' PATH and the venv's 1.13 on others',
    each found the other's build "changed" and compiled the op again (14 times in one run of
    the test suite, 50-105 s each)."""
    scripts = Path(sys.executable).parent
    if not (scripts / "ninja").is_file():
        return path
    rest = [entry for entry in path.split(os.pathsep) if entry and Path(entry) != scripts]
    return os.pathsep.join([str(scripts), *rest])


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


def builders_in(folder: Path, proc: Path = PROC) -> bool | None:
    """Whether a process works in `folder` (its current directory is there or below): True, False,
    or None when some process's directory could not be read (then nobody can say). Root reads
    every ordinary process's directory; one it cannot is shielded by a sandbox or a security
    module (a container runtime's init, say), not a compiler, and is passed over."""
    try:
        target = folder.resolve()
    except OSError:
        return None
    unknown = False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
        except FileNotFoundError:  # exited while we looked
            continue
        except OSError:
            unknown = unknown or os.geteuid() != 0
            continue
        if cwd == target or target in cwd.parents:
            return True
    return None if unknown else False


def clear_stale_locks(root: Path, stale_after_s: float | None = None) -> list[Path]:
    """Remove the build locks under `root` that no build is behind (see the module's docstring);
    returns the removed ones."""
    stale_after_s = STALE_AFTER_S if stale_after_s is None else stale_after_s
    removed = []
    for lock, age in held_locks(root):
        if age < stale_after_s or builders_in(lock.parent) is not False:
            continue
        try:
            lock.unlink()
        except FileNotFoundError:
            continue
        except OSError as error:
            log.warning("could not remove the build lock %s left by a killed build: %s", lock,
                        error)
            continue
        log.warning("removed the build lock of the C++ op %r (%s, made %.0f s ago): no build is "
                    "running in its folder, so a process killed while it held the lock left it "
                    "behind", lock.parent.name, lock, age)
        removed.append(lock)
    return removed


def lock_message(lock: Path, age_s: float) -> str:
    return (f"waiting for the build lock of the C++ op {lock.parent.name!r} ({lock}, made "
            f"{age_s:.0f} s ago): another process is compiling it (the first build takes 1-2 "
            "minutes on a small CPU), or one that was killed left the lock behind; if no build "
            "is running on this machine, delete that file and the learner goes on")


@contextmanager
def watch_build_locks(after_s: float | None = None,
                      every_s: float | None = None) -> Iterator[None]:
    """Remove build locks left behind by killed builds, then, while the body runs, remove any
    that become so and warn about the ones still held (a daemon thread; nothing is said if the
    body is done within `after_s`, default FIRST_WARNING_S; then every `every_s`, default
    REPEAT_S)."""
    after_s = FIRST_WARNING_S if after_s is None else after_s
    every_s = REPEAT_S if every_s is None else every_s
    done = threading.Event()
    root = extensions_root()
    clear_stale_locks(root)

    def watch() -> None:
        report_at = time.monotonic() + after_s
        while not done.wait(min(POLL_S, after_s)):
            clear_stale_locks(root)
            if time.monotonic() >= report_at:
                for lock, age in held_locks(root):
                    log.warning(lock_message(lock, age))
                report_at = time.monotonic() + every_s

    thread = threading.Thread(target=watch, name="op-build-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1.0)


def build_cpu_ops() -> list[tuple[Any, float]]:
    """Build (or find built) the C++ ops a learner on CPU JIT-loads, with the flags DeepSpeed
    uses at a learner's start, so that start finds them ready: `make install` and the CPU image
    run this once instead of every first learner paying 1-2 minutes. Returns (builder,
    seconds) for each; an op DeepSpeed deems incompatible here is skipped, as DeepSpeed itself
    skips it (deepspeed.comm's build_shm_op reads the same table). The build is keyed by its
    flags, which hold the venv's path: a venv reached through another path (a symlink) builds
    its own copy."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    done = []
    with in_own_extensions_dir() as root:
        if root.is_dir():
            clear_stale_locks(root)
        for class_name in ("ShareMemCommBuilder",):  # deepspeed.comm's CPU collective
            builder = get_accelerator().create_op_builder(class_name)
            if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
                continue
            started = time.monotonic()
            builder.load(verbose=False)
            done.append((builder, time.monotonic() - started))
    return done
