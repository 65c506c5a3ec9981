"""Which tensors of a publish are the same memory as an earlier one (tied weights).

A model with `tie_word_embeddings` lists one storage under two names (`lm_head.weight` and
`model.embed_tokens.weight`); sending it once saves a whole vocabulary x hidden matrix per
fetch (the largest tensor of a small model). Sharing is recognised by memory, not by name, so
any model's ties are found and nothing that merely looks alike is merged.

An address match proves sharing only while the first tensor is alive and still on that memory:
an iterable publish (a ZeRO-3 learner gathering bucket by bucket) frees each tensor once it is
copied, and an allocator readily hands the same address to the next tensor of the same shape.
So each tensor is remembered through a weak reference (the finder never keeps one alive) and
its key is computed again at a match; a tensor that died or moved is never an alias target.
Only exact aliases count (same storage, offset, shape, strides and dtype): overlapping views
are sent as they are.
"""

from __future__ import annotations

import weakref

import torch

StorageKey = tuple[object, ...]


def storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """Identity of the memory `tensor` reads, or None when it cannot be shared usefully (empty:
    nothing to save; not strided: no plain storage)."""
    if tensor.layout != torch.strided or tensor.numel() == 0:
        return None
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
            tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


class AliasFinder:
    """Feed it the tensors of one publish in order; `seen` names the earlier tensor with the
    same memory, if any."""

    def __init__(self) -> None:
        self._first: dict[StorageKey, tuple[str, weakref.ref[torch.Tensor]]] = {}

    def seen(self, name: str, tensor: torch.Tensor) -> str | None:
        """The name of an earlier, still-live tensor on exactly this memory; otherwise None,
        and `tensor` is remembered as the one later names may alias."""
        key = storage_key(tensor)
        if key is None:
            return None
        earlier = self._first.get(key)
        if earlier is not None:
            first_name, ref = earlier
            first = ref()
            if first is not None and storage_key(first) == key:
                return first_name
        self._first[key] = (name, weakref.ref(tensor))
        return None
