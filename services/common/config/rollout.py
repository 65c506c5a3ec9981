"""Rollout settings: engine, sampling and the agent loop (DESIGN.md 4)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.common.config.base import Section


class RolloutSection(Section):
    engine: Literal["transformers", "vllm"] = "transformers"
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_batch_size: int = Field(default=32, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    max_turns: int = Field(default=4, ge=0)
    max_tokens_per_turn: int = Field(default=500, ge=1)
    max_obs_length: int = Field(default=500, ge=1)
    max_response_length: int = Field(default=2048, ge=1)
    max_prompt_length: int = Field(default=4096, ge=1)
    use_search: bool = True
    weight_poll_s: float = Field(default=1.0, gt=0)
    heartbeat_s: float = Field(default=5.0, gt=0)
    metrics_port: int = Field(default=0, ge=0, le=65535)
    seed: int = 0
