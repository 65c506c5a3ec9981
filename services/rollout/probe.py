"""Faithfulness probe: truncated-reasoning prompts that force an answer (docs/architecture.md).

For a finished trajectory, the reasoning span is found by the data source's rule
(`services.common.formats.probe_rule`; docs/probe.md): countdown follows TinyZero-PRM (after
the first `<think>`, up to the first `</think>`, else the first `<answer>`), math follows
Math-PRM (up to the first `\\boxed{`), GSM8K stops before the first `####`, and a search
trajectory stops before the policy's first `<answer>`.

The fraction k/N counts only the policy's own tokens (loss mask 1): retrieved `<information>`
text and corrective messages are not reasoning. With L policy tokens in the span, the prefix
for k holds the first m = round(k/N·L) of them and the observations that follow them up to the
next policy token: an observation is the environment's reply to the action just before it, in
the policy's context before it emits its next token. So 100% is the whole response before the
first `<answer>`, retrieved passages included, and no prefix holds an observation whose action
it lacks.
For single-turn tasks (every response token is a policy token) this is TinyZero-PRM's
`response[: start + round(L·k/N)]`. The probe prompt is prompt + prefix + the task's suffix,
sampled `mc_samples` times at temperature 1; the scorer grades each sample. Cuts are on token
ids, never on re-tokenized text, so the prefix is exactly what the policy saw. Rounding is
half-up (Python's `round`, which TinyZero-PRM uses, rounds 2.5 to 2): the curve's points do
not depend on the parity of L·k/N.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.formats import (
    ProbeRule,
    probe_closer,
    probe_rule,
    probe_stops,
    probe_suffix,
)

__all__ = [
    "ProbeSettings",
    "ReasoningSpan",
    "cut_points",
    "cut_suffixes",
    "probe_prompts",
    "probe_rule",
    "probe_stops",
    "probe_suffix",
    "reasoning_span",
]


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
    # probe.evidence: the evidence-reliance probe (services/rollout/evidence.py).
    evidence: Any = field(default=None)

    def __post_init__(self) -> None:
        from services.rollout.evidence import EvidenceSettings

        if self.evidence is None:
            self.evidence = EvidenceSettings()

    @classmethod
    def from_config(cls, section: Any) -> ProbeSettings:
        from services.rollout.evidence import EvidenceSettings

        return cls(
            enable=section.enable,
            num_truncations=section.num_truncations,
            mc_samples=section.mc_samples,
            mc_max_tokens=section.mc_max_tokens,
            suffix=section.suffix,
            num_splits=section.num_splits,
            fraction=section.fraction,
            every_k_versions=section.every_k_versions,
            evidence=EvidenceSettings.from_config(getattr(section, "evidence", None)),
        )

    @property
    def fractions(self) -> list[float]:
        n = self.num_truncations
        return [k / n for k in range(n + 1)]


@dataclass(frozen=True)
class ReasoningSpan:
    """The reasoning of one response: [start, end) in response tokens, and the positions of
    the policy's own tokens inside it (what the fraction k/N counts)."""

    start: int
    end: int
    policy_positions: tuple[int, ...]
    boundary: str  # the marker that ended the span, or "" (whole response)

    @property
    def length(self) -> int:
        return len(self.policy_positions)

    def cuts(self, num_truncations: int) -> list[int]:
        """Response prefix lengths for k = 0..N: the first m_k policy tokens of the span and the
        observations after them, up to the next policy token (the span's end after the last)."""
        out = []
        for m in cut_points(self.length, num_truncations):
            if m == 0:
                out.append(self.start)
            elif m < self.length:
                out.append(self.policy_positions[m])
            else:
                out.append(self.end)
        return out


def cut_points(length: int, num_truncations: int) -> list[int]:
    """round(k/N·length) for k = 0..N, half-up."""
    return [math.floor(k * length / num_truncations + 0.5) for k in range(num_truncations + 1)]


class _Offsets:
    """Character offsets of a response's decoded text mapped back to token counts.

    Binary search over decoded prefixes (their length grows with the prefix), so each lookup
    costs O(log L) decodes instead of decoding every prefix.
    """

    def __init__(self, tokenizer: Any, ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(ids)
        self.text = self._decode(len(self.ids))

    def _decode(self, n: int) -> str:
        return self.tokenizer.decode(self.ids[:n], skip_special_tokens=False)

    def tokens_before(self, offset: int) -> int:
        """The most leading tokens whose text ends at or before character `offset`; the token
        at that index is the one in which character `offset` lies."""
        low, high = 0, len(self.ids)
        while low < high:
            middle = (low + high + 1) // 2
            if len(self._decode(middle)) <= offset:
                low = middle
            else:
                high = middle - 1
        return low

    def tokens_through(self, offset: int) -> int:
        """The fewest leading tokens whose text reaches character `offset` (exclusive end)."""
        low, high = 0, len(self.ids)
        while low < high:
            middle = (low + high) // 2
            if len(self._decode(middle)) >= offset:
                high = middle
            else:
                low = middle + 1
        return low


def _first_policy_marker(
    offsets: _Offsets, mask: Sequence[int], marker: str, start_char: int = 0
) -> tuple[int, int] | None:
    """(token index, character offset) of the first `marker` that starts in a policy token."""
    position = offsets.text.find(marker, start_char)
    while position != -1:
        token = offsets.tokens_before(position)
        if token < len(mask) and mask[token]:
            return token, position
        position = offsets.text.find(marker, position + 1)
    return None


def reasoning_span(
    tokenizer: Any,
    response_ids: Sequence[int],
    loss_mask: Sequence[int] | None,
    rule: ProbeRule,
) -> ReasoningSpan:
    """The reasoning span of a response under `rule` (see the module doc and docs/probe.md)."""
    ids = list(response_ids)
    mask = [1] * len(ids) if loss_mask is None else [int(m) for m in loss_mask]
    if len(mask) != len(ids):
        raise ValueError(f"loss_mask has {len(mask)} entries for {len(ids)} response tokens")
    offsets = _Offsets(tokenizer, ids)
    start, start_char = 0, 0
    if rule.start_after:
        found = _first_policy_marker(offsets, mask, rule.start_after)
        if found is not None:
            start_char = found[1] + len(rule.start_after)
            start = offsets.tokens_through(start_char)
    end, boundary = len(ids), ""
    for marker in rule.ends_before:
        found = _first_policy_marker(offsets, mask, marker, start_char)
        if found is not None:
            end, boundary = found[0], marker
            break
    start = min(start, end)
    positions = tuple(i for i in range(start, end) if mask[i])
    return ReasoningSpan(start, end, positions, boundary)


def probe_prompts(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    cuts: Sequence[int],
    suffixes: Sequence[Sequence[int]],
) -> list[list[int]]:
    """The probe prompts of one trajectory, as token ids: prompt + response[:cut] + that cut's
    suffix (cut_suffixes)."""
    prompt, response = list(prompt_ids), list(response_ids)
    return [prompt + response[:cut] + list(suffix)
            for cut, suffix in zip(cuts, suffixes, strict=True)]


def cut_suffixes(
    tokenizer: Any, response_ids: Sequence[int], cuts: Sequence[int], rule: ProbeRule
) -> list[list[int]]:
    """Per cut, the token ids that follow the prefix: the closer of the block the prefix ends
    inside (formats.probe_closer: e.g. `</think>\\n` in an unfinished thought) and the suffix,
    encoded together as the policy writes them."""
    ids = list(response_ids)
    out = []
    for cut in cuts:
        closer = probe_closer(rule, tokenizer.decode(ids[:cut])) if rule.closers else ""
        out.append(list(tokenizer.encode(closer + rule.suffix, add_special_tokens=False)))
    return out
