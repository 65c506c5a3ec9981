"""Dataset settings (docs/architecture.md)."""

from __future__ import annotations

from pydantic import Field

from services.common.config.base import Section


class DataSection(Section):
    train_files: list[str] = Field(default_factory=list)  # training rows (parquet or JSON Lines)
    test_files: list[str] = Field(default_factory=list)  # evaluation rows
    n_samples: int = Field(default=5, ge=1)  # rollouts per prompt group
    shuffle: bool = True  # shuffle the training rows every epoch
    seed: int = 0  # shuffle seed; also the synthetic world's
    max_test_items: int | None = None  # use the first N test rows (None: all)
    # Synthetic world (`forage data synth`, services/tasks): its size, whether to use the hard
    # preset (sub-word names, longer passages, top-3), and the SFT warm-start strategy mix.
    # The mix decides what RL can show: the warm-started policy can execute the good strategy
    # but picks it only part of the time.
    synth_size: str = Field(default="small", pattern="^(small|medium)$")
    synth_hard: bool = False  # the synthetic world's hard preset
    sft_mix: str = "good=0.4,guess=0.3,sloppy=0.3"  # SFT demonstration strategy mix
    # Passages per search in the demonstrations; None: the world's recommended top-k (1 easy,
    # 3 hard). Must equal the rollout's retrieval top-k so SFT and RL observations agree.
    sft_topk: int | None = Field(default=None, ge=1)
