"""Evidence-reliance probe: the pure rules shared by `forage eval` (services/eval/evidence.py)
and the rollout's training-time probe (`probe.evidence.*`, services/rollout/agent.py).

A finished search trajectory is cut right after its last `<information>` block (before its
first `<answer>`), and every evidence block before the cut is replaced by `replacement`:
nothing (`none`: an empty block) or another question's passages (`swapped`). The policy then
writes its final turn again, and the rewrite is scored with the task's EM (docs/probe.md,
"Evidence reliance"; docs/eval.md, "Evidence probe"). Everything here is token-id arithmetic on
lists: the policy's own tokens are reused, only the replacement blocks are encoded.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.common.formats import information_block
from services.common.trajectory import Turn

VARIANTS: tuple[str, ...] = ("real", "none", "swapped")
# The variants that are generated (the `real` answer is the trajectory's own during training,
# a rewrite with the real evidence in forage eval).
REPLACED: tuple[str, ...] = ("none", "swapped")
EVIDENCE_STOPS = ("</answer>", "</search>")


def rewrite_stops(turn_stops: Sequence[str] | None = None) -> tuple[str, ...]:
    """Where a rewritten final turn stops: Search-R1's tags (EVIDENCE_STOPS), or with tool
    calls (`turn_stops`: the loop's stops of a turn, `</tool_call>` and the end of turn)
    `</answer>` and those."""
    if turn_stops is None:
        return EVIDENCE_STOPS
    return tuple(dict.fromkeys(("</answer>", *turn_stops)))
EMPTY_BLOCK = information_block([])


def derangement(n: int, seed: int) -> list[int]:
    """A seeded permutation of range(n) with no fixed point (Sattolo's algorithm: one cycle),
    so every question gets another question's passages; identity for n < 2 (no donor exists)."""
    order = list(range(n))
    if n < 2:
        return order
    rng = random.Random(f"forage-eval-evidence:{seed}")
    for i in range(n - 1, 0, -1):
        j = rng.randrange(i)
        order[i], order[j] = order[j], order[i]
    return order


def donors(qids: Sequence[str], seed: int) -> dict[str, str]:
    """Question id -> the id of the question whose passages it gets; empty for < 2 questions."""
    if len(qids) < 2:
        return {}
    order = derangement(len(qids), seed)
    return {qid: qids[order[i]] for i, qid in enumerate(qids)}


def information_runs(turns: Sequence[Turn], response_length: int) -> list[tuple[int, int]]:
    """[start, end) of each observation that answered a search with passages: the tokens after
    a search turn that retrieved (`docs` set) up to the next turn. Corrective messages and
    rejected queries are not evidence and stay as they were."""
    runs = []
    for i, turn in enumerate(turns):
        if turn.action != "search" or turn.docs is None:
            continue
        end = turns[i + 1].start if i + 1 < len(turns) else response_length
        if end > turn.end:
            runs.append((turn.end, end))
    return runs


def evidence_cut(runs: Sequence[tuple[int, int]], span_end: int) -> int | None:
    """Where the probe cuts: the end of the last evidence run that ends by `span_end` (the end
    of the reasoning span, i.e. before the policy's first `<answer>`); None when there is none."""
    ends = [end for _, end in runs if end <= span_end]
    return ends[-1] if ends else None


def rebuild(prompt_ids: Sequence[int], response_ids: Sequence[int], cut: int,
            runs: Sequence[tuple[int, int]], replacement: Sequence[int] | None,
            suffix: Sequence[int]) -> list[int]:
    """prompt + response[:cut] + suffix, with every run that starts before the cut replaced by
    `replacement` (None: kept). Pure token concatenation: the policy's own tokens are reused."""
    if replacement is None:
        return list(prompt_ids) + list(response_ids[:cut]) + list(suffix)
    return rebuild_each(prompt_ids, response_ids, cut, runs, [replacement] * len(runs), suffix)


def rebuild_each(prompt_ids: Sequence[int], response_ids: Sequence[int], cut: int,
                 runs: Sequence[tuple[int, int]], replacements: Sequence[Sequence[int]],
                 suffix: Sequence[int] = ()) -> list[int]:
    """`rebuild` with each run before the cut replaced by its own ids (`replacements[i]` for
    `runs[i]`): in the tool_calls protocol a replacement is a tool message rendered by the chat
    template after its own turn (services/eval/evidence.py, `prepare_tool_calls`)."""
    if len(replacements) < sum(1 for start, _ in runs if start < cut):
        raise ValueError("one replacement per run before the cut is needed")
    response = list(response_ids)
    out = list(prompt_ids)
    position = 0
    for (start, end), replacement in zip(runs, replacements, strict=False):
        if start >= cut:
            break
        out += response[position:start] + list(replacement)
        position = min(end, cut)
    out += response[position:cut] + list(suffix)
    return out


def variant_prompts(prompt_ids: Sequence[int], response_ids: Sequence[int],
                    runs: Sequence[tuple[int, int]], cut: int,
                    encode: Callable[[str], list[int]], swapped: str | None,
                    variants: Sequence[str] = VARIANTS) -> dict[str, list[int] | None]:
    """The probe prompts of `variants` (`real`: the evidence kept; `none`: every block empty;
    `swapped`: every block replaced by the text `swapped`, None when there is no donor).
    `encode` turns a block into token ids (cut to the observation budget by the caller)."""
    replacement: dict[str, str | None] = {"none": EMPTY_BLOCK, "swapped": swapped}
    prompts: dict[str, list[int] | None] = {}
    for variant in variants:
        if variant == "real":
            prompts[variant] = rebuild(prompt_ids, response_ids, cut, runs, None, [])
            continue
        text = replacement[variant]
        prompts[variant] = None if text is None else rebuild(
            prompt_ids, response_ids, cut, runs, encode(text), [])
    return prompts


def swapped_block(found: Any) -> str | None:
    """The information block of a donor's retrieval result; None for a rejected query."""
    return information_block(found) if isinstance(found, list) else None


def pick_donor(pool: Sequence[tuple[str, Any, str]], uid: str, ground_truth: Any,
               rng: random.Random) -> tuple[str, str] | None:
    """A donor for the `swapped` variant during training: uniformly among `pool`'s entries
    (group uid, ground truth, information block) of another question — another uid whose
    ground truth differs (two groups may ask the same question). (uid, block), or None."""
    others = [(donor, block) for donor, truth, block in pool
              if donor != uid and truth != ground_truth]
    return rng.choice(others) if others else None


def evidence_scores(real: float, rewrites: Mapping[str, Sequence[float]],
                    threshold: float = 1.0) -> dict[str, float]:
    """A probed trajectory's figures from the reward's scores (format credit 0): `real` is its
    own answer's score, `rewrites[variant]` the scores of that variant's rewrites. EM is score
    >= `threshold` (the probe's rule); a variant's EM is the mean over its rewrites, and
    `gap` = EM(real) - EM(swapped) when the swapped variant was built."""
    out = {"real": float(real >= threshold)}
    for variant in REPLACED:
        scores = rewrites.get(variant)
        if scores:
            out[variant] = sum(float(s >= threshold) for s in scores) / len(scores)
    if "swapped" in out:
        out["gap"] = out["real"] - out["swapped"]
    return out
