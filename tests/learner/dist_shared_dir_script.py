"""Run by test_multinode.py under torchrun (2 CPU ranks): the checkpoint directory checks.

Each rank joins the group, then runs `check_shared_dir` on OUT/shared (one directory: passes),
on OUT/rank{r} (a directory per rank, as a directory per node would be: every rank must raise
SharedDirError, none may hang) and on a directory rank 0 cannot create (rank 0 raises its
OSError, the other rank SharedDirError), then `agreed_checkpoint` on a directory where only
rank 0 sees a checkpoint. Each rank writes OUT/result_rank{r}.json with what happened."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def outcome(check) -> str:
    from services.learner.checkpoint import SharedDirError

    try:
        check()
    except SharedDirError as exc:
        return f"refused: {exc}"
    except OSError as exc:
        return f"os error: {type(exc).__name__}"
    return "ok"


def main() -> None:
    from services.learner import distributed as D
    from services.learner.checkpoint import STATE_FILE, agreed_checkpoint, check_shared_dir

    out = Path(sys.argv[1])
    D.ensure_distributed()
    rank = D.rank()
    result = {"shared": outcome(lambda: check_shared_dir(out / "shared", wait_s=1.0)),
              "per_rank": outcome(lambda: check_shared_dir(out / f"rank{rank}", wait_s=1.0))}
    if rank == 0:
        (out / "a-file").write_text("")
    D.barrier()  # rank 0 cannot create a directory under a file: every rank must hear of it
    result["unwritable"] = outcome(lambda: check_shared_dir(out / "a-file" / "ckpt"))
    mine = out / f"ckpt{rank}"  # rank 0's has a checkpoint; the other rank's is empty
    if rank == 0:
        (mine / "step_00000004").mkdir(parents=True)
        (mine / "step_00000004" / STATE_FILE).write_text("{}")
        (mine / "latest").write_text("step_00000004\n")
    D.barrier()
    result["agreed"] = outcome(lambda: agreed_checkpoint(mine))
    result["agreed_shared"] = str(agreed_checkpoint(out / "ckpt0"))
    (out / f"result_rank{rank}.json").write_text(json.dumps(result))
    D.barrier()


if __name__ == "__main__":
    main()
