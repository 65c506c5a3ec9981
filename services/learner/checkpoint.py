"""Atomic, resumable learner checkpoints.

Layout of `checkpoint_dir`:
```
latest                   text file naming the newest complete checkpoint (replaced atomically)
step_00000010/
  policy/                HF format (save_pretrained + tokenizer files): loadable by transformers
                         and by the rollout engines as is (with LoRA: the merged model)
  adapter/               with LoRA only: the adapter in peft's format (adapter_config.json,
                         adapter_model.safetensors), for PeftModel.from_pretrained
  ds/state/              DeepSpeed engine state: model, optimizer (ZeRO shards), LR scheduler
  critic_ds/state/       the critic's, when training with GAE
  rng_rank{r}.json       python / numpy / torch (and CUDA) RNG state of rank r
  trainer_state.json     step, policy version, data cursor (opaque), metrics history
```
Why atomic: a learner killed while writing must leave the previous checkpoint usable. All ranks
write into `.tmp-step_*`; once every file is written and fsynced, rank 0 renames the directory
into place and only then moves `latest`, so `latest` always names a complete checkpoint.
RNG state is JSON (not pickle): checkpoints may be copied between machines and read back.

Several nodes: `checkpoint_dir` must be one shared directory (NFS, a cluster file system, a
ReadWriteMany volume) at the same path on every node, not a directory per node. Every rank
writes its own ZeRO shards into it, and resuming reads more than a rank's own: ZeRO-1/2 load
every rank's optimizer shard (DeepSpeed re-partitions them), and rank 0 alone writes the HF
policy, the trainer state and `latest`. `check_shared_dir` refuses, at start, a directory that
is not the same on every rank; `agreed_checkpoint` makes every rank resume the checkpoint rank 0
chose; and before the rename the first rank of each node fsyncs what its node wrote, so a
checkpoint that `latest` names is on the server's disk, not in one client's cache.
"""

from __future__ import annotations

import base64
import json
import os
import random
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.learner import distributed as D

LATEST = "latest"
STATE_FILE = "trainer_state.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
    "added_tokens.json",
)


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps (RL steps or SFT steps) completed
    policy_version: int = 0
    data_cursor: dict[str, Any] = field(default_factory=dict)  # opaque to the checkpointer
    metrics_history: list[dict[str, Any]] = field(default_factory=list)


def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict[str, Any]:
    py = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [
            np_state[0],
            np_state[1].tolist(),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))
    if "cuda" in state and torch.cuda.is_available():
        raw = np.frombuffer(base64.b64decode(state["cuda"]), dtype=np.uint8).copy()
        torch.cuda.set_rng_state(torch.from_numpy(raw))


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint, or None."""
    root = Path(checkpoint_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / STATE_FILE).is_file() else None


def save_checkpoint(
    trainer: Any,
    checkpoint_dir: str | os.PathLike[str],
    state: TrainerState,
    *,
    tokenizer_from: str | os.PathLike[str] | None = None,
    keep: int = 2,
) -> Path:
    """Write a checkpoint of `trainer` (a PolicyTrainer) collectively; every rank must call."""
    root = Path(checkpoint_dir)
    final = root / step_dir_name(state.step)
    tmp = root / f".tmp-{final.name}"
    rank = D.rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    D.barrier()
    trainer.policy.save(str(tmp / "ds"), tag="state")
    if trainer.critic is not None:
        trainer.critic.save(str(tmp / "critic_ds"), tag="state")
    (tmp / f"rng_rank{rank}.json").write_text(json.dumps(_rng_state()))
    full, adapter = trainer.export()
    if rank == 0:
        trainer.base_model.save_pretrained(
            str(tmp / "policy"), state_dict=full, safe_serialization=True
        )
        if adapter is not None:  # LoRA: the adapter alone too, in peft's format
            trainer.policy.module.save_pretrained(str(tmp / "adapter"), state_dict=adapter,
                                                  safe_serialization=True)
        if tokenizer_from is not None:
            for name in TOKENIZER_FILES:
                src = Path(tokenizer_from) / name
                if src.is_file():
                    shutil.copyfile(src, tmp / "policy" / name)
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), default=float))
    D.barrier()
    if D.local_rank() == 0:  # one rank per node: what this node wrote reaches the disk
        _fsync_tree(tmp)
    D.barrier()
    if rank == 0:
        if final.exists():  # a re-save of the same step replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        pointer_tmp = root / f".{LATEST}.tmp"
        pointer_tmp.write_text(final.name + "\n")
        with open(pointer_tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(pointer_tmp, root / LATEST)
        _fsync_dir(root)
        _prune(root, keep)
    D.barrier()
    return final


class SharedDirError(ValueError):
    """The checkpoint directory is not one directory shared by every rank."""


# How long a rank looks for rank 0's marker file: a network file system may show a new file to
# another client only after its attribute cache expires (NFS: a few seconds by default).
SHARED_CHECK_S = 10.0


def check_shared_dir(checkpoint_dir: str | os.PathLike[str], key: str = "checkpoint_dir",
                     wait_s: float = SHARED_CHECK_S) -> None:
    """Refuse a checkpoint directory that is not the same directory on every rank (collective;
    every rank must call; nothing to check with one rank).

    Rank 0 writes a file with a fresh random name and content; every rank looks for it (for up
    to `wait_s`, see SHARED_CHECK_S); if any rank does not see it, every rank raises
    SharedDirError naming the directory. A directory per node would otherwise fail only when a
    run resumes, or, worse, resume the nodes from different steps."""
    if D.world_size() == 1:
        return
    root = Path(checkpoint_dir)
    token, failure = (secrets.randbits(62) if D.rank() == 0 else 0), None
    if D.rank() == 0:  # a fresh name: no client has a cached "no such file" for it
        try:
            root.mkdir(parents=True, exist_ok=True)
            (root / f".shared-check-{token:016x}").write_text(str(token))
        except OSError as exc:  # told to every rank below, so none waits for rank 0
            failure, token = exc, -1
    told = D.broadcast_indices(torch.tensor([token]) if D.rank() == 0 else None, 1)[0]
    if failure is not None:
        raise failure
    if told < 0:
        raise SharedDirError(f"rank 0 could not write to {key} {root} (its log says why)")
    marker = root / f".shared-check-{told:016x}"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            seen = marker.read_text().strip() == str(told)
        except OSError:
            seen = False
        if seen or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    blind = int(D.all_reduce_sum(torch.tensor([0 if seen else 1], device=D.device())).item())
    if D.rank() == 0:
        marker.unlink(missing_ok=True)
    if blind:
        raise SharedDirError(
            f"{key} {root} is not one directory shared by every node: {blind} of "
            f"{D.world_size()} ranks do not see the file rank 0 wrote there. A learner on "
            "several nodes needs it on a shared volume (NFS, a cluster file system, a "
            "ReadWriteMany claim) mounted at the same path on every node")


def agreed_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint as rank 0 sees it, on every rank (collective).

    Each rank reading `latest` on its own could resume the ranks from different steps (a file
    system that shows the new `latest` late to one node); rank 0 decides, and a rank that
    cannot find that checkpoint raises SharedDirError rather than load another."""
    root = Path(checkpoint_dir)
    path = latest_checkpoint(root) if D.rank() == 0 else None
    if D.world_size() == 1:
        return path
    step = -1
    if path is not None:  # save_checkpoint names every directory step_dir_name(step)
        digits = path.name.removeprefix("step_")
        step = int(digits) if digits.isdigit() else -2
    step = D.broadcast_indices(torch.tensor([step]) if D.rank() == 0 else None, 1)[0]
    if step == -1:
        return None
    if step < 0:
        raise SharedDirError(f"{root / LATEST} names a directory that is not step_NNNNNNNN")
    path = root / step_dir_name(step)
    if not (path / STATE_FILE).is_file():
        raise SharedDirError(f"rank {D.rank()} cannot read {path}, the checkpoint rank 0 "
                             "resumes: the checkpoint directory must be shared by every node")
    return path


def _prune(root: Path, keep: int) -> None:
    complete = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step_*"):  # left by a learner killed mid-write
        shutil.rmtree(stale, ignore_errors=True)


def trim_metrics(path: str | os.PathLike[str], last_step: int) -> None:
    """Drop metric lines written after the resumed checkpoint (the resumed run writes them
    again), and a torn last line left by a process killed mid-write."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(record.get("step", 0)) <= last_step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


def load_checkpoint(trainer: Any, path: str | os.PathLike[str]) -> TrainerState:
    """Restore weights, optimizer, scheduler and this rank's RNG; returns the trainer state."""
    path = Path(path)
    trainer.policy.load(str(path / "ds"), tag="state")
    if trainer.critic is not None:
        trainer.critic.load(str(path / "critic_ds"), tag="state")
    rng_file = path / f"rng_rank{D.rank()}.json"
    if not rng_file.is_file():  # resumed on more ranks than were saved
        rng_file = path / "rng_rank0.json"
    _set_rng_state(json.loads(rng_file.read_text()))
    raw = json.loads((path / STATE_FILE).read_text())
    return TrainerState(**raw)
