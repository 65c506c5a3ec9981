"""Scorer settings: worker pool, custom rewards (DESIGN.md 9)."""

from __future__ import annotations

from pydantic import Field

from services.common.config.base import Section


class RewardSpec(Section):
    # A registered reward name ("qa_em", "countdown", ...) or "module:function".
    function: str
    weight: float = 1.0


class ScorerSection(Section):
    num_workers: int = Field(default=2, ge=1)
    math_timeout_s: float = Field(default=5.0, gt=0)
    # data_source -> reward functions with weights; empty means the built-in table.
    rewards: dict[str, list[RewardSpec]] = Field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = Field(default=8010, ge=0, le=65535)
    metrics_port: int = Field(default=0, ge=0, le=65535)
