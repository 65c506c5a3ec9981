"""LoRA adapters on the vLLM engine: which adapter a new request gets, and when an old one goes.

Plain Python (no vLLM import), so the bookkeeping is tested where vLLM cannot run; the few
lines that build vLLM's `LoRARequest` and call `add_lora` / `remove_lora` live in
`VLLMEngine` (services/rollout/vllm_engine.py).

How vLLM serves adapters (V1, 0.32/0.33): `LLMEngine.add_lora(LoRARequest(lora_name,
lora_int_id, lora_path))` makes every worker load the peft directory at `lora_path`; a request
runs with an adapter when `add_request(..., lora_request=...)` names it, and keeps that adapter
until it finishes, even if newer ones are added meanwhile. A worker reloads an adapter from
`lora_path` whenever a request needs it and it was evicted from the worker's cache, so a
directory must stay on disk as long as any request may use its adapter.

The choices, and why:
- One adapter per published version, `lora_int_id` = the version (vLLM requires ids > 0 and
  unique per adapter; versions are both) and `lora_name` = "forage-v<version>". vLLM's prefix
  cache keys blocks by the adapter's name and path, so a new version never reuses KV computed
  with an old one, and no prefix-cache reset is needed (unlike a full-weight update).
  The alternative, one id reloaded in place (`load_inplace`), would change the adapter under
  running requests and reuse their cached blocks: it would need the reset and preemption that
  full weights need, for no gain.
- A new request gets the newest adapter. A running request finishes on the adapter it started
  with, so its tokens come from one version (`version_start == version_end`).
- An old adapter is removed (`remove_lora`, then its directory deleted) as soon as no live
  request uses it, instead of being kept by id: kept ones would pile up in every worker's CPU
  cache and on disk, and vLLM's own LRU eviction would only drop them from memory.
- vLLM batches requests of at most `max_loras` adapters at once; Forage asks for 2 (the
  draining version and the new one). Requests of a third version wait in vLLM's queue until
  one of the two has drained, which only happens when updates come faster than a turn ends.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.lora import adapter_rank, write_peft_adapter

log = logging.getLogger("forage.rollout.vllm_lora")

# vLLM's allowed `max_lora_rank` values (vllm/config/lora.py `MaxLoRARanks`, 0.32 and 0.33).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Adapters in one vLLM batch: the version still draining and the newest.
MAX_LORAS = 2
# Adapters each vLLM worker keeps loaded (its LRU capacity, `max_cpu_loras`): one more than a
# batch can hold, so that adding the newest never evicts one that running requests still use
# (an evicted adapter is reloaded from disk at the next step that needs it).
MAX_CPU_LORAS = MAX_LORAS + 1
NAME_PREFIX = "forage-v"


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"learner.lora.rank {rank} is above vLLM's largest max_lora_rank "
                     f"({VLLM_LORA_RANKS[-1]})")


def lora_engine_kwargs(lora: Any) -> dict[str, Any]:
    """The LoRA `EngineArgs` fields for `learner.lora` (LoraSettings), or {} when replicas do
    not receive adapters (LoRA off, or `publish: merged`: full weights, no LoRA in vLLM)."""
    if lora is None or not lora.enabled or lora.publish != "adapter":
        return {}
    return {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(int(lora.rank)),
            "max_loras": MAX_LORAS, "max_cpu_loras": MAX_CPU_LORAS}


@dataclass(frozen=True)
class AdapterSlot:
    """One published adapter as vLLM knows it: its id, name and peft directory."""

    version: int
    path: str

    @property
    def lora_int_id(self) -> int:
        return self.version

    @property
    def lora_name(self) -> str:
        return f"{NAME_PREFIX}{self.version}"


def lora_request_kwargs(slot: AdapterSlot) -> dict[str, Any]:
    """The `LoRARequest(**kwargs)` fields for `slot`: a str, an int and a path string.

    This is all that crosses vLLM's engine RPC for an adapter: `add_lora` sends the
    `LoRARequest` (a msgspec struct that vLLM's encoder writes as the array
    [lora_name, lora_int_id, lora_path], defaults left out) and `remove_lora` its int id."""
    return {"lora_name": slot.lora_name, "lora_int_id": int(slot.lora_int_id),
            "lora_path": str(slot.path)}


class AdapterVersions:
    """The adapters registered in one vLLM engine and which one new requests get.

    `root` holds one peft directory per registered version (a fresh temporary directory by
    default, deleted with this object). vLLM's workers read these directories, so `root` must
    be on a filesystem every worker of the engine sees: true for a single-node engine, which
    is what Forage runs (tensor parallelism within one node).
    """

    def __init__(self, max_rank: int, root: str | Path | None = None) -> None:
        self.max_rank = int(max_rank)
        if root is None:
            self.root = Path(tempfile.mkdtemp(prefix="forage-lora-"))
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        else:
            self.root = Path(root)
            self.root.mkdir(parents=True, exist_ok=True)
            self._cleanup = None
        self.current: AdapterSlot | None = None
        self._slots: dict[int, AdapterSlot] = {}

    @property
    def registered(self) -> list[int]:
        return sorted(self._slots)

    def prepare(self, version: int, tensors: Mapping[str, Any], scale: float) -> AdapterSlot:
        """Write `version`'s peft directory; nothing is registered yet (see `activate`).

        Refuses (ValueError) a version that is not newer than the current one (ids must stay
        unique and versions only move forward) and an adapter whose rank is above the engine's
        `max_lora_rank` (vLLM would refuse it in every worker)."""
        version = int(version)
        if version <= 0:
            raise ValueError(f"adapter version must be positive, got {version}")
        if version in self._slots or (self.current and version <= self.current.version):
            have = self.current.version if self.current else version
            raise ValueError(f"adapter v{version} is not newer than the one serving (v{have})")
        rank = adapter_rank(tensors)
        if rank > self.max_rank:
            raise ValueError(f"adapter v{version} has rank {rank}, above the engine's "
                             f"max_lora_rank {self.max_rank}")
        path = write_peft_adapter(tensors, scale, self.root / f"v{version}")
        return AdapterSlot(version, str(path))

    def activate(self, slot: AdapterSlot) -> None:
        """`slot` is registered in vLLM: new requests get it from now on."""
        self._slots[slot.version] = slot
        self.current = slot

    def retired(self, in_use: Iterable[int | None]) -> list[AdapterSlot]:
        """Registered adapters that may go: not the current one and used by no live request
        (`in_use`: the adapter version of every live request, None for none)."""
        used = set(in_use)
        return [slot for version, slot in sorted(self._slots.items())
                if slot != self.current and version not in used]

    def forget(self, slot: AdapterSlot) -> None:
        """`slot` was removed from vLLM (or never taken): drop it and delete its directory."""
        self._slots.pop(slot.version, None)
        shutil.rmtree(slot.path, ignore_errors=True)

    def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup()
