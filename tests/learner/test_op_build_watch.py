"""A learner waiting on a DeepSpeed C++ op build lock says so in its log (op_build_watch.py):
a lock left by a killed build used to hang the learner with nothing in its log."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import services.learner.op_build_watch as W
from services.learner.op_build_watch import held_locks, lock_message

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import services.learner.op_build_watch as W
W.FIRST_WARNING_S, W.REPEAT_S = 1.0, 2.0
from services.common.config.learner import LearnerSection
from services.learner.trainer import PolicyTrainer
PolicyTrainer(sys.argv[1], LearnerSection(lr=1e-3))
print("engine ready", file=sys.stderr, flush=True)
"""


def test_held_locks_are_found_with_their_age(tmp_path) -> None:
    (tmp_path / "cpu_adam").mkdir()
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    os.utime(lock, (time.time() - 300, time.time() - 300))
    [(found, age)] = held_locks(tmp_path)
    assert found == lock and 299 <= age < 330
    message = lock_message(found, age)
    assert "'deepspeed_shm_comm'" in message and str(lock) in message and "delete" in message


def test_a_learner_behind_a_stale_build_lock_says_so(tiny_policy, tmp_path) -> None:
    lock = tmp_path / "deepspeed_shm_comm" / "lock"  # as a killed build leaves it
    lock.parent.mkdir()
    lock.touch()
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), PYTHONPATH=str(REPO),
               OMP_NUM_THREADS="1")
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tiny_policy)], env=env,
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        assert process.stderr is not None
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "waiting for the build lock" in line:
                break
    finally:
        process.kill()
        process.wait()
    said = "".join(lines)
    assert "engine ready" not in said  # it really was held up by the lock
    assert "waiting for the build lock of the C++ op 'deepspeed_shm_comm'" in said, said[-3000:]
    assert str(lock) in said


def _lock(root: Path, op: str, age_s: float) -> Path:
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_only_locks_no_build_is_behind_are_removed(tmp_path) -> None:
    left = _lock(tmp_path, "deepspeed_shm_comm", 300)  # as a killed learner leaves it
    young = _lock(tmp_path, "cpu_adam", 5)  # a build that has just taken its lock
    building = _lock(tmp_path, "cpu_adagrad", 300)  # a long build: its compiler runs there
    (building.parent / "obj").mkdir()
    compiler = subprocess.Popen(["sleep", "60"], cwd=building.parent / "obj")
    try:
        assert W.builders_in(building.parent) is True
        assert W.builders_in(left.parent) is False
        assert W.clear_stale_locks(tmp_path) == [left]
    finally:
        compiler.kill()
        compiler.wait()
    assert not left.exists() and young.exists() and building.exists()


def test_the_learner_set_up_clears_a_left_lock_before_and_while_it_waits(tmp_path,
                                                                       monkeypatch) -> None:
    from torch.utils.file_baton import FileBaton

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    before = _lock(tmp_path, "deepspeed_shm_comm", 300)
    with W.watch_build_locks(after_s=0.2, every_s=0.2):
        assert FileBaton(str(before)).try_acquire()  # torch's own lock: free at once
        FileBaton(str(before)).release()
        later = _lock(tmp_path, "cpu_adam", 300)  # its holder died while we waited
        started = time.monotonic()
        FileBaton(str(later), wait_seconds=0.05).wait()  # torch's wait: returns when it is gone
        assert time.monotonic() - started < 5


def test_each_install_builds_its_ops_in_a_folder_of_its_own(tmp_path, monkeypatch) -> None:
    """The op build's flags hold the packages' paths as a process sees them, so a venv reached
    through another path (a second checkout, a symlink) must not share the build folder: the
    two rebuilt the op in turn at every learner start. The folder is set only while the ops
    load (a child with other paths must not inherit it); a user's TORCH_EXTENSIONS_DIR is kept."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    ours = W.own_extensions_dir()
    assert ours.name.startswith("forage-") and ours.parent == W.extensions_root()
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # where Debian's ninja 1.11 may be found first
    with W.in_own_extensions_dir() as folder:
        assert folder == ours and os.environ["TORCH_EXTENSIONS_DIR"] == str(ours)
        # the install's own ninja builds, whatever PATH says (ninja 1.11 and 1.13 each took
        # the other's build for a changed one and compiled again)
        assert shutil.which("ninja") == str(Path(sys.executable).parent / "ninja")
    assert "TORCH_EXTENSIONS_DIR" not in os.environ and os.environ["PATH"] == "/usr/bin:/bin"
    (tmp_path / "venv").symlink_to(Path(sys.prefix))  # the same packages under another path
    code = "from services.learner.op_build_watch import own_extensions_dir as o; print(o())"
    other = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c", code],
                           env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                           text=True, timeout=120, check=True).stdout.strip().splitlines()[-1]
    assert Path(other).parent == ours.parent and Path(other) != ours
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert W.own_extensions_dir() == tmp_path / "mine"


def test_build_ops_readies_the_op_a_learner_loads(monkeypatch) -> None:
    """`forage learner build-ops` (run by `make install` and the CPU image) leaves the op built
    in the folder a learner of this venv loads it from; `make install` built it already, so
    this finds it without compiling."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    done = subprocess.run([str(Path(sys.executable).parent / "forage"), "learner", "build-ops"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "deepspeed_shm_comm: ready in" in done.stdout
    built = W.own_extensions_dir() / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    assert built.is_file()
