"""Decoded trajectories a researcher reads: RUN_DIR/samples.jsonl and the trackers' tables.

Every `learner.log_samples_every` RL steps, and at every evaluation, the learner decodes
`learner.log_samples_n` trajectories of what it just trained on (or evaluated) into one JSON line
each: the question, every turn's text with its action, search query, the retrieved documents
(ids and titles) and the observation that followed, the answer, the ground truth, the reward and
its components, the probe's scores and the policy version. `forage inspect RUN_DIR` prints them.

Picks are spread over groups (the first sample of each group, then the second, ...), so a few
samples show different questions rather than one question n times. A resumed run trims lines of
the steps it will run again, and a fresh run in a used run directory moves the old file aside,
as the learner does with metrics.jsonl.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.trajectory import ScoredTrajectory
from services.learner.batch_stats import is_correct

log = logging.getLogger("forage.learner.samples")

SAMPLES_FILE = "samples.jsonl"
# Characters of a prompt / observation kept in a sample line (the rest is elided).
MAX_PROMPT_CHARS = 2000
MAX_OBSERVATION_CHARS = 1500


def pick(items: Sequence[ScoredTrajectory], n: int) -> list[ScoredTrajectory]:
    """Up to `n` items, round-robin over groups (uid) in their order of appearance."""
    groups: dict[str, list[ScoredTrajectory]] = defaultdict(list)
    for item in items:
        groups[item.trajectory.uid].append(item)
    out: list[ScoredTrajectory] = []
    depth = 0
    while len(out) < n and any(depth < len(g) for g in groups.values()):
        for group in groups.values():
            if depth < len(group) and len(out) < n:
                out.append(group[depth])
        depth += 1
    return out


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... [{len(text) - limit} more chars]"


def _jsonable(value: Any) -> Any:
    """Ground truth / extras as JSON (bytes and odd types as strings)."""
    return json.loads(json.dumps(value, default=str, ensure_ascii=False))


def sample_row(item: ScoredTrajectory, tokenizer: Any, *, step: int, kind: str) -> dict[str, Any]:
    """One trajectory decoded into the fields of a samples.jsonl line (pure but for decoding)."""
    traj = item.trajectory

    def decode(ids: Any) -> str:
        return tokenizer.decode(list(map(int, ids)), skip_special_tokens=True)

    response = traj.response_ids
    turns = []
    for index, turn in enumerate(traj.turns):
        following = traj.turns[index + 1].start if index + 1 < len(traj.turns) else len(response)
        observation = decode(response[turn.end:following]).strip() if following > turn.end else ""
        turns.append({
            "action": turn.action,
            "text": decode(response[turn.start:turn.end]),
            "query": turn.query if turn.action == "search" else None,
            "docs": list(turn.docs or []),
            "observation": _clip(observation, MAX_OBSERVATION_CHARS),
            "policy_version": int(turn.policy_version),
        })
    answers = [t.query for t in traj.turns if t.action == "answer"]
    question = traj.extra.get("question") if isinstance(traj.extra, dict) else None
    if not isinstance(question, str) or not question:
        question = _clip(decode(traj.prompt_ids), MAX_PROMPT_CHARS)
    probe = traj.probe
    return {
        "step": int(step),
        "kind": kind,
        "time": time.time(),
        "uid": traj.uid,
        "sample_id": traj.sample_id,
        "data_source": traj.data_source,
        "policy_version": int(traj.policy_version),
        "question": question,
        "turns": turns,
        "answer": answers[-1] if answers else None,
        "ground_truth": _jsonable(traj.ground_truth),
        "reward": float(item.reward),
        "reward_components": {k: float(v) for k, v in item.reward_components.items()},
        "correct": is_correct(item),
        "finish_reason": traj.finish_reason,
        "num_searches": int(traj.num_searches),
        "response_tokens": int(len(response)),
        "probe_fractions": None if probe is None else [float(f) for f in probe.fractions],
        "probe_scores": None if item.probe_scores is None else [float(s) for s in
                                                                  item.probe_scores],
    }


def trim_samples(path: Path, last_step: int) -> int:
    """Drop lines of steps after `last_step` (a resumed run runs them again); returns how many."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            step = json.loads(line).get("step", 0)
        except (json.JSONDecodeError, AttributeError):
            dropped += 1  # a half-written line of the killed run
            continue
        if isinstance(step, (int, float)) and step > last_step:
            dropped += 1
        else:
            kept.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    tmp.replace(path)
    return dropped


class SampleLog:
    """RUN_DIR/samples.jsonl plus the trackers' tables; owned by the learner's rank 0."""

    def __init__(self, run_dir: str | Path, tokenizer: Any, n: int, trackers: Any = None,
                 resumed_step: int = 0) -> None:
        self.path = Path(run_dir) / SAMPLES_FILE
        self.tokenizer = tokenizer
        self.n = n
        self.trackers = trackers
        if resumed_step > 0:
            trim_samples(self.path, resumed_step)
        elif self.path.exists() and self.path.stat().st_size > 0:
            old = self.path.with_name(f"samples.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
            self.path.rename(old)
            log.warning("run dir already had samples from another run: moved them to %s", old)

    def write(self, items: Sequence[ScoredTrajectory], step: int, kind: str) -> list[dict]:
        """Decode and append up to `n` of `items`; returns the rows (also sent to trackers)."""
        if self.n <= 0 or not items:
            return []
        try:
            rows = [sample_row(item, self.tokenizer, step=step, kind=kind)
                    for item in pick(items, self.n)]
        except Exception as exc:  # a sample is a view: never stop training over one
            log.error("could not decode samples at step %d: %s: %s", step,
                      type(exc).__name__, exc)
            return []
        with self.path.open("a", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        if self.trackers is not None:
            self.trackers.log_samples(rows, step, kind)
        return rows
