"""What a replica does with a published weight set: full weights go in as they are; a LoRA
adapter is applied only onto the base model it was trained on (services/common/lora.py,
model_identity.py). Every refusal is a ValueError, which the worker logs while the old weights
keep serving."""

from __future__ import annotations

from typing import Any

from services.common.lora import read_adapter_metadata
from services.common.model_identity import model_fingerprint


def load_published(engine: Any, model_path: str, version: int, tensors: dict[str, Any],
                   meta: dict[str, str]) -> None:
    adapter = read_adapter_metadata(meta)
    if adapter is None:
        engine.load_weights(tensors, version)
        return
    scale, base = adapter
    load_adapter = getattr(engine, "load_adapter", None)
    if load_adapter is None:
        raise ValueError(f"the {type(engine).__name__} cannot apply a LoRA adapter; publish "
                         "merged weights (learner.lora.publish: merged)")
    mine = model_fingerprint(model_path)
    if mine != base:
        raise ValueError(f"the adapter was trained on base model {base}; this replica holds "
                         f"{mine} ({model_path}): keeping the current weights")
    load_adapter(tensors, scale, version)
