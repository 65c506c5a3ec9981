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

PEFT_PREFIX = "base_model.model."
BASE_LAYER = ".base_layer."
ADAPTER = "default"  # peft's adapter name: Forage trains one adapter


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


def _lora_names(name: str) -> tuple[str, str] | None:
    """('module path', 'A' or 'B') for an adapter tensor of the default adapter, else None."""
    for which in ("A", "B"):
        marker = f".lora_{which}.{ADAPTER}.weight"
        if name.endswith(marker):
            return name[: -len(marker)], which
    return None


def base_name(name: str) -> str:
    """The base model's own name of a peft state-dict entry (prefix and base_layer dropped)."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    return name.replace(BASE_LAYER, ".")


def merge_lora_state(state: Mapping[str, torch.Tensor],
                     scale: float) -> dict[str, torch.Tensor]:
    """The merged model's state dict under the base model's names.

    Each adapted linear layer's weight is W + (B @ A) x `scale`, computed in float32 and cast
    back to W's dtype; every other tensor is passed through renamed. Raises if an adapter pair
    is incomplete or its shapes do not fit the base weight.
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        found = _lora_names(name)
        if found is not None:
            pairs.setdefault(found[0], {})[found[1]] = tensor
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if _lora_names(name) is not None:
            continue
        module = name[: -len(".base_layer.weight")] if name.endswith(".base_layer.weight") \
            else None
        if module is not None and module in pairs:
            pair = pairs.pop(module)
            if set(pair) != {"A", "B"}:
                raise ValueError(f"{module}: LoRA pair incomplete ({sorted(pair)})")
            delta = pair["B"].float() @ pair["A"].float()
            if delta.shape != tensor.shape:
                raise ValueError(f"{module}: LoRA delta {tuple(delta.shape)} does not fit the "
                                 f"weight {tuple(tensor.shape)}")
            tensor = (tensor.float() + delta * scale).to(tensor.dtype)
        merged[base_name(name)] = tensor
    if pairs:
        raise ValueError(f"LoRA tensors without a base weight: {sorted(pairs)[:3]}")
    return merged


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors alone (peft's names), e.g. for a PEFT-format checkpoint."""
    return {name: tensor for name, tensor in state.items() if _lora_names(name) is not None}
