"""Process-group set-up for one learner process or N ranks under torchrun / deepspeed.

Why our own init: a single `forage learner sft` process has no launcher environment, yet
DeepSpeed needs a process group; we make a 1-rank group on a free loopback port. Under a
launcher (RANK / WORLD_SIZE set) we join its group. gloo on CPU, nccl on GPUs.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ensure_distributed() -> None:
    """Initialise torch.distributed once (from the launcher's env, else as a 1-rank group)."""
    if dist.is_available() and dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ["RANK"] = "0"
        os.environ["WORLD_SIZE"] = "1"
        os.environ["LOCAL_RANK"] = "0"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


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
