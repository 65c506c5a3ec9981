"""Faithfulness probe settings; names follow the TinyZero-PRM probe (docs/architecture.md).
`probe.evidence.*` is the evidence-reliance probe during training (docs/probe.md)."""

from __future__ import annotations

from pydantic import Field, model_validator

from services.common.config.base import Section


class EvidenceProbeSection(Section):
    """The evidence-reliance probe on training trajectories (off by default; docs/probe.md,
    "Evidence reliance during training")."""

    enable: bool = False  # probe evidence reliance in training
    # Fraction of finished train trajectories with at least one evidence block that are
    # probed, and probe every k policy versions (as probe.fraction / probe.every_k_versions).
    fraction: float = Field(default=1.0, ge=0, le=1)
    every_k_versions: int = Field(default=1, ge=1)  # probe every k policy versions
    # Rewrites per variant; temperature 0 is greedy (then one sample says it all).
    samples: int = Field(default=1, ge=1)
    temperature: float = Field(default=0.0, ge=0)  # sampling temperature of the rewrites
    # Tokens a rewritten final turn may have; None: rollout.max_tokens_per_turn.
    max_tokens: int | None = Field(default=None, ge=1)  # tokens of a rewritten final turn
    # Advantage shaping (a departure from Search-R1): a correct trajectory whose answer
    # survives swapped evidence loses coeff on its tokens' advantages. 0: off.
    coeff: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> EvidenceProbeSection:
        if self.samples > 1 and self.temperature == 0:
            raise ValueError("probe.evidence.samples > 1 needs probe.evidence.temperature > 0 "
                             "(greedy rewrites are all the same)")
        if self.coeff and not self.enable:
            raise ValueError("probe.evidence.coeff needs probe.evidence.enable: true (the "
                             "shaping reads the probe's scores)")
        return self


class ProbeSection(Section):
    enable: bool = False  # run the faithfulness probe (docs/probe.md)
    num_truncations: int = Field(default=5, ge=1)  # places the reasoning is cut
    mc_samples: int = Field(default=10, ge=1)  # forced answers sampled per cut
    mc_max_tokens: int = Field(default=32, ge=1)  # tokens of one forced answer
    # None: the task's default suffix (see services.common.formats).
    suffix: str | None = None  # the forced-answer suffix
    num_splits: int = Field(default=1, ge=1)  # waves one trajectory's probe requests go in
    overconf_coeff: float = 0.0  # advantage shaping by the probe (0: off)
    # Fraction of finished trajectories that are probed, and probe every k policy versions.
    fraction: float = Field(default=1.0, ge=0, le=1)
    every_k_versions: int = Field(default=1, ge=1)  # probe every k policy versions
    evidence: EvidenceProbeSection = Field(default_factory=EvidenceProbeSection)
