"""Faithfulness probe: truncated-reasoning prompts that force an answer (DESIGN.md 5).

For a finished trajectory, the reasoning span is the response before the final answer marker
(`<answer>` for tagged tasks, `\\boxed{` for math; the whole response when there is none). For
k = 0..N the probe prompt is prompt + the first round(k/N·L) response tokens + the task's
suffix; each is sampled `mc_samples` times at temperature 1 and the scorer grades them. The cut
is on token ids, never on re-tokenized text, so the prefix is exactly what the policy saw.
Rounding is half-up (Python's `round` would round 2.5 to 2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.common.formats import is_boxed_answer_task, probe_suffix

__all__ = ["ProbeSettings", "is_math_task", "probe_suffix", "answer_marker", "probe_stops"]


@dataclass
class ProbeSettings:
    enable: bool = False
    num_truncations: int = 5
    mc_samples: int = 10
    mc_max_tokens: int = 32
    suffix: str | None = None
    num_splits: int = 1
    fraction: float = 1.0
    every_k_versions: int = 1

    @classmethod
    def from_config(cls, section: Any) -> ProbeSettings:
        return cls(
            enable=section.enable,
            num_truncations=section.num_truncations,
            mc_samples=section.mc_samples,
            mc_max_tokens=section.mc_max_tokens,
            suffix=section.suffix,
            num_splits=section.num_splits,
            fraction=section.fraction,
            every_k_versions=section.every_k_versions,
        )

    @property
    def fractions(self) -> list[float]:
        n = self.num_truncations
        return [k / n for k in range(n + 1)]


def is_math_task(data_source: str) -> bool:
    return is_boxed_answer_task(data_source)


def answer_marker(suffix: str) -> str:
    return "\\boxed{" if "\\boxed{" in suffix else "<answer>"


def probe_stops(suffix: str) -> tuple[str, ...]:
    return () if "\\boxed{" in suffix else ("</answer>",)


def reasoning_length(tokenizer: Any, response_ids: Sequence[int], marker: str) -> int:
    """Number of leading response tokens that precede the last `marker` (all if none).

    Binary search over decoded prefixes: decoded length grows with the prefix, so the largest
    prefix whose text ends at or before the marker's character offset is found in O(log L)
    decodes.
    """
    ids = list(response_ids)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    offset = text.rfind(marker)
    if offset < 0:
        return len(ids)
    low, high = 0, len(ids)  # invariant: decode(ids[:low]) fits before the marker
    while low < high:
        middle = (low + high + 1) // 2
        if len(tokenizer.decode(ids[:middle], skip_special_tokens=False)) <= offset:
            low = middle
        else:
            high = middle - 1
    return low


def cut_points(length: int, num_truncations: int) -> list[int]:
    return [math.floor(k * length / num_truncations + 0.5) for k in range(num_truncations + 1)]


def probe_prompts(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    reasoning_len: int,
    num_truncations: int,
    suffix_ids: Sequence[int],
) -> list[list[int]]:
    """The N+1 probe prompts of one trajectory, as token ids."""
    prompt, response, suffix = list(prompt_ids), list(response_ids), list(suffix_ids)
    return [prompt + response[:cut] + suffix for cut in cut_points(reasoning_len, num_truncations)]
