"""LoRA (services/learner/lora.py): the merged export equals peft's own model, exactly enough to
serve, and the adapter alone is what peft saves."""

from __future__ import annotations

import copy

import pytest
import torch

from services.common.config.learner import LearnerSection, LoraSettings
from services.learner import lora


def _wrapped(tiny_policy_dir, rank: int = 4, targets="all-linear"):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_policy_dir)
    settings = LoraSettings(rank=rank, alpha=8.0, target_modules=targets)
    model = lora.apply_lora(base, settings)
    torch.manual_seed(1)
    with torch.no_grad():  # peft starts B at zero (a no-op adapter): give it something to merge
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return model, settings


def test_merged_export_equals_the_peft_model(tiny_policy_dir):
    from transformers import AutoModelForCausalLM

    model, settings = _wrapped(tiny_policy_dir)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    merged = lora.merge_lora_state(state, lora.scaling(settings))
    fresh = AutoModelForCausalLM.from_pretrained(tiny_policy_dir)
    assert set(merged) == set(fresh.state_dict())  # the base model's own names, nothing else
    fresh.load_state_dict(merged, strict=True)
    ids = torch.randint(5, 200, (2, 24))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = fresh(input_ids=ids).logits
        peft_merged = copy.deepcopy(model).merge_and_unload()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, peft_merged, rtol=1e-5, atol=1e-6)
    # the exported base is untouched: an unadapted tensor passes through bit for bit
    base = AutoModelForCausalLM.from_pretrained(tiny_policy_dir).state_dict()
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])


def test_adapter_state_is_what_peft_saves(tiny_policy_dir, tmp_path):
    from peft.utils import get_peft_model_state_dict

    model, _ = _wrapped(tiny_policy_dir, targets=["q_proj", "v_proj"])
    adapter = lora.adapter_state(model.state_dict())
    assert adapter and all(".lora_" in k for k in adapter)
    assert len(adapter) == 2 * 2 * model.config.num_hidden_layers  # A and B, q and v, per layer
    peft_own = get_peft_model_state_dict(model)
    assert len(peft_own) == len(adapter)
    for name, tensor in peft_own.items():  # peft drops the adapter name in its file's keys
        assert torch.equal(tensor, adapter[name.replace(".weight", ".default.weight")])


def test_bad_settings_and_broken_states_are_named(tiny_policy_dir):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="matched no layer|Target modules"):
        lora.apply_lora(AutoModelForCausalLM.from_pretrained(tiny_policy_dir),
                        LoraSettings(rank=2, target_modules=["no_such_proj"]))
    model, settings = _wrapped(tiny_policy_dir)
    state = dict(model.state_dict())
    state.pop(next(k for k in state if "lora_A" in k))
    with pytest.raises(ValueError, match="LoRA pair incomplete"):
        lora.merge_lora_state(state, lora.scaling(settings))
    assert not LearnerSection().lora.enabled
    assert LearnerSection.model_validate({"lora": {"rank": 8}}).lora.enabled
    with pytest.raises(ValueError):
        LearnerSection.model_validate({"lora": {"rank": 8, "alpah": 16}})


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_lora_trainer_trains_the_adapter_and_checkpoints_both_forms(
        tiny_policy_dir, samples_factory, tmp_path, zero_stage):
    """Under DeepSpeed, only the adapter moves; the export is the merged model under the base
    names; a checkpoint holds it (policy/) and the adapter in peft's format (adapter/), and
    both give the trained model's logits; the run resumes from it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from services.learner.checkpoint import TrainerState, load_checkpoint, save_checkpoint
    from services.learner.trainer import PolicyTrainer

    cfg = LearnerSection(lr=5e-3, micro_batch_tokens=512, zero_stage=zero_stage,
                         lora=LoraSettings(rank=4, alpha=8.0))
    trainer = PolicyTrainer(str(tiny_policy_dir), cfg)
    base = AutoModelForCausalLM.from_pretrained(tiny_policy_dir).state_dict()
    batches = [samples_factory(5, seed=s) for s in range(2)]
    frozen = {n: p.detach().clone() for n, p in trainer.policy.module.named_parameters()
              if not p.requires_grad}
    first = trainer.sft_step(batches[0])
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.policy.module.named_parameters()
               if n in frozen)  # the base never moves
    exported = trainer.state_dict_for_export()
    assert set(exported) == set(base)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(exported[q], base[q])  # the adapter learnt something, merged in
    assert torch.equal(exported["model.norm.weight"], base["model.norm.weight"])
    adapter = trainer.adapter_for_export()  # what publish: adapter sends, unmerged
    assert adapter and set(adapter) == set(trainer.export()[1])
    assert all(".lora_" in name for name in adapter)

    path = save_checkpoint(trainer, tmp_path / "ckpt", TrainerState(step=1, policy_version=1),
                           tokenizer_from=tiny_policy_dir)
    assert (path / "adapter" / "adapter_config.json").is_file()
    ids = torch.tensor([batches[1][0].input_ids.tolist()])
    with torch.no_grad():
        trainer.policy.module.eval()
        want = trainer.policy.module(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(path / "policy")(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_policy_dir), path / "adapter")
        via_adapter = adapted(input_ids=ids).logits
    torch.testing.assert_close(merged, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(via_adapter, want, rtol=1e-5, atol=1e-6)

    uninterrupted = trainer.sft_step(batches[1])
    resumed = PolicyTrainer(str(tiny_policy_dir), cfg)
    load_checkpoint(resumed, path)
    assert resumed.sft_step(batches[1])["loss"] == pytest.approx(uninterrupted["loss"], abs=1e-6)
    assert first["loss"] > 0
