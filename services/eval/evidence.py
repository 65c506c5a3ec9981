"""Evidence-reliance probe of `forage eval` (`--evidence-probe`; docs/eval.md).

Question: does the agent's answer depend on the passages it retrieved? For each finished agent
trajectory that searched at least once, the answer is forced three times after the trajectory's
own reasoning, with its `<information>` blocks

- `real`: as retrieved (the trajectory's own tokens, untouched),
- `none`: replaced by an empty block (`<information></information>`),
- `swapped`: replaced by the passages retrieved for another question of the same evaluation
  (a seeded derangement of the evaluation's questions: nobody gets its own),

and each forced answer is scored with the same EM as the evaluation. A policy that reads its
evidence loses accuracy without it (real − none, real − swapped large); one that answers from
memory does not (gaps near 0).

The probe cuts each trajectory right after its last `<information>` block (before its first
`<answer>`) and lets the policy write the rest of that turn again, sampled at temperature 1 up to
`</answer>` (or `</search>`: a policy that searches again instead of answering scores 0), as
many tokens as a turn may have. Cutting there matters: a policy that restates what it read
("the passage says X") before answering would otherwise carry X into the `none` and `swapped`
prompts, and a policy that copies its evidence would look as if it answered from memory
(measured on the demo's final policy: gaps of 0.02-0.03 with the cut at its `<answer>`). And
the policy writes its own closing reasoning rather than being forced to `<answer>` at once, as
the truncation probe does: a policy trained to reason before it answers gets 2% right when
forced at the block's end with its real evidence (the demo's final policy), which would
measure the forcing, not the evidence. Prompts are built from token ids: prompt ids + the
response's own token segments, with only the replacement blocks encoded (and cut to
`max_obs_length`, as the agent loop cuts observations). Text the policy wrote between two
searches (a second query may name a bridge entity it read in the first block) stays as it was.

The swapped passages are retrieved for the donor question's text through the evaluation's own
backend: recorded with `--retrieval record`, answered from the store with `--retrieval replay`,
so a replayed probe is exact.

`--protocol tool_calls` (`prepare_tool_calls`): the evidence is the tokens the loop inserted
after each search call that retrieved (the rest of the assistant turn's closer, the `tool`
message, the next assistant header). Each is replaced by the same chat template's rendering of
a `search` tool message whose content is empty (`none`) or the donor's passages (`swapped`,
the `Doc i(Title: ...)` lines the search tool returns), cut to `max_obs_length` tokens as the
loop cuts tool results. The rewrite stops at `</answer>`, `</tool_call>` (a call instead of an
answer scores 0) or the template's end of turn, and is scored as one tool_calls assistant turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The pure rules live in services/common/evidence.py (the rollout's training-time probe uses
# them too); they are re-exported here under their old names.
from services.common.evidence import (  # noqa: F401 (this module's public names)
    EMPTY_BLOCK,
    EVIDENCE_STOPS,
    VARIANTS,
    derangement,
    donors,
    evidence_cut,
    information_runs,
    rebuild,
    rebuild_each,
    rewrite_stops,
    swapped_block,
    variant_prompts,
)
from services.common.formats import passages_to_string, probe_rule
from services.common.trajectory import Trajectory
from services.eval.stats import mean, score_response
from services.rollout.evidence import tool_evidence_prompts
from services.rollout.probe import reasoning_span

EVIDENCE_MAX_TOKENS = 500  # as a turn may have (`--max-tokens-per-turn`'s default)
NO_SEARCH = "no_search"


@dataclass(frozen=True)
class EvidenceSettings:
    """`--evidence-samples`: final turns per variant and trajectory (temperature 1), each at
    most `max_tokens` (the evaluation's `--max-tokens-per-turn`)."""

    samples: int = 3
    max_tokens: int = EVIDENCE_MAX_TOKENS


@dataclass(frozen=True)
class Prepared:
    """The three probe prompts of one trajectory (None: that variant cannot be built)."""

    prompts: dict[str, list[int] | None]


def prepare(tokenizer: Any, trajectory: Trajectory, swapped: str | None,
            max_obs_length: int) -> Prepared | None:
    """The probe prompts of one trajectory, or None when it retrieved nothing to replace."""
    runs = information_runs(trajectory.turns, len(trajectory.response_ids))
    if trajectory.num_searches == 0 or not runs:
        return None
    rule = probe_rule(trajectory.data_source)
    response = [int(t) for t in trajectory.response_ids]
    span = reasoning_span(tokenizer, response, [int(m) for m in trajectory.loss_mask], rule)
    cut = evidence_cut(runs, span.end)  # right after the last evidence before the answer
    if cut is None:
        return None

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))[:max_obs_length]

    prompts = variant_prompts([int(t) for t in trajectory.prompt_ids], response, runs, cut,
                              encode, swapped)
    return Prepared(prompts)


@dataclass(frozen=True)
class ToolChat:
    """What the tool_calls variant needs of the agent loop: its chat template
    (services.rollout.tools.ChatTurns) and the stop strings of a turn."""

    turns: Any
    stops: tuple[str, ...]
    stop_ids: tuple[int, ...] = ()


def swapped_result(found: Any) -> str | None:
    """A donor's passages as the search tool's result (the agent loop's text); None for a
    rejected query."""
    return passages_to_string(found).strip() if isinstance(found, list) else None


def prepare_tool_calls(chat: ToolChat, trajectory: Trajectory,
                       messages: Sequence[Mapping[str, Any]], swapped: str | None,
                       max_obs_length: int) -> Prepared | None:
    """The probe prompts of one tool_calls trajectory (see the module doc), or None when it
    retrieved nothing to replace. `messages`: the prompt messages it was played from (the
    context the template renders tool messages after)."""
    if trajectory.num_searches == 0:
        return None
    prompts = tool_evidence_prompts(
        chat.turns, trajectory.prompt_ids, trajectory.response_ids, trajectory.loss_mask,
        trajectory.turns, trajectory.data_source, messages, swapped, max_obs_length)
    return None if prompts is None else Prepared(prompts)


def force_answers(engine: Any, prepared: Mapping[str, Prepared], ground_truth: Mapping[str, Any],
                  settings: EvidenceSettings,
                  chat: ToolChat | None = None) -> dict[str, dict[str, list[float]]]:
    """Sample `settings.samples` final turns per variant of each prepared trajectory and score
    each with the evaluation's EM (the last `<answer>` it wrote; none: 0). Keys: question
    ids. `chat` (tool_calls): the turn stops at the protocol's stops too and is read as one
    assistant turn, special tokens kept (a tool call instead of an answer scores 0)."""
    from services.rollout.engine import GenerationRequest, SamplingParams, run_to_completion

    stops = rewrite_stops(None if chat is None else chat.stops)
    protocol = "tags" if chat is None else "tool_calls"
    requests, where = [], []
    for qid, item in prepared.items():
        params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=settings.max_tokens,
                                stop=stops, stop_token_ids=() if chat is None else chat.stop_ids)
        for variant in VARIANTS:
            ids = item.prompts[variant]
            if ids is None:
                continue
            for k in range(settings.samples):
                requests.append(GenerationRequest(list(ids), params,
                                                  tag=("evidence", qid, variant, k)))
                where.append((qid, variant))
    scores: dict[str, dict[str, list[float]]] = {
        qid: {v: [] for v in VARIANTS if item.prompts[v] is not None}
        for qid, item in prepared.items()}
    for (qid, variant), output in zip(where, run_to_completion(engine, requests), strict=True):
        text = engine.tokenizer.decode(output.token_ids, skip_special_tokens=chat is None)
        scores[qid][variant].append(score_response(text, ground_truth[qid], protocol)["em"])
    return scores


def summarise(lines: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """A row's probe figures from its lines' `evidence` fields; None when it was not probed.

    Accuracy per variant is the mean over probed trajectories of the mean over samples; the
    gaps are real − none and real − swapped over the same trajectories."""
    marked = [line["evidence"] for line in lines if isinstance(line.get("evidence"), dict)]
    if not marked:
        return None
    probed = [e for e in marked if "real" in e]
    skipped = sum(1 for e in marked if e.get("skipped") == NO_SEARCH)
    accuracy: dict[str, float | None] = {}
    for variant in VARIANTS:
        values = [mean(e[variant]) for e in probed if e.get(variant)]
        accuracy[variant] = round(mean(values), 6) if values else None
    both = [e for e in probed if e.get("swapped")]
    return {
        "probed": len(probed), "skipped_no_search": skipped,
        "samples": max((len(e["real"]) for e in probed), default=0),
        "accuracy": accuracy,
        "gap": {
            "real_minus_none": round(mean([mean(e["real"]) - mean(e["none"])
                                           for e in probed]), 6) if probed else None,
            "real_minus_swapped": round(mean([mean(e["real"]) - mean(e["swapped"])
                                              for e in both]), 6) if both else None,
        },
        "swapped_probed": len(both),
    }
