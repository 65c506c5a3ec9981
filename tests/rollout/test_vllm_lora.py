"""LoRA adapters on the vLLM engine, without vLLM: the peft directory vLLM loads (checked against
peft itself on the session's tiny Qwen2 policy), the engine args, which adapter each request
gets and when an old one is removed, the base-fingerprint refusal, and the rollout worker's
routing of an adapter publish (a real weight-sync server on loopback).

vLLM cannot run here, so its side is a stand-in: `LoraLLMEngine` follows the V1 `LLMEngine`
contract the LoRA path uses (vllm/v1/engine/llm_engine.py, 0.33.0): `add_lora(LoRARequest)` has
every worker read the peft directory at `lora_path` (and answers True), `remove_lora(id)`
drops it (False when it was not loaded), and `add_request(..., lora_request=)` ties a request
to an adapter for its whole life. A worker reloads an evicted adapter from `lora_path` at the
next step that needs it (vllm/lora/worker_manager.py), so every step here checks that each
running request's adapter is still registered and its directory still on disk: an adapter
removed too early fails that check. `LoRARequest` itself is replaced by a namespace of the
same plain fields (`lora_request_kwargs`); tests/rollout/test_vllm_contract.py checks those
fields against vLLM's class where vLLM is installed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from services.common.config import load_config
from services.common.lora import (
    PEFT_CONFIG_FILE,
    PEFT_WEIGHTS_FILE,
    adapter_metadata,
    write_peft_adapter,
)
from services.common.model_identity import model_fingerprint
from services.rollout.engine import GenerationRequest, SamplingParams
from services.rollout.engines import vllm_engine_kwargs
from services.rollout.published import load_published
from services.rollout.vllm_engine import VLLMEngine
from services.rollout.vllm_lora import (
    MAX_CPU_LORAS,
    MAX_LORAS,
    AdapterVersions,
    lora_request_kwargs,
    vllm_max_lora_rank,
)
from tests.rollout.peft_random import random_peft_model

torch.set_num_threads(1)
IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])


def peft_adapter(tiny_policy_dir, seed: int, rank: int = 4, alpha: float = 8.0):
    """The tiny policy under a random non-zero adapter, and its tensors."""
    return random_peft_model(tiny_policy_dir, seed, rank=rank, alpha=alpha, scale=0.05)


# ------------------------------------------------------------------ the peft directory


def test_written_directory_is_peft_format_and_means_the_same_adapter(tiny_policy_dir,
                                                                      tmp_path):
    """peft loads the directory into the same model as the source adapter (and as Forage's
    transformers engine applies it), with the files peft's own save_pretrained writes."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from services.rollout.transformers_engine import TransformersEngine

    source, tensors = peft_adapter(tiny_policy_dir, seed=1, rank=4, alpha=6.0)  # scale 1.5
    written = write_peft_adapter(tensors, 1.5, tmp_path / "v1")
    assert sorted(p.name for p in written.iterdir()) == [PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE]
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]  # no scratch directory left

    source.save_pretrained(str(tmp_path / "by_peft"))
    ours, theirs = (load_file(str(d / PEFT_WEIGHTS_FILE)) for d in (written, tmp_path / "by_peft"))
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    config = json.loads((written / PEFT_CONFIG_FILE).read_text())
    peft_config = json.loads((tmp_path / "by_peft" / PEFT_CONFIG_FILE).read_text())
    assert (config["r"], config["lora_alpha"]) == (peft_config["r"], peft_config["lora_alpha"])
    assert set(config["target_modules"]) == set(peft_config["target_modules"])

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_policy_dir),
                                       str(written)).eval()
    engine = TransformersEngine.from_pretrained(str(tiny_policy_dir), max_batch_size=2)
    engine.load_adapter(tensors, 1.5, 1)
    with torch.no_grad():
        want = source(input_ids=IDS).logits
        got = loaded(input_ids=IDS).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_policy_dir)(input_ids=IDS).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(engine.model(input_ids=IDS).logits, got,
                                   rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, base, atol=1e-3)  # the adapter changes the model


def test_writer_refuses_what_is_not_one_plain_lora_adapter(tiny_policy_dir, tmp_path):
    _, tensors = peft_adapter(tiny_policy_dir, seed=2)
    name = next(iter(tensors))
    cases = {
        "not LoRA adapter tensors": {**tensors, "base_model.model.lm_head.weight":
                                     torch.zeros(2, 2)},
        "pair incomplete": {k: v for k, v in tensors.items() if k != name},
        "mixes LoRA ranks": {**tensors, "base_model.model.x.lora_A.default.weight":
                             torch.zeros(2, 3), "base_model.model.x.lora_B.default.weight":
                             torch.zeros(3, 2)},
        "holds no LoRA pair": {},
    }
    for match, bad in cases.items():
        with pytest.raises(ValueError, match=match):
            write_peft_adapter(bad, 2.0, tmp_path / "bad")
    write_peft_adapter(tensors, 2.0, tmp_path / "v1")
    with pytest.raises(ValueError, match="exists already"):
        write_peft_adapter(tensors, 2.0, tmp_path / "v1")
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]


# ------------------------------------------------------------------ engine args


def test_lora_engine_args_follow_learner_lora(tmp_path):
    def kwargs(*overrides):
        config = load_config(overrides=[f"model.path={tmp_path}", "rollout.engine=vllm",
                                        *overrides])
        return vllm_engine_kwargs(config.rollout, config.model, config.learner.lora)

    lora = kwargs("learner.lora.rank=4", "learner.lora.publish=adapter")
    assert {k: lora[k] for k in ("enable_lora", "max_lora_rank", "max_loras",
                                 "max_cpu_loras")} == {
        "enable_lora": True, "max_lora_rank": 8, "max_loras": MAX_LORAS,
        "max_cpu_loras": MAX_CPU_LORAS}
    assert MAX_CPU_LORAS > MAX_LORAS  # adding the newest never evicts a running one
    for off in (("learner.lora.rank=4",), ("learner.lora.publish=adapter",), ()):
        assert "enable_lora" not in kwargs(*off)  # merged weights or no LoRA: vLLM without it
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [
        1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError, match="above vLLM's largest"):
        kwargs("learner.lora.rank=600", "learner.lora.publish=adapter")
    with pytest.raises(ValueError, match="enable_lora"):
        kwargs("rollout.vllm_engine_args={enable_lora: true}")


# ------------------------------------------------------------------ bookkeeping


class LoraLLMEngine:
    """vLLM's V1 `LLMEngine` contract for requests and LoRA adapters (see the module doc)."""

    TOKEN = 100

    def __init__(self, lengths: list[int] | None = None) -> None:
        self.lengths = list(lengths or [])
        self.requests: dict[str, dict] = {}
        self.loras: dict[int, SimpleNamespace] = {}
        self.added: list[int] = []
        self.removed: list[int] = []
        self.aborted: list[str] = []
        self.fail_add: str | None = None
        self.rpc_calls: list[str] = []

    def add_lora(self, lora_request) -> bool:
        if self.fail_add:
            raise Exception(self.fail_add)  # SyncMPClient re-raises a worker's error so
        path = Path(lora_request.lora_path)
        config = json.loads((path / PEFT_CONFIG_FILE).read_text())  # what every worker reads
        assert (path / PEFT_WEIGHTS_FILE).is_file() and config["r"] > 0
        self.loras[lora_request.lora_int_id] = lora_request
        self.added.append(lora_request.lora_int_id)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return self.loras.pop(lora_id, None) is not None

    def add_request(self, request_id, prompt_ids, max_tokens, lora_request=None):
        if lora_request is not None:
            assert lora_request.lora_int_id in self.loras, "vLLM: unknown adapter"
        length = self.lengths.pop(0) if self.lengths else max_tokens
        self.requests[request_id] = {"length": min(length, max_tokens), "tokens": [],
                                     "lora": lora_request}

    def abort_request(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpc_calls.append(method)
        raise AssertionError("an adapter must not go through the worker extension")

    def step(self):
        outputs = []
        for request_id, state in list(self.requests.items()):
            lora = state["lora"]
            if lora is not None:  # the worker needs the adapter, from memory or from disk
                assert lora.lora_int_id in self.loras, f"adapter {lora.lora_int_id} removed"
                assert Path(lora.lora_path, PEFT_WEIGHTS_FILE).is_file(), "directory gone"
            state["tokens"].append(self.TOKEN)
            finished = len(state["tokens"]) >= state["length"]
            completion = SimpleNamespace(
                finish_reason="length" if finished else None, stop_reason=None,
                token_ids=list(state["tokens"]),
                logprobs=[{self.TOKEN: -0.5}] * len(state["tokens"]))
            outputs.append(SimpleNamespace(request_id=request_id, finished=finished,
                                           outputs=[completion]))
            if finished:
                del self.requests[request_id]
        return outputs


class StandInVLLMEngine(VLLMEngine):
    """The two vLLM-typed spots replaced by the stand-in's plain equivalents."""

    def _submit(self, key, request, lora_request=None):
        self.llm_engine.add_request(key, list(request.prompt_ids), request.params.max_tokens,
                                    lora_request)

    def _lora_request(self, slot):
        return SimpleNamespace(**lora_request_kwargs(slot))


def lora_engine(tmp_path, lengths=None, max_rank=8) -> StandInVLLMEngine:
    return StandInVLLMEngine(LoraLLMEngine(lengths), tokenizer=None, max_batch_size=8,
                             lora=AdapterVersions(max_rank=max_rank, root=tmp_path / "loras"))


def request(max_tokens: int = 10) -> GenerationRequest:
    return GenerationRequest([1, 2, 3], SamplingParams(max_tokens=max_tokens))


def run(engine: VLLMEngine) -> dict[int, object]:
    done = {}
    while engine.has_unfinished():
        for output in engine.step():
            done[output.request.request_id] = output
    return done


def run_requests(engine: VLLMEngine, requests: list[GenerationRequest]) -> list:
    for index, req in enumerate(requests):
        req.request_id = index
        engine.add_request(req)
    done = run(engine)
    return [done[i] for i in range(len(requests))]


def test_new_requests_get_the_newest_adapter_and_old_ones_go_when_unused(tiny_policy_dir,
                                                                        tmp_path):
    _, first = peft_adapter(tiny_policy_dir, seed=1)
    _, second = peft_adapter(tiny_policy_dir, seed=2)
    engine = lora_engine(tmp_path, lengths=[1, 5, 2])
    llm, root = engine.llm_engine, tmp_path / "loras"
    engine.add_request(GenerationRequest([1], SamplingParams(max_tokens=3), request_id=0))
    engine.load_adapter(first, 2.0, 1)
    assert llm.added == [1] and engine.policy_version == 1 and (root / "v1").is_dir()
    engine.add_request(GenerationRequest([1], SamplingParams(max_tokens=10), request_id=1))
    engine.load_adapter(second, 2.0, 2)  # request 1 is still running on v1
    assert llm.added == [1, 2] and llm.removed == [] and engine.lora.registered == [1, 2]
    engine.add_request(GenerationRequest([1], SamplingParams(max_tokens=10), request_id=2))
    loras = {r["lora"].lora_name if r["lora"] else None for r in llm.requests.values()}
    assert loras == {None, "forage-v1", "forage-v2"}

    done = {}
    while engine.has_unfinished():
        for output in engine.step():
            done[output.request.request_id] = output
        if 1 not in done:
            assert 1 not in llm.removed and (root / "v1").is_dir()
    assert llm.removed == [1] and not (root / "v1").exists() and engine.lora.registered == [2]
    # each request's tokens come from the one version it started with
    assert [(done[i].version_start, done[i].version_end) for i in range(3)] == [
        (0, 0), (1, 1), (2, 2)]
    assert sorted(p.name for p in root.iterdir()) == ["v2"]


def test_the_current_adapter_stays_and_abort_all_frees_the_old_one(tiny_policy_dir, tmp_path):
    _, first = peft_adapter(tiny_policy_dir, seed=1)
    _, second = peft_adapter(tiny_policy_dir, seed=2)
    engine = lora_engine(tmp_path)
    llm = engine.llm_engine
    engine.load_adapter(first, 2.0, 1)
    run_requests(engine, [request(max_tokens=2)])
    assert llm.removed == [] and engine.lora.registered == [1]  # the newest is never removed
    engine.add_request(request(max_tokens=50))
    engine.load_adapter(second, 2.0, 2)
    assert llm.removed == []
    engine.abort_all()  # a failed batch: the v1 request is gone
    assert llm.removed == [1] and engine.lora.registered == [2]
    engine.load_adapter(first, 2.0, 3)  # nothing live: v2 goes at once
    assert llm.removed == [1, 2] and engine.lora.registered == [3]
    [out] = run_requests(engine, [request(max_tokens=2)])
    assert (out.version_start, out.version_end) == (3, 3)


def test_a_refused_adapter_leaves_the_old_one_serving(tiny_policy_dir, tmp_path):
    _, first = peft_adapter(tiny_policy_dir, seed=1)
    _, wide = peft_adapter(tiny_policy_dir, seed=3, rank=16)
    engine = lora_engine(tmp_path, max_rank=8)
    llm, root = engine.llm_engine, tmp_path / "loras"
    engine.load_adapter(first, 2.0, 1)

    llm.fail_add = "While loading /x, expected target modules in {...}"
    with pytest.raises(ValueError, match="did not load adapter v2.*expected target modules"):
        engine.load_adapter(first, 2.0, 2)
    assert llm.removed == [2]  # any worker that did load it drops it again
    llm.fail_add = None
    with pytest.raises(ValueError, match="rank 16, above the engine's max_lora_rank 8"):
        engine.load_adapter(wide, 2.0, 3)
    with pytest.raises(ValueError, match="not newer"):
        engine.load_adapter(first, 2.0, 1)
    assert llm.added == [1] and engine.policy_version == 1 and engine.lora.current.version == 1
    assert sorted(p.name for p in root.iterdir()) == ["v1"]
    [out] = run_requests(engine, [request(max_tokens=2)])
    assert out.version_end == 1

    with pytest.raises(ValueError, match="serves LoRA adapters"):
        engine.pull_weights(5, "127.0.0.1:1", None)  # full weights under adapters: refused
    assert llm.rpc_calls == []
    plain = StandInVLLMEngine(LoraLLMEngine(), tokenizer=None, max_batch_size=2)
    with pytest.raises(ValueError, match="started without LoRA"):
        plain.load_adapter(first, 2.0, 1)


def test_an_adapter_for_another_base_is_refused_before_vllm_sees_it(tiny_policy_dir, tmp_path):
    _, tensors = peft_adapter(tiny_policy_dir, seed=1)
    other = tmp_path / "other"
    shutil.copytree(tiny_policy_dir, other)
    (other / "config.json").write_text((other / "config.json").read_text() + "\n")
    engine = lora_engine(tmp_path)
    with pytest.raises(ValueError, match="trained on base model"):
        load_published(engine, str(tiny_policy_dir), 1, tensors,
                       adapter_metadata(2.0, model_fingerprint(other)))
    assert engine.llm_engine.added == [] and engine.policy_version == 0
    assert list((tmp_path / "loras").iterdir()) == []
    load_published(engine, str(tiny_policy_dir), 1, tensors,
                   adapter_metadata(2.0, model_fingerprint(tiny_policy_dir)))
    assert engine.llm_engine.added == [1] and engine.policy_version == 1


def test_the_default_root_is_a_temporary_directory_removed_on_close(tiny_policy_dir):
    _, tensors = peft_adapter(tiny_policy_dir, seed=1)
    versions = AdapterVersions(max_rank=8)
    slot = versions.prepare(1, tensors, 2.0)
    assert Path(slot.path).is_dir() and Path(slot.path).parent == versions.root
    versions.close()
    assert not versions.root.exists()


# ------------------------------------------------------------------ the rollout worker


def test_rollout_worker_hands_an_adapter_publish_to_vllms_lora_path(tiny_policy_dir, tmp_path):
    """GetVersion says "adapter": the replica fetches exactly that version itself and the engine
    registers it with add_lora; the workers' stage/commit path is never used. A full-weight
    publish to the same LoRA engine is refused and counted, the adapter serving on."""
    from prometheus_client import REGISTRY

    from services.common.weight_sync import WeightSyncServer
    from services.rollout.worker import RolloutWorker

    _, tensors = peft_adapter(tiny_policy_dir, seed=1)
    base = model_fingerprint(tiny_policy_dir)
    engine = lora_engine(tmp_path)
    with WeightSyncServer() as server:
        host, port = server.address.rsplit(":", 1)
        config = load_config(overrides=[
            f"model.path={tiny_policy_dir}", "rollout.engine=vllm", "rollout.use_search=false",
            f"learner.weight_sync_host={host}", f"learner.weight_sync_port={port}",
            "learner.lora.rank=4", "learner.lora.publish=adapter"])
        worker = RolloutWorker(config, engine=engine)
        name = "forage_rollout_weight_sync_failures_total"
        try:
            server.publish(tensors, 3, adapter_metadata(2.0, base))
            assert worker._poll_weights(force=True) is True
            assert engine.policy_version == 3 and engine.llm_engine.added == [3]
            assert engine.llm_engine.rpc_calls == []
            state = {k: torch.zeros(2) for k in ("a.weight", "b.weight")}
            server.publish(state, 4)
            failures = REGISTRY.get_sample_value(name) or 0.0
            assert worker._poll_weights(force=True) is False
            assert REGISTRY.get_sample_value(name) == failures + 1
            assert engine.policy_version == 3 and engine.llm_engine.rpc_calls == []
        finally:
            worker.loop.close()
            worker._client().close()


def test_the_worker_extension_refuses_to_stage_an_adapter(tiny_policy_dir):
    """Adapter tensors are no state dict: were the full-weight path ever asked to load one,
    every rank refuses it and nothing is staged."""
    from services.common.weight_sync import WeightSyncServer
    from services.rollout.vllm_worker import WorkerWeightLoader

    _, tensors = peft_adapter(tiny_policy_dir, seed=1)
    loader = WorkerWeightLoader(rank=0)
    with WeightSyncServer() as server:
        server.publish(tensors, 2, adapter_metadata(2.0, model_fingerprint(tiny_policy_dir)))
        result = loader.stage(2, server.address)
        loader.close()
    assert (result["ok"], result["reason"]) == (False, "manifest")
    assert "VLLMEngine.load_adapter" in result["error"] and loader._staged is None
