"""Forage's side of weight updates inside vLLM workers, on several ranks: a real weight-sync
server on loopback, real gRPC fetches and a real `transformers` model (the session's tiny Qwen2
policy). The same path runs inside a real vLLM engine in test_vllm_real.py (one rank, vLLM's
CPU build); here two or more ranks and their failures are cheap to arrange, so two small
stand-ins are used, and only for vLLM's side of the interface:
- `VllmStyleModel` gives the HF model vLLM's model method signature
  `load_weights(weights: Iterable[tuple[str, Tensor]]) -> set[str]` (HF models have no such
  method); it copies into the real model's parameters by HF name.
- `Rank` carries the three attributes of vLLM's worker that `ForageWorkerExtension` uses
  (`reload_weights(weights_iterator=...)`, `device`, `rank`), and `CollectiveRpc` follows
  `collective_rpc`'s documented contract: the call is msgpack-packed (strictly: plain values only), unpacked, and
  `worker.<method>(*args)` runs on every rank, whose answers travel back the same way.
Everything else (fetch, checksum, staging, all-or-nothing across ranks, load) is Forage's code.
"""

from __future__ import annotations

import types

import msgpack
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common.weight_sync import WeightSyncError, WeightSyncServer
from services.rollout.vllm_engine import VLLMEngine, failure_reason, rank_failures, stage_call
from services.rollout.vllm_worker import ForageWorkerExtension, WorkerWeightLoader

torch.set_num_threads(1)
TOKEN = "s3cret"
IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])


class VllmStyleModel:
    """Stands in only for the signature of vLLM's `model.load_weights(weights=...)`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def load_weights(self, weights):
        own = self.model.state_dict()
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in own:
                    raise ValueError(f"There is no module or parameter named {name!r}")
                own[name].copy_(tensor)
                loaded.add(name)
        return loaded


class Rank(ForageWorkerExtension):
    """The attributes of vLLM's worker the extension reads (vLLM mixes the extension in)."""

    def __init__(self, model: torch.nn.Module, rank: int) -> None:
        self.model_runner = types.SimpleNamespace(model=VllmStyleModel(model))
        self.device = torch.device("cpu")
        self.rank = rank

    def reload_weights(self, weights_iterator=None):
        self.model_runner.model.load_weights(weights_iterator)


class CollectiveRpc:
    """`LLMEngine.collective_rpc(method, args=...)`'s contract over plain msgpack (see top)."""

    def __init__(self, ranks: list[Rank]) -> None:
        self.ranks = ranks
        self.resets = 0

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        method, args = msgpack.unpackb(msgpack.packb((method, args)))
        answers = [getattr(rank, method)(*args) for rank in self.ranks]
        return msgpack.unpackb(msgpack.packb(answers), strict_map_key=False)

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.resets += 1
        return reset_running_requests  # nothing is cached here; vLLM's answer when it worked


def load_policy(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def published(tiny_policy_dir):
    """The policy moved by a seeded step, as the learner would publish it, and its logits."""
    trained = load_policy(tiny_policy_dir)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in trained.parameters():  # tied weights appear once here
            param.add_(0.05 * torch.randn(param.shape, generator=g))
    return trained.state_dict(), logits(trained)


@pytest.fixture()
def server():
    srv = WeightSyncServer(chunk_bytes=64 << 10, token=TOKEN).start()
    yield srv
    srv.stop(0)


class CorruptingServer(WeightSyncServer):
    """A real server whose fifth message has one payload byte flipped on the wire."""

    def _encode_chunks(self, snapshot, *args):
        for i, message in enumerate(super()._encode_chunks(snapshot, *args)):
            if i == 4:
                message = bytearray(message)
                message[-10] ^= 0x01
                message = bytes(message)
            yield message


def test_stage_then_commit_loads_exactly_the_published_weights(tiny_policy_dir, published,
                                                               server):
    state, expected = published
    server.publish(state, 2)
    model = load_policy(tiny_policy_dir)
    before = logits(model)
    assert not torch.allclose(before, expected)
    loader = WorkerWeightLoader(rank=0)
    staged = loader.stage(2, server.address, TOKEN)
    assert staged["ok"] and staged["version"] == 2 and staged["tensors"] == len(state)
    assert torch.equal(logits(model), before)  # staging never touches the model
    done = loader.commit(2, VllmStyleModel(model).load_weights)
    assert done == {"ok": True, "version": 2, "rank": 0, "reason": "", "error": "",
                    "tensors": len(state), "bytes": staged["bytes"]}
    assert torch.equal(logits(model), expected)
    assert loader.commit(2, VllmStyleModel(model).load_weights)["reason"] == "not_staged"
    loader.close()


def test_corrupt_transfer_keeps_the_old_weights(tiny_policy_dir, published):
    state, _ = published
    srv = CorruptingServer(chunk_bytes=64 << 10).start()
    try:
        srv.publish(state, 2)
        model = load_policy(tiny_policy_dir)
        before = logits(model)
        loader = WorkerWeightLoader(rank=0)
        staged = loader.stage(2, srv.address)
        assert staged["ok"] is False and staged["reason"] == "checksum"
        assert loader.commit(2, VllmStyleModel(model).load_weights)["reason"] == "not_staged"
        assert torch.equal(logits(model), before)
        loader.close()
    finally:
        srv.stop(0)


def test_wrong_token_and_a_version_no_longer_served_are_refused(published, server):
    state, _ = published
    server.publish(state, 2)
    loader = WorkerWeightLoader(rank=1)
    assert loader.stage(2, server.address, "wrong")["reason"] == "auth"
    old = loader.stage(1, server.address, TOKEN)
    assert old["ok"] is False and old["reason"] == "superseded"
    loader.close()


def test_unknown_tensor_names_fail_the_load_and_are_reported(tiny_policy_dir, published,
                                                            server):
    state, _ = published
    server.publish({**state, "not.a.parameter": torch.zeros(3)}, 2)
    loader = WorkerWeightLoader(rank=0)
    assert loader.stage(2, server.address, TOKEN)["ok"]
    result = loader.commit(2, VllmStyleModel(load_policy(tiny_policy_dir)).load_weights)
    assert result["ok"] is False and result["reason"] == "load"
    assert "not.a.parameter" in result["error"] and rank_failures([result])
    loader.close()


def test_engine_pull_weights_over_collective_rpc_on_two_ranks(tiny_policy_dir, published,
                                                              server):
    """VLLMEngine.pull_weights drives both ranks through plain RPC: each fetches and loads."""
    state, expected = published
    server.publish(state, 3)
    models = [load_policy(tiny_policy_dir), load_policy(tiny_policy_dir)]
    rpc = CollectiveRpc([Rank(m, r) for r, m in enumerate(models)])
    engine = VLLMEngine(rpc, tokenizer=None, max_batch_size=4)
    assert engine.pull_weights(3, server.address, TOKEN) == 3
    assert engine.policy_version == 3 and rpc.resets == 1
    for model in models:
        assert torch.equal(logits(model), expected)


def test_one_rank_failing_to_stage_leaves_every_rank_on_old_weights(tiny_policy_dir, published,
                                                                    server):
    state, _ = published
    server.publish(state, 2)
    models = [load_policy(tiny_policy_dir), load_policy(tiny_policy_dir)]
    before = [logits(m) for m in models]
    ranks = [Rank(m, r) for r, m in enumerate(models)]
    rpc = CollectiveRpc(ranks)
    # rank 1 talks to a port where nothing listens: its fetch fails, rank 0's succeeds
    original = ranks[1].forage_stage_weights
    ranks[1].forage_stage_weights = lambda v, a, t: original(v, "127.0.0.1:1", t)
    engine = VLLMEngine(rpc, tokenizer=None, max_batch_size=4, policy_version=1)
    with pytest.raises(WeightSyncError) as err:
        engine.pull_weights(2, server.address, TOKEN)
    assert err.value.reason == "unavailable" and "rank 1" in str(err.value)
    assert engine.policy_version == 1 and rpc.resets == 0
    for model, old in zip(models, before, strict=True):
        assert torch.equal(logits(model), old)
    assert all(r._forage_weight_loader._staged is None for r in ranks)  # staging freed
    call = stage_call(2, server.address, TOKEN)
    staged = rpc.collective_rpc(call.method, args=call.args)
    assert [a["ok"] for a in staged] == [True, False] and len(rank_failures(staged)) == 1
    assert failure_reason(staged) == "unavailable"


def _worker(tiny_policy_dir, srv, engine, token=None):
    from services.common.config import load_config
    from services.rollout.worker import RolloutWorker

    host, port = srv.address.rsplit(":", 1)
    overrides = [f"model.path={tiny_policy_dir}", "rollout.engine=vllm",
                 "rollout.use_search=false", f"learner.weight_sync_host={host}",
                 f"learner.weight_sync_port={port}"]
    if token:
        overrides.append(f"learner.weight_sync_token={token}")
    return RolloutWorker(load_config(overrides=overrides), engine=engine)


def test_rollout_worker_updates_a_vllm_engine_through_its_workers(tiny_policy_dir, published,
                                                                  server):
    """The service's poll: GetVersion in the replica, the fetch in the engine's workers."""
    state, expected = published
    server.publish(state, 4)
    model = load_policy(tiny_policy_dir)
    engine = VLLMEngine(CollectiveRpc([Rank(model, 0)]), tokenizer=None, max_batch_size=4)
    worker = _worker(tiny_policy_dir, server, engine, TOKEN)
    try:
        assert worker._poll_weights(force=True) is True
        assert engine.policy_version == 4 and torch.equal(logits(model), expected)
        assert worker._poll_weights(force=True) is False  # nothing newer
    finally:
        worker.loop.close()
        worker._client().close()


def test_rollout_worker_keeps_serving_old_weights_after_a_corrupt_transfer(tiny_policy_dir,
                                                                           published):
    from prometheus_client import REGISTRY

    state, _ = published
    srv = CorruptingServer(chunk_bytes=64 << 10).start()
    model = load_policy(tiny_policy_dir)
    before = logits(model)
    engine = VLLMEngine(CollectiveRpc([Rank(model, 0)]), tokenizer=None, max_batch_size=4)
    worker = _worker(tiny_policy_dir, srv, engine)
    name = "forage_rollout_weight_sync_failures_total"
    try:
        srv.publish(state, 2)
        failures = REGISTRY.get_sample_value(name) or 0.0
        assert worker._poll_weights(force=True) is False
        assert REGISTRY.get_sample_value(name) == failures + 1
        assert engine.policy_version == 0 and torch.equal(logits(model), before)
    finally:
        worker.loop.close()
        worker._client().close()
        srv.stop(0)


def test_the_rotary_reload_warning_is_dropped_and_every_other_layer_still_warns():
    """vLLM's in-place reload warns "<Layer>: Failed to load weights" for a layer whose tensors
    the update did not carry; a rotary embedding holds only its computed cos/sin cache, so the
    warning came on every update. The filter sits on the installed vLLM's own logger and drops
    that case alone."""
    import logging

    from services.rollout.vllm_worker import RELOAD_LOGGER, quiet_rotary_reload_warning
    from tests.conftest import import_or_skip

    import_or_skip("vllm", "vLLM's reload module names the logger")
    from vllm.model_executor.model_loader.reload import layerwise

    assert layerwise.logger.name == RELOAD_LOGGER
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    keep = Keep()
    layerwise.logger.addHandler(keep)
    try:
        quiet_rotary_reload_warning()
        quiet_rotary_reload_warning()  # once per process, however often a reload runs
        assert sum(type(f).__name__ == "_RotaryReloadNoise" for f in layerwise.logger.filters) == 1
        layerwise.logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        layerwise.logger.warning("%s: Failed to load weights", "Llama3RotaryEmbedding")
        layerwise.logger.warning("%s: Failed to load weights", "QKVParallelLinear")
    finally:
        layerwise.logger.removeHandler(keep)
    assert seen == ["QKVParallelLinear: Failed to load weights"]
