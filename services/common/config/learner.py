"""Learner settings: algorithm, optimisation, loop (DESIGN.md 1, 6)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from services.common.config.base import Section


class LearnerSection(Section):
    adv_estimator: str = "grpo"
    lr: float = Field(default=1e-6, gt=0)
    train_batch_size: int = Field(default=8, ge=1)  # prompt groups per step
    total_steps: int = Field(default=100, ge=0)
    max_staleness: int = Field(default=1, ge=0)
    zero_stage: int = Field(default=0, ge=0, le=3)
    checkpoint_dir: str = "runs/default/checkpoints"
    save_every: int = Field(default=10, ge=1)
    weight_sync_host: str = "127.0.0.1"
    weight_sync_port: int = Field(default=50051, ge=0, le=65535)
    weight_sync_token: str | None = None
    weight_sync_chunk_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    metrics_port: int = Field(default=0, ge=0, le=65535)
    seed: int = 0
    # Free-form estimator / loss options passed through to services.learner.algorithms.
    algorithm: dict[str, Any] = Field(default_factory=dict)
