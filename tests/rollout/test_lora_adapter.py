"""LoRA adapters from the learner to a replica: only the adapter crosses the wire (with the base
model's fingerprint), the transformers engine applies it onto an exact copy of its base, and a
replica holding another base keeps its weights."""

from __future__ import annotations

import shutil

import pytest
import torch

from services.common.lora import adapter_metadata, lora_deltas, read_adapter_metadata
from services.common.model_identity import model_fingerprint
from services.common.weight_sync import WeightSyncClient, WeightSyncServer
from services.rollout.published import load_published
from services.rollout.transformers_engine import TransformersEngine


def _adapter(tiny_policy_dir, seed: int):
    """A peft model over the tiny policy with a random (non-zero) adapter, and its tensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_policy_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.05)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items() if ".lora_" in k}
    return model.eval(), tensors


def test_only_the_adapter_travels_and_the_engine_applies_it_exactly(tiny_policy_dir):
    torch.set_num_threads(1)
    peft_model, tensors = _adapter(tiny_policy_dir, 1)
    base = model_fingerprint(tiny_policy_dir)
    engine = TransformersEngine.from_pretrained(str(tiny_policy_dir), max_batch_size=2)
    full_bytes = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())
    with WeightSyncServer() as server:
        manifest = server.publish(tensors, 1, adapter_metadata(2.0, base))
        client = WeightSyncClient(server.address)
        version, fetched, meta = client.fetch_with_metadata()
        client.close()
    assert manifest.total_bytes < full_bytes / 4  # the adapter, not the model
    assert read_adapter_metadata(meta) == (2.0, base)
    load_published(engine, str(tiny_policy_dir), version, fetched, meta)
    assert engine.policy_version == 1
    ids = torch.randint(5, 300, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(engine.model(input_ids=ids).logits,
                                   peft_model(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    print(f"adapter {manifest.total_bytes} bytes vs full model {full_bytes} bytes")


def test_versions_never_drift_from_the_base(tiny_policy_dir):
    """v1 then v2 gives bit for bit what v2 alone gives; a full load resets the base."""
    _, first = _adapter(tiny_policy_dir, 1)
    _, second = _adapter(tiny_policy_dir, 2)
    chained = TransformersEngine.from_pretrained(str(tiny_policy_dir), max_batch_size=2)
    direct = TransformersEngine.from_pretrained(str(tiny_policy_dir), max_batch_size=2)
    original = {k: v.clone() for k, v in direct.model.state_dict().items()}
    chained.load_adapter(first, 2.0, 1)
    chained.load_adapter(second, 2.0, 2)
    direct.load_adapter(second, 2.0, 2)
    for name, tensor in direct.model.state_dict().items():
        assert torch.equal(chained.model.state_dict()[name], tensor), name
    delta = lora_deltas(second, 2.0)["model.layers.0.self_attn.q_proj.weight"]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(direct.model.state_dict()[q], original[q] + delta)
    direct.load_weights(original, 3)  # full weights: the adapter's base copies are dropped
    direct.load_adapter(second, 2.0, 4)
    assert torch.equal(direct.model.state_dict()[q], original[q] + delta)


def test_another_base_or_a_bad_adapter_keeps_the_old_weights(tiny_policy_dir, tmp_path):
    _, tensors = _adapter(tiny_policy_dir, 1)
    engine = TransformersEngine.from_pretrained(str(tiny_policy_dir), max_batch_size=2)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    other = tmp_path / "other"
    shutil.copytree(tiny_policy_dir, other)
    (other / "config.json").write_text((other / "config.json").read_text() + "\n")
    meta = adapter_metadata(2.0, model_fingerprint(other))
    with pytest.raises(ValueError, match="trained on base model"):
        load_published(engine, str(tiny_policy_dir), 5, tensors, meta)
    broken = dict(tensors)
    broken.pop(next(k for k in broken if "lora_B" in k))
    with pytest.raises(ValueError, match="pair incomplete"):
        load_published(engine, str(tiny_policy_dir), 5,
                       broken, adapter_metadata(2.0, model_fingerprint(tiny_policy_dir)))
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert engine.policy_version == 0
    with pytest.raises(ValueError, match="incomplete or bad"):
        read_adapter_metadata({"kind": "lora", "lora_scaling": "x", "base_model": "ab"})
    with WeightSyncServer() as server, pytest.raises(ValueError, match="strings"):
        server.publish(tensors, 1, {"kind": 3})
