"""Tensor-parallel ranks of one vLLM replica fetch a version once (vllm_worker.py): rank 0
fetches and serves what it receives on a Unix socket, the other ranks read from it while it
arrives. Real gRPC, plain-Python ranks (WorkerWeightLoader); vLLM itself is not needed."""

from __future__ import annotations

import tempfile
import threading
import uuid

import msgpack
import torch

from services.common.weight_sync import WeightSyncServer
from services.rollout.vllm_engine import stage_call
from services.rollout.vllm_worker import WorkerWeightLoader

torch.set_num_threads(1)


def weights(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1 << 18,), float(version)),
            "b": torch.full((9,), float(version), dtype=torch.bfloat16)}


def one_copy(server: WeightSyncServer) -> int:
    return sum(len(m) for m in server._encode_chunks(server._current))


def share_path() -> str:
    return f"unix:{tempfile.gettempdir()}/forage-test-{uuid.uuid4().hex[:8]}.sock"


def stage_all(loaders: list[WorkerWeightLoader], version: int, address: str, token: str,
              plan: dict) -> list[dict]:
    """collective_rpc's shape: every rank stages at once; the later ranks may start first."""
    results: list[dict] = [{}] * len(loaders)

    def run(i: int) -> None:
        results[i] = loaders[i].stage(version, address, token, plan)

    threads = [threading.Thread(target=run, args=(i,)) for i in reversed(range(len(loaders)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_tensor_parallel_ranks_fetch_once_per_replica():
    server = WeightSyncServer(chunk_bytes=16 << 10, token="t0k").start()
    loaders = [WorkerWeightLoader(rank=r, fetch_timeout_s=30) for r in range(4)]
    try:
        server.publish(weights(2), 2)
        plan = {"relays": False, "share": share_path(), "hold_s": 60.0}
        call = stage_call(2, server.address, "t0k", plan)
        assert msgpack.unpackb(msgpack.packb(call.args))[3] == plan  # plain values only
        results = stage_all(loaders, 2, server.address, "t0k", plan)
        assert [r["ok"] for r in results] == [True] * 4, results
        for loader in loaders:
            version, tensors = loader._staged
            assert version == 2 and bool((tensors["w"] == 2).all())
        # The learner streamed one copy: ranks 1-3 read rank 0's.
        assert server.bytes_sent <= 1.05 * one_copy(server)
        # The next version the same way (rank 0's relay is kept and serves the new one).
        server.publish(weights(3), 3)
        sent = server.bytes_sent
        results = stage_all(loaders, 3, server.address, "t0k", plan)
        assert [r["ok"] for r in results] == [True] * 4, results
        assert server.bytes_sent - sent <= 1.05 * one_copy(server)
        assert all(bool((loader._staged[1]["b"] == 3).all()) for loader in loaders)
    finally:
        for loader in loaders:
            loader.close()
        server.stop(0)


def test_a_rank_that_cannot_read_rank_0_falls_back_to_the_learner():
    server = WeightSyncServer(chunk_bytes=16 << 10).start()
    loader = WorkerWeightLoader(rank=1, fetch_timeout_s=30)
    try:
        server.publish(weights(4), 4)
        # nothing serves this socket: rank 0 is gone
        result = loader.stage(4, server.address, "", {"share": share_path(), "share_wait_s": 0.5})
        assert result["ok"], result
        assert bool((loader._staged[1]["w"] == 4).all())
        # The client reads the stream to its end instead of cancelling at the last chunk, so
        # the server has counted every message, the last one too, before the stage returns.
        assert server.bytes_sent >= one_copy(server)
    finally:
        loader.close()
        server.stop(0)
