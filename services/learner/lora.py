"""LoRA for the policy (`learner.lora`), through peft.

Why peft: it is the library TRL, verl and OpenRLHF all use for LoRA, and its adapter format
(`adapter_config.json` + `adapter_model.safetensors`) is what users load elsewhere. Its defaults
follow verl's (`lora_rank` 0 = off, `lora_alpha` 16, `target_modules: all-linear`), with
peft's standard scaling alpha / rank.

Only the adapter trains: the base weights are frozen (requires_grad False), so DeepSpeed's
optimizer holds state for the adapter alone. What leaves the learner is computed from the full
state dict the engine exports (gathered under ZeRO-3), by pure functions on tensors:
- `merge_lora_state`: the merged model under the base model's own names (W + B @ A x scaling,
  computed in float32 from the exact base weights, never by merging into the live module and
  unmerging, which would drift the base a little on every export);
- `adapter_state`: the adapter tensors alone, under peft's names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from services.common.lora import adapter_pair, base_name, lora_deltas


def lora_config(settings: Any):
    """peft's LoraConfig from `learner.lora` (LoraSettings)."""
    from peft import LoraConfig

    targets = settings.target_modules
    return LoraConfig(r=int(settings.rank), lora_alpha=float(settings.alpha),
                      lora_dropout=float(settings.dropout),
                      target_modules=targets if isinstance(targets, str) else list(targets),
                      bias="none", task_type="CAUSAL_LM")


def apply_lora(model: torch.nn.Module, settings: Any) -> torch.nn.Module:
    """Wrap `model` with a fresh LoRA adapter; only the adapter's parameters train."""
    from peft import get_peft_model

    wrapped = get_peft_model(model, lora_config(settings))
    if not any(p.requires_grad for p in wrapped.parameters()):
        raise ValueError(f"learner.lora.target_modules {settings.target_modules!r} matched no "
                         "layer of the model")
    return wrapped


def scaling(settings: Any) -> float:
    return float(settings.alpha) / float(settings.rank)


def merge_lora_state(state: Mapping[str, torch.Tensor],
                     scale: float) -> dict[str, torch.Tensor]:
    """The merged model's state dict under the base model's names.

    Each adapted linear layer's weight is W + (B @ A) x `scale`, computed in float32 and cast
    back to W's dtype; every other tensor is passed through renamed. Raises if an adapter pair
    is incomplete or its shapes do not fit the base weight.
    """
    deltas = lora_deltas(state, scale)
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if adapter_pair(name) is not None:
            continue
        target = base_name(name)
        delta = deltas.pop(target, None) if name.endswith(".base_layer.weight") else None
        if delta is not None:
            if delta.shape != tensor.shape:
                raise ValueError(f"{target}: LoRA delta {tuple(delta.shape)} does not fit the "
                                 f"weight {tuple(tensor.shape)}")
            tensor = (tensor.float() + delta).to(tensor.dtype)
        merged[target] = tensor
    if deltas:
        raise ValueError(f"LoRA tensors without a base weight: {sorted(deltas)[:3]}")
    return merged


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors alone (peft's names), e.g. for a PEFT-format checkpoint."""
    return {name: tensor for name, tensor in state.items() if adapter_pair(name) is not None}
