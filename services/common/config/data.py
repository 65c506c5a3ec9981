"""Dataset settings (DESIGN.md 1, 7)."""

from __future__ import annotations

from pydantic import Field

from services.common.config.base import Section


class DataSection(Section):
    train_files: list[str] = Field(default_factory=list)
    test_files: list[str] = Field(default_factory=list)
    n_samples: int = Field(default=5, ge=1)  # rollouts per prompt group
    shuffle: bool = True
    seed: int = 0
    max_test_items: int | None = None
