"""LoRA adapter tensors as they travel between services: names, deltas, the manifest's words.

Shared by the learner (which trains the adapter with peft and publishes it) and the rollout
engines (which apply it to the base weights they hold), so both read peft's names the same way.
An adapter is a set of tensors under peft's names,
`base_model.model.<module>.lora_A.default.weight` (rank x in) and `...lora_B.default.weight`
(out x rank); the base weight it changes is `<module>.weight`, by B @ A x scaling.

`write_peft_adapter` turns such a set into peft's on-disk format, the one vLLM's LoRA support
loads (its `LoRARequest` names a directory; vLLM 0.32/0.33 have no in-memory form).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

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


def lora_pairs(tensors: Mapping[str, torch.Tensor]
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module path under peft's prefix: (A, B)} for every adapter pair in `tensors`; other
    entries are ignored. Raises ValueError on a pair with a missing half or mismatched rank."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        found = adapter_pair(name)
        if found is not None:
            halves.setdefault(found[0], {})[found[1]] = tensor
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{module}: LoRA pair incomplete ({sorted(pair)})")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"{module}: LoRA shapes B {tuple(b.shape)} x A {tuple(a.shape)} "
                             "do not multiply")
        pairs[module] = (a, b)
    return pairs


def lora_deltas(tensors: Mapping[str, torch.Tensor],
                scale: float) -> dict[str, torch.Tensor]:
    """{base weight name: B @ A x scale (float32)} for every adapter pair in `tensors`; other
    entries are ignored. Raises ValueError on a pair with a missing half or mismatched rank."""
    return {base_name(module) + ".weight": (b.float() @ a.float()) * float(scale)
            for module, (a, b) in lora_pairs(tensors).items()}


def adapter_rank(tensors: Mapping[str, torch.Tensor]) -> int:
    """The one LoRA rank of an adapter (Forage trains a single `learner.lora.rank`).

    Raises ValueError when `tensors` holds no pair or pairs of different ranks: peft's format
    would need a `rank_pattern` for those, which Forage never produces."""
    ranks = {int(a.shape[0]) for a, _ in lora_pairs(tensors).values()}
    if not ranks:
        raise ValueError("the adapter holds no LoRA pair")
    if len(ranks) > 1:
        raise ValueError(f"the adapter mixes LoRA ranks {sorted(ranks)}")
    return ranks.pop()


# The files of peft's format (`PeftModel.save_pretrained`), which vLLM's LoRA loader reads.
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


def peft_file_name(name: str) -> str:
    """A peft state-dict name as peft saves it: the adapter's name dropped
    (`...lora_A.default.weight` -> `...lora_A.weight`), as peft's `get_peft_model_state_dict`
    does. vLLM's loader accepts only this form (it reads `lora_A`/`lora_B` right before
    `weight`)."""
    found = adapter_pair(name)
    if found is None:
        raise ValueError(f"{name!r} is not a LoRA adapter tensor")
    module, which = found
    return f"{module}.lora_{which}.weight"


def write_peft_adapter(tensors: Mapping[str, torch.Tensor], scale: float,
                       directory: str | os.PathLike[str]) -> Path:
    """Write an adapter (peft's in-memory names, as published) as a peft adapter directory.

    Why: vLLM loads a LoRA adapter only from a directory in peft's format
    (`adapter_config.json` + `adapter_model.safetensors`), so the vLLM engine turns each
    published adapter into one. The config gives `r` (from the tensors) and
    `lora_alpha = scale * r`, so that peft's and vLLM's scaling `lora_alpha / r` is the
    published scaling; `target_modules` lists the adapted layers' own names. Every tensor must
    be half of a LoRA pair: anything else (a `modules_to_save` copy, a bias) would change what
    the adapter means, so it is refused rather than dropped. The directory appears complete or
    not at all (written next to it, then renamed); it must not exist yet.
    """
    target = Path(directory)
    if target.exists():
        raise ValueError(f"{target} exists already: an adapter directory is written once")
    others = [name for name in tensors if adapter_pair(name) is None]
    if others:
        raise ValueError(f"not LoRA adapter tensors: {sorted(others)[:3]}")
    rank = adapter_rank(tensors)  # also checks every pair is complete and multiplies
    modules = sorted({module.rsplit(".", 1)[-1] for module in lora_pairs(tensors)})
    alpha = float(scale) * rank
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "target_modules": modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        save_file({peft_file_name(name): tensor.detach().cpu().contiguous()
                   for name, tensor in tensors.items()},
                  str(scratch / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
        (scratch / PEFT_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        os.replace(scratch, target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return target


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
