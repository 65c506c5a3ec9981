"""Process-group set-up for one learner process or N ranks under torchrun / deepspeed.

Why our own init: a single `forage learner sft` process has no launcher environment, yet
DeepSpeed needs a process group; we make a 1-rank group on a free loopback port. Under a
launcher (RANK / WORLD_SIZE set) we join its group. gloo on CPU, nccl on GPUs.
"""

from __future__ import annotations

import os
import socket

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


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()
