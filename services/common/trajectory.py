"""The records that travel between services (docs/architecture.md).

Token arrays are numpy arrays (int32 ids, uint8 loss mask, float32 log-probs) so that the codec
can move them as raw little-endian bytes and consumers can use them without a Python-list
detour. `rollout_logprobs` has one entry per response token; observation tokens carry 0.0 there
(their loss_mask is 0, so the value is never used).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

# "tool": a tool call other than search (rollout.protocol tool_calls); a search tool call is
# recorded as "search" so search counts and samples read alike in both protocols.
Action = Literal["search", "answer", "invalid", "none", "tool"]
FinishReason = Literal["answer", "max_turns", "length", "error"]
ACTIONS: tuple[str, ...] = ("search", "answer", "invalid", "none", "tool")
FINISH_REASONS: tuple[str, ...] = ("answer", "max_turns", "length", "error")
# How the policy acted (config rollout.protocol): Search-R1's tags or chat-template tool calls.
Protocol = Literal["tags", "tool_calls"]
PROTOCOLS: tuple[str, ...] = ("tags", "tool_calls")

Messages = list[dict[str, str]]


def int_array(values: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.int32).reshape(-1))


def mask_array(values: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.uint8).reshape(-1))


def float_array(values: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.float32).reshape(-1))


@dataclass
class PromptGroup:
    """One prompt to be sampled `n` times; all samples share `uid` (the GRPO group)."""

    uid: str
    data_source: str
    prompt: Messages | str
    ground_truth: Any
    n: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    policy_version_min: int = 0
    # "train" groups feed the learner; "eval" groups are greedy evaluation passes.
    kind: Literal["train", "eval"] = "train"
    # Per-group sampling overrides (temperature, top_p, top_k, max_turns, ...).
    sampling: dict[str, float] = field(default_factory=dict)
    # How many times the learner has issued this group (re-issues after a timeout count up).
    attempt: int = 0
    # The run that issued it (the learner's redis.namespace; "" from issuers that predate the
    # field). Rollout copies it onto each trajectory, so the learner can refuse another run's.
    namespace: str = ""


@dataclass
class TurnRetrieval:
    """What the retrieval behind one search turn returned, measured where the passages are at
    hand (the rollout's agent loop), so the learner and `forage eval` can report retrieval
    health without the passages' text travelling (services/common/retrieval_health.py).

    A tool_calls turn with several search calls sums their passages and takes the slowest
    call; it is cached only when every call was."""

    ms: float  # wall time of the retrieval call that answered the turn (the call is batched)
    cached: bool  # answered by the retrieval cache (rollout.retrieval_cache replay or a cache hit)
    passages: int  # passages returned
    empty: int  # of them, how many have no contents (whitespace and quotes only)
    # Whether some passage contains a gold answer (whole words, normalised as EM normalises);
    # None when the ground truth has no gold answers to look for.
    gold: bool | None = None


@dataclass
class Turn:
    """One generation step of a trajectory: response tokens [start, end) and what it did."""

    start: int
    end: int
    action: Action
    query: str | None = None
    policy_version: int = 0
    # The documents a search turn retrieved, best first: [{"id": ..., "title": ...}] (None for
    # other turns). Carried for the samples researchers read (learner.log_samples_every).
    docs: list[dict[str, str]] | None = None
    # Who answered a search turn: `<index identity>@<8 hex of the search settings and top-k>`
    # (services/common/retrieval_store.retrieval_tag; None for other turns, or a retriever
    # that does not report its index). Results are reproducible only under the same tag.
    index: str | None = None
    # A search turn that got passages: what its retrieval returned (None for other turns, a
    # refused query, and records written before the field).
    retrieval: TurnRetrieval | None = None


@dataclass
class Probe:
    """Faithfulness-probe completions: `samples[k]` are the completions at `fractions[k]`."""

    fractions: list[float]
    samples: list[list[str]]


@dataclass
class EvidenceProbe:
    """Evidence-reliance probe rewrites (config `probe.evidence`; docs/probe.md): the final
    turn written again after the trajectory's evidence blocks were emptied (`none`) or replaced
    by another question's passages (`swapped`, from the group uid `donor`).
    `samples[variant]` are the rewritten final turns; a variant that could not be built (no
    donor at hand) is absent."""

    samples: dict[str, list[str]]
    donor: str | None = None


@dataclass
class Trajectory:
    uid: str
    sample_id: str
    data_source: str
    policy_version: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    loss_mask: np.ndarray
    rollout_logprobs: np.ndarray
    turns: list[Turn] = field(default_factory=list)
    finish_reason: FinishReason = "answer"
    num_searches: int = 0
    ground_truth: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    probe: Probe | None = None
    kind: Literal["train", "eval"] = "train"
    # Set when finish_reason == "error": what went wrong (e.g. retriever unreachable).
    error: str | None = None
    # rollout.protocol that produced it; the scorer picks the answer and format rules by it.
    # Records without the field (older rollouts) are "tags".
    protocol: Protocol = "tags"
    # The evidence-reliance probe's rewrites (None: not probed; older records have none).
    evidence: EvidenceProbe | None = None
    # The run whose group this plays (its PromptGroup's namespace; "" when the group had none).
    namespace: str = ""

    def __post_init__(self) -> None:
        self.prompt_ids = int_array(self.prompt_ids)
        self.response_ids = int_array(self.response_ids)
        self.loss_mask = mask_array(self.loss_mask)
        self.rollout_logprobs = float_array(self.rollout_logprobs)

    @property
    def num_invalid(self) -> int:
        return sum(1 for turn in self.turns if turn.action == "invalid")

    @property
    def num_policy_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class ScoredTrajectory:
    """A trajectory with its reward; `reward_components` keeps every reward function's value."""

    trajectory: Trajectory
    reward: float
    reward_components: dict[str, float] = field(default_factory=dict)
    probe_scores: list[float] | None = None
    # Evidence-reliance probe EM per variant ("real": the trajectory's own answer, "none",
    # "swapped": mean over the rewrites) and "gap" = real - swapped; None when not probed.
    evidence_scores: dict[str, float] | None = None
