"""LoRA adapter tensors as they travel between services: names, deltas, the manifest's words.

Shared by the learner (which trains the adapter with peft and publishes it) and the rollout
engines (which apply it to the base weights they hold), so both read peft's names the same way.
An adapter is a set of tensors under peft's names,
`base_model.model.<module>.lora_A.default.weight` (rank x in) and `...lora_B.default.weight`
(out x rank); the base weight it changes is `<module>.weight`, by B @ A x scaling.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

PEFT_PREFIX = "base_model.model."
BASE_LAYER = ".base_layer."
ADAPTER = "default"  # peft's adapter name: Forage trains one adapter
KIND = "lora"  # the manifest's `kind` for an adapter (a full state dict has none)


def adapter_pair(name: str) -> tuple[str, str] | None:
    """(module path under peft's prefix, 'A' or 'B') for an adapter tensor, else None."""
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


def lora_deltas(tensors: Mapping[str, torch.Tensor],
                scale: float) -> dict[str, torch.Tensor]:
    """{base weight name: B @ A x scale (float32)} for every adapter pair in `tensors`; other
    entries are ignored. Raises ValueError on a pair with a missing half or mismatched rank."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        found = adapter_pair(name)
        if found is not None:
            pairs.setdefault(found[0], {})[found[1]] = tensor
    deltas: dict[str, torch.Tensor] = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{module}: LoRA pair incomplete ({sorted(pair)})")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"{module}: LoRA shapes B {tuple(b.shape)} x A {tuple(a.shape)} "
                             "do not multiply")
        deltas[base_name(module) + ".weight"] = (b.float() @ a.float()) * float(scale)
    return deltas


def adapter_metadata(scale: float, base_fingerprint: str) -> dict[str, str]:
    """The manifest metadata of an adapter (plain strings, as the manifest holds them)."""
    return {"kind": KIND, "lora_scaling": repr(float(scale)), "base_model": base_fingerprint}


def read_adapter_metadata(metadata: Mapping[str, str]) -> tuple[float, str] | None:
    """(scaling, base fingerprint) of an adapter's manifest, None for a full state dict."""
    if metadata.get("kind") != KIND:
        return None
    try:
        scale = float(metadata["lora_scaling"])
        base = metadata["base_model"]
    except (KeyError, ValueError) as exc:
        raise ValueError(f"LoRA manifest metadata is incomplete or bad: {exc}") from None
    if not base or scale != scale:  # NaN
        raise ValueError("LoRA manifest metadata has no base model or a NaN scaling")
    return scale, base
