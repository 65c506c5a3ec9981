"""Process-group set-up for one learner process or N ranks under torchrun / deepspeed.

Why our own init: a single `forage learner sft` process has no launcher environment, yet
DeepSpeed needs a process group; we make a 1-rank group on a free loopback port. Under a
launcher (RANK / WORLD_SIZE set) we join its group. gloo on CPU, nccl on GPUs.

Several nodes (torchrun `--nnodes N --rdzv-backend c10d`, docs/deploy.md "Multi-node
learner"): RANK / WORLD_SIZE are global and LOCAL_RANK picks the device on this node, so
nothing here depends on the node count. Two things do:
- global rank 0 serves the weights, so it must run on the node the replicas dial. torchrun's
  c10d rendezvous ignores `--node-rank` and numbers the nodes itself (by their `--local-addr`,
  as strings); a deployment that knows which node should be first says so in FORAGE_NODE_RANK,
  and `ensure_distributed` refuses a rendezvous that put rank 0 elsewhere, at start, rather
  than serving weights from a node no replica dials;
- a rank that dies takes its node's share of every collective with it, so the others fail in
  their next one; `lost_peer` tells that failure apart from a bug, so the command ends with one
  line and the retryable exit code (a restart with --resume continues from the last
  checkpoint) instead of a traceback calling it a bug.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist

from services.common.config import ConfigError
from services.common.ports import free_port

NODE_RANK_ENV = "FORAGE_NODE_RANK"


def ensure_distributed() -> None:
    """Initialise torch.distributed once (from the launcher's env, else as a 1-rank group)."""
    if dist.is_available() and dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        os.environ["RANK"] = "0"
        os.environ["WORLD_SIZE"] = "1"
        os.environ["LOCAL_RANK"] = "0"
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing and os.environ["WORLD_SIZE"].strip() == "1":
        # no launcher (or RANK / WORLD_SIZE left by another tool): one rank has no peer to
        # meet, so its own loopback rendezvous is the right one
        os.environ.setdefault("LOCAL_RANK", "0")
        if not os.environ.get("MASTER_ADDR"):
            os.environ["MASTER_ADDR"] = "127.0.0.1"
        if not os.environ.get("MASTER_PORT"):
            os.environ["MASTER_PORT"] = str(free_port())
    elif missing:
        raise LauncherEnvError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} and RANK={os.environ['RANK']} are set but "
            f"{' and '.join(missing)} not: start the ranks with torchrun (or deepspeed), which "
            "sets all four, or unset RANK and WORLD_SIZE for a single process")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)
    atexit.register(shutdown)
    _check_driver_node()


def shutdown() -> None:
    """Destroy the process group before the interpreter exits (registered at exit by
    `ensure_distributed`). Left to exit-time destructors, a gloo group can abort its rank
    ("terminate called without an active exception", SIGABRT) after its work is done, which
    turns a finished run into a failed one; PyTorch asks for an explicit destroy for NCCL too."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class LauncherEnvError(ConfigError):
    """RANK / WORLD_SIZE say several ranks, but the rendezvous address is missing (a usage
    error: one line, exit 2)."""


class NodePlacementError(ValueError):
    """Global rank 0 (the weight server) runs on another node than the deployment named."""


def driver_node_error(rank: int, node_rank: str | None) -> str | None:
    """What is wrong when global rank `rank` runs on the node whose FORAGE_NODE_RANK is
    `node_rank` (None: unset, nothing to check), or None when nothing is."""
    if rank != 0 or node_rank is None or node_rank.strip() in ("", "0"):
        return None
    return (f"global rank 0 (the weight server) started on the node with {NODE_RANK_ENV}="
            f"{node_rank.strip()}, not on node 0, which the replicas dial for weights. "
            "torchrun's c10d rendezvous ignores --node-rank and orders the nodes by "
            "--local-addr: give node 0 the address that sorts first (docs/deploy.md, "
            "Multi-node learner)")


def _check_driver_node() -> None:
    """Every rank raises NodePlacementError when rank 0 landed on the wrong node (rank 0 alone
    knows; one broadcast tells the rest, so no rank is left waiting for the others)."""
    problem = driver_node_error(rank(), os.environ.get(NODE_RANK_ENV))
    if world_size() > 1:
        flag = torch.tensor([int(problem is not None)], dtype=torch.int64, device=device())
        dist.broadcast(flag, 0)
        if flag.item() and problem is None:
            problem = (f"global rank 0 started on another node than {NODE_RANK_ENV}=0 "
                       "(its log says which)")
    if problem is not None:
        raise NodePlacementError(problem)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def leads_another_node() -> bool:
    """Whether this process is the first rank of a node other than global rank 0's.

    torchrun numbers ranks node by node, so global rank 0 is local rank 0 of its node and
    every other local rank 0 is on another node: the one process there that answers for the
    node (its /healthz, for the pod's probes)."""
    return local_rank() == 0 and rank() != 0


def device() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum over ranks (a no-op with one rank); returns the tensor."""
    if world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def union_of_names(names: Iterable[str]) -> list[str]:
    """The sorted union over ranks of each rank's `names`.

    Why: a collective needs the same tensor on every rank, yet ranks can hold different metric
    names (a rank whose micro-batches were all dummy passes has no loss metrics at all); a rank
    that skipped the all-reduce would leave the others waiting in it forever. The names travel
    as UTF-8 bytes in a tensor, never pickled.
    """
    mine = sorted(set(names))
    if world_size() == 1:
        return mine
    on = device()
    data = "\n".join(mine).encode()
    width = torch.tensor([len(data)], dtype=torch.int64, device=on)
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    buffer = torch.zeros(int(width.item()) or 1, dtype=torch.uint8, device=on)
    if data:
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(on)
    gathered = [torch.empty_like(buffer) for _ in range(world_size())]
    dist.all_gather(gathered, buffer)
    union: set[str] = set()
    for item in gathered:
        text = bytes(item.cpu().tolist()).rstrip(b"\0").decode()
        union.update(name for name in text.split("\n") if name)
    return sorted(union)


def broadcast_indices(indices: torch.Tensor | None, length: int) -> list[int]:
    """Rank 0's `length` int64 indices on every rank (other ranks pass None)."""
    if world_size() == 1:
        assert indices is not None
        return [int(i) for i in indices.tolist()]
    buffer = torch.zeros(length, dtype=torch.int64, device=device())
    if rank() == 0:
        assert indices is not None
        buffer.copy_(indices.to(buffer.device))
    dist.broadcast(buffer, 0)
    return [int(i) for i in buffer.tolist()]


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


# Words of the errors a collective raises when a peer is gone or unreachable (gloo: "Connection
# closed by peer", "Connection reset by peer", "Broken pipe", "Timed out"; NCCL: its own name,
# the watchdog's timeout, "remote process exited").
_TRANSPORT_WORDS = ("peer", "connection", "broken pipe", "timed out", "timeout", "nccl",
                    "socket", "remote process")


def lost_peer(exc: BaseException) -> str | None:
    """One line saying the other ranks were lost, when `exc` (or what it was raised from) is a
    failure of a torch.distributed operation; None for anything else (a bug keeps its
    traceback).

    A failure of the transport: torch's DistError family (store, network, backend errors), or
    a RuntimeError raised inside torch.distributed (gloo's `work.wait()` raises a plain one)
    whose text is about the connection. A rank on a lost node fails this way in its next
    collective, on whichever rank that is."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _is_transport_failure(current):
            first = str(current).strip().splitlines()[0] if str(current).strip() else ""
            return (f"lost contact with the other ranks ({type(current).__name__}: "
                    f"{first[:300]}): a rank or its node stopped or was lost. Restart every "
                    "node with --resume to continue from the last complete checkpoint")
        current = current.__cause__ or current.__context__
    return None


def _is_transport_failure(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename if tb is not None else ""
    inside = f"{os.sep}torch{os.sep}distributed{os.sep}" in where
    text = str(exc).lower()
    return inside and any(word in text for word in _TRANSPORT_WORDS)
