"""Policy model settings: any Hugging Face causal-LM directory."""

from __future__ import annotations

from pydantic import Field

from services.common.config.base import Section


class ModelSection(Section):
    # A directory saved with save_pretrained (the tiny policy or e.g. Qwen2.5-0.5B).
    path: str | None = None
    tokenizer_path: str | None = None  # tokenizer directory (None: path)
    dtype: str = "auto"  # not read by any service (see learner.bf16, rollout.dtype)
    gradient_checkpointing: bool = False  # recompute activations in the backward
    max_length: int = Field(default=4096, ge=1)  # SFT: demonstrations are cut to this many tokens
    # `forage model init` (services/tasks/tiny_policy.py): the size preset of the randomly
    # initialised Qwen2 policy, its init seed, and the BPE vocabulary trained on the task texts.
    init_preset: str = Field(default="tiny", pattern="^(tiny|small)$")
    init_seed: int = 0  # `forage model init`: init seed
    init_vocab_size: int = Field(default=2048, ge=300)  # `forage model init`: vocabulary size
