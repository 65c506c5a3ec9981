"""Faithfulness probe settings; names follow the TinyZero-PRM probe (docs/architecture.md)."""

from __future__ import annotations

from pydantic import Field

from services.common.config.base import Section


class ProbeSection(Section):
    enable: bool = False
    num_truncations: int = Field(default=5, ge=1)
    mc_samples: int = Field(default=10, ge=1)
    mc_max_tokens: int = Field(default=32, ge=1)
    # None: the task's default suffix (see services.common.formats).
    suffix: str | None = None
    num_splits: int = Field(default=1, ge=1)
    overconf_coeff: float = 0.0
    # Fraction of finished trajectories that are probed, and probe every k policy versions.
    fraction: float = Field(default=1.0, ge=0, le=1)
    every_k_versions: int = Field(default=1, ge=1)
