"""Which attention kernel runs over packed rows, and what each needs from the row.

Why this matters: a packed row (packing.py) holds several sequences ("documents") that must not
see each other. Three kernels can keep them apart, and they differ in how much they compute:

  - `flash_attention_2` (transformers' integration of the flash-attn package): flash-attn's
    varlen kernel gets the sequence boundaries (`MicroBatch.varlen_kwargs`) and computes only
    within each sequence. CUDA only, bf16/fp16 only, and it cannot express the shared-prefix
    tree mask, so a learner on this path packs without shared prompts.
  - `flex_attention` (transformers' integration of PyTorch's FlexAttention): a block-sparse
    kernel driven by a `BlockMask`; 128 x 128 tiles that no query of the tile may attend to are
    skipped, so a 16k-token row of short documents costs about the sum of the documents' own
    attention, not the row's. Plain rows: transformers builds the block mask itself from the
    position-id restarts (its packed-sequence detection in masking_utils). Shared-prefix rows:
    the block mask is built here from `MicroBatch.kv_reach` (`prefix_block_mask`), the same
    rule as the dense tree mask, so the prefix sharing stays on.
  - `sdpa`: PyTorch's scaled_dot_product_attention with a dense (1, 1, N, N) boolean mask, the
    block-diagonal one transformers builds from the position ids or the tree mask of a shared
    row. It computes every query against every key of the row; always available.

`choose_attention` picks one from `learner.attention` (auto | flash | flex | sdpa) and what the
machine has. `auto` prefers flash, then flex, then sdpa. FlexAttention is never chosen on CPU:
torch (2.13 checked) raises NotImplementedError for a backward pass through flex_attention on
CPU, and the learner trains through attention; its CPU forward (compiled by inductor) works and
is what tests/learner/test_attention.py compares with SDPA.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

    from services.learner.packing import MicroBatch

# transformers' attn_implementation names.
FLASH_ATTENTION = "flash_attention_2"
FLEX_ATTENTION = "flex_attention"
SDPA = "sdpa"

# learner.attention values -> transformers' names.
BACKENDS: dict[str, str] = {"flash": FLASH_ATTENTION, "flex": FLEX_ATTENTION, "sdpa": SDPA}
HALF_DTYPES = (torch.bfloat16, torch.float16)
# FlexAttention's tile (torch's default block size): a shared row's block mask uses it, and
# `kv_reach` is padded to a multiple of it.
TILE = 128


class AttentionUnavailable(RuntimeError):
    """learner.attention names a kernel this machine cannot run for training."""


@dataclass(frozen=True)
class AttentionChoice:
    """The kernel for packed rows and why it was chosen (the learner's start-up line says both,
    so a run on a GPU without flash-attn is visible in its first lines, not in its speed)."""

    implementation: str  # transformers' attn_implementation
    reason: str

    @property
    def shares_prompts(self) -> bool:
        """Whether rows may carry shared prefixes: flash-attn's varlen kernel takes sequence
        boundaries only, not the tree mask a shared row needs."""
        return self.implementation != FLASH_ATTENTION

    @property
    def dense_mask(self) -> bool:
        """Whether a shared row needs its dense (N, N) mask built by packing (SDPA only; the
        flex path builds a block mask from `MicroBatch.kv_reach` instead)."""
        return self.implementation == SDPA


def flash_problem(device_type: str, dtype: torch.dtype, flash_installed: bool) -> str | None:
    """Why flash-attn cannot train here, or None when it can."""
    if not flash_installed:
        return "the flash_attn package is not installed (pip install flash-attn --no-build-isolation)"
    if device_type != "cuda":
        return f"flash-attn runs only on CUDA (device: {device_type})"
    if dtype not in HALF_DTYPES:
        return (f"flash-attn needs bf16/fp16 weights (policy in {str(dtype).removeprefix('torch.')}"
                "; learner.bf16)")
    return None


def flex_problem(device_type: str, flex_installed: bool) -> str | None:
    """Why FlexAttention cannot train here, or None when it can."""
    if not flex_installed:
        return "this torch/transformers has no FlexAttention (torch >= 2.5, and Triton on CUDA)"
    if device_type != "cuda":
        return (f"FlexAttention has no backward pass on {device_type} in torch "
                f"{torch.__version__} (it raises NotImplementedError), and the learner trains")
    return None


def choose_attention(
    requested: str, device_type: str, dtype: torch.dtype, *, flash_installed: bool,
    flex_installed: bool,
) -> AttentionChoice:
    """The kernel for packed rows: `requested` is learner.attention (auto | flash | flex |
    sdpa); the rest says what the machine has (`flash_attn_installed`, `flex_installed` probe
    it; tests pass them directly). `auto` takes the first of flash, flex, sdpa that can train
    here; a named kernel that cannot raises AttentionUnavailable saying why."""
    problems = {
        "flash": flash_problem(device_type, dtype, flash_installed),
        "flex": flex_problem(device_type, flex_installed),
        "sdpa": None,
    }
    if requested == "auto":
        skipped = []
        for name in ("flash", "flex", "sdpa"):
            if problems[name] is None:
                reason = "auto" + ("".join(f"; no {s}: {problems[s]}" for s in skipped))
                return AttentionChoice(BACKENDS[name], reason)
            skipped.append(name)
    if requested not in BACKENDS:
        raise ValueError(f"learner.attention must be auto, flash, flex or sdpa, not {requested!r}")
    problem = problems[requested]
    if problem is not None:
        raise AttentionUnavailable(
            f"learner.attention={requested} is unavailable: {problem}. Use learner.attention=auto "
            "(picks flash, then flex, then sdpa) or sdpa (runs everywhere).")
    return AttentionChoice(BACKENDS[requested], f"learner.attention={requested}")


def flash_attn_installed() -> bool:
    """flash-attn 2 importable and usable (transformers' own check: package and CUDA)."""
    from transformers.utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())


def flex_installed(device_type: str) -> bool:
    """FlexAttention importable from torch and known to transformers; on CUDA also Triton,
    which compiles its kernels (a CUDA torch wheel ships it, a source build may not)."""
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return False
    from transformers.utils import is_torch_flex_attn_available

    if not is_torch_flex_attn_available():
        return False
    return device_type != "cuda" or importlib.util.find_spec("triton") is not None


# ------------------------------------------------------------------------ forward arguments


def forward_kwargs(implementation: str, mb: MicroBatch) -> dict[str, Any]:
    """What a packed row's forward needs besides input and position ids, per kernel:
    flash: the sequence boundaries; flex: the block mask of a shared row (a plain row needs
    nothing: transformers builds its block mask from the position-id restarts); sdpa: the
    dense mask of a shared row (a plain row: transformers builds it from the position ids)."""
    if implementation == FLASH_ATTENTION:
        return mb.varlen_kwargs()
    if implementation == FLEX_ATTENTION:
        if mb.kv_reach is None:
            return {}
        return {"attention_mask": prefix_block_mask(mb.kv_reach)}
    return mb.mask_kwargs()


def _reach_mask_mod(reach: torch.Tensor):
    """The mask rule of a shared row (packing.py `MicroBatch.kv_reach`): query q sees key k
    when k <= q < reach[k]. `reach` is (1, N) padded past the row so indices of the last
    partial tile read 0 (never visible) instead of past the end. It is indexed [batch, kv],
    the form transformers' own packed-sequence mask uses: torch 2.13's CPU flex kernel failed
    to compile a 1-D `reach[kv]` after another mask had compiled (an inductor C++ codegen
    error, `cur_qSplitSize8` undeclared), while this form compiles in any order."""

    def mask_mod(batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx <= q_idx) & (q_idx < reach[batch, kv_idx])

    return mask_mod


@functools.cache
def _compiled_create_block_mask():
    """torch.compile(create_block_mask), made once: compiled, it evaluates the mask rule tile by
    tile without the (N, N) tensor that the eager version materialises (torch's advice)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def prefix_block_mask(kv_reach: torch.Tensor, compiled: bool | None = None) -> BlockMask:
    """The FlexAttention block mask of a shared-prefix row from its (1, N) `kv_reach`: the same
    attention as the row's dense tree mask (test_attention.py checks it element by element and
    tile by tile). `compiled` (None: on CUDA) builds it with the compiled create_block_mask; on
    CPU (tests, forward only) the eager one is the same function without inductor's compile
    time."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = int(kv_reach.shape[-1])
    padded = torch.zeros(1, -(-n // TILE) * TILE, dtype=torch.int32, device=kv_reach.device)
    padded[0, :n] = kv_reach.reshape(-1)
    if compiled is None:
        compiled = kv_reach.device.type == "cuda"
    build = _compiled_create_block_mask() if compiled else create_block_mask
    return build(_reach_mask_mod(padded), 1, None, n, n, device=kv_reach.device,
                 BLOCK_SIZE=TILE)
