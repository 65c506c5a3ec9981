"""A peft model with a random, non-zero LoRA adapter, for the LoRA tests of both engines."""

from __future__ import annotations

import torch


def random_peft_model(model_dir, seed: int, rank: int, alpha: float, scale: float,
                      dtype: torch.dtype | None = None):
    """`model_dir` under a LoRA adapter on every linear layer, its weights drawn from
    N(0, scale²) with `seed` (peft starts B at zero, which would make any adapter a no-op), and
    the adapter's tensors under peft's in-memory names: what the learner publishes."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha,
                                            target_modules="all-linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(scale * torch.randn(param.shape, generator=g))
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items() if ".lora_" in k}
    return model.eval(), tensors
