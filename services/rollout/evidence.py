"""Evidence-reliance probe during training (`probe.evidence.*`; docs/probe.md, "Evidence
reliance during training").

For a sampled finished train trajectory that retrieved at least once, the agent loop cuts the
response right after its last `<information>` block before its first `<answer>` and lets the
policy write that final turn again with every block before the cut emptied (`none`) or
replaced by another question's passages (`swapped`). The prompt rules are forage eval's
(services/common/evidence.py); what differs is where the swapped passages come from: the
replica keeps the last `<information>` block each question (group uid) of its recent train
groups received (`DonorPool`, bounded) and draws the donor among the other questions, so no
extra retrieval call is made. The rewrites travel on the trajectory (`Trajectory.evidence`);
the scorer grades them with the task's reward.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.evidence import (
    REPLACED,
    evidence_cut,
    information_runs,
    pick_donor,
    rebuild_each,
    variant_prompts,
)
from services.common.formats import probe_rule
from services.common.trajectory import Turn
from services.rollout.probe import reasoning_span

DONOR_POOL_SIZE = 64  # questions whose last evidence block a replica keeps


@dataclass
class EvidenceSettings:
    enable: bool = False
    fraction: float = 1.0
    every_k_versions: int = 1
    samples: int = 1
    temperature: float = 0.0
    max_tokens: int | None = None  # None: the loop's max_tokens_per_turn

    @classmethod
    def from_config(cls, section: Any) -> EvidenceSettings:
        if section is None:
            return cls()
        return cls(
            enable=section.enable,
            fraction=section.fraction,
            every_k_versions=section.every_k_versions,
            samples=section.samples,
            temperature=section.temperature,
            max_tokens=section.max_tokens,
        )


class DonorPool:
    """The last evidence block of each of the most recent `size` questions (group uid) seen by
    this replica's train trajectories, with the question's ground truth."""

    def __init__(self, size: int = DONOR_POOL_SIZE) -> None:
        self.size = size
        self._blocks: OrderedDict[str, tuple[Any, str]] = OrderedDict()

    def add(self, uid: str, ground_truth: Any, block: str) -> None:
        self._blocks[uid] = (ground_truth, block)
        self._blocks.move_to_end(uid)
        while len(self._blocks) > self.size:
            self._blocks.popitem(last=False)

    def draw(self, uid: str, ground_truth: Any, rng: random.Random) -> tuple[str, str] | None:
        """(donor uid, block) of another question, or None when none is at hand."""
        pool = [(donor, truth, block) for donor, (truth, block) in self._blocks.items()]
        return pick_donor(pool, uid, ground_truth, rng)

    def __len__(self) -> int:
        return len(self._blocks)


def evidence_prompts(tokenizer: Any, prompt_ids: Sequence[int], response: Sequence[int],
                     mask: Sequence[int], turns: Sequence[Turn], data_source: str,
                     swapped: str | None, max_obs_length: int
                     ) -> dict[str, list[int] | None] | None:
    """The `none` and `swapped` prompts of one trajectory (`swapped` None without a donor), or
    None when it has no evidence before its answer. Tags protocol (the replacement blocks
    are `<information>` text; tool calls: `tool_evidence_prompts`)."""
    runs = information_runs(turns, len(response))
    if not runs:
        return None
    span = reasoning_span(tokenizer, list(response), list(mask), probe_rule(data_source))
    cut = evidence_cut(runs, span.end)
    if cut is None:
        return None

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))[:max_obs_length]

    return variant_prompts(prompt_ids, response, runs, cut, encode, swapped, REPLACED)


def tool_evidence_prompts(chat: Any, prompt_ids: Sequence[int], response: Sequence[int],
                          mask: Sequence[int], turns: Sequence[Turn], data_source: str,
                          messages: Sequence[Mapping[str, Any]], swapped: str | None,
                          max_obs_length: int) -> dict[str, list[int] | None] | None:
    """The `real`, `none` and `swapped` prompts of one tool_calls trajectory (`swapped` None
    without a donor), or None when it retrieved nothing before its answer. The evidence is
    what the loop inserted after each search call that retrieved (the rest of the turn's
    closer, the `tool` message, the next assistant header); each is replaced by the same chat
    template's rendering of a `search` tool message whose content is empty (`none`) or the
    donor's passages (`swapped`), cut to `max_obs_length` tokens as the loop cuts tool
    results. `chat` is the loop's ChatTurns; `messages` the prompt messages the trajectory was
    played from (the context the template renders tool messages after)."""
    tokenizer = chat.tokenizer
    response = [int(t) for t in response]
    runs = information_runs(turns, len(response))
    if not runs:
        return None
    span = reasoning_span(tokenizer, response, [int(m) for m in mask],
                          probe_rule(data_source, protocol="tool_calls"))
    cut = evidence_cut(runs, span.end)
    if cut is None:
        return None
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    closer = chat.closer
    # Whether the turn before each run ended on the end-of-turn token itself (then the
    # template's closer is not inserted again), as the loop decided from the engine's finish.
    end_of: dict[int, str] = {}
    for turn in turns:
        last = response[turn.end - 1] if turn.end > turn.start else None
        text = (tokenizer.decode([last], skip_special_tokens=False)
                if last is not None and last in special else "")
        end_of[turn.end] = text if text and closer.startswith(text) else ""

    def rendered(content: str, run_start: int) -> list[int]:
        ids = tokenizer.encode(content, add_special_tokens=False)
        if len(ids) > max_obs_length:
            content = tokenizer.decode(ids[:max_obs_length], skip_special_tokens=False)
        return chat.inserted_ids(messages, [{"role": "tool", "name": "search",
                                             "content": content, "tool_call_id": "0" * 9}],
                                 end_of.get(run_start, ""))

    prompt = [int(t) for t in prompt_ids]
    before = [run for run in runs if run[0] < cut]
    return {
        "real": rebuild_each(prompt, response, cut, before, [response[a:b] for a, b in before]),
        "none": rebuild_each(prompt, response, cut, before,
                             [rendered("", start) for start, _ in before]),
        "swapped": None if swapped is None else rebuild_each(
            prompt, response, cut, before, [rendered(swapped, start) for start, _ in before]),
    }


def has_evidence(turns: Sequence[Turn]) -> bool:
    """Whether a trajectory retrieved passages at least once (a search turn with docs)."""
    return any(turn.action == "search" and turn.docs is not None for turn in turns)
