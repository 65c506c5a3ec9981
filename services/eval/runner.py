"""Plays evaluation questions through the engine (the rollout factory's) and the agent loop, in process.

One engine per model; for each mode, the questions not yet in OUT/samples.jsonl are played in
batches of `batch_size` questions. Each batch runs the agent loop in `lockstep` scheduling
(every trajectory takes turn t, then one retrieval call for all, then turn t+1): what the
engine batches together then depends only on the questions and the model's outputs, never on
how fast the retriever answered, so a replayed run sees exactly the batches, and produces
exactly the tokens, of the run it replays. `direct` and `rag` are single-turn plays of the same
loop (no search executed, the turn stops at `</answer>`). Every question is written as soon as
it finishes, which is what makes an interrupted run resumable.

`protocol` "tool_calls" (`--protocol`): `agent` rows play the rollout's tool-call protocol
(docs/rollout.md, "Tool calls") with the `search` tool and `prompts.TOOL_AGENT_TEMPLATE`, and
their responses are scored as the scorer scores tool_calls trajectories (decoded with special
tokens kept, the last assistant turn's answer); `direct` and `rag` stay single-turn tag plays.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.common.formats import STOP_STRINGS, doc_refs
from services.common.retrieval_health import trajectory_health
from services.common.tool_calls import observation_text
from services.common.trajectory import PromptGroup, ScoredTrajectory, Trajectory
from services.eval.data import Question
from services.eval.errors import attribute_error, split_passages
from services.eval.evidence import (
    NO_SEARCH,
    EvidenceSettings,
    ToolChat,
    force_answers,
    information_runs,
    prepare,
    prepare_tool_calls,
    swapped_block,
    swapped_result,
)
from services.eval.prompts import direct_prompt, rag_prompt, tool_agent_prompt
from services.eval.retrieval import Backend
from services.eval.stats import score_response
from services.rollout.retrieval import QueryRejected, RetrieverError
from services.scorer.rewards.text import gold_answers


class PlayError(RuntimeError):
    """A question could not be played (the retriever went away, the engine refused it)."""


@dataclass(frozen=True)
class EvalSettings:
    """Generation and retrieval settings: part of the config a resumed run must match."""

    topk: int = 3
    max_turns: int = 4
    max_tokens_per_turn: int = 500
    max_obs_length: int = 500
    max_response_length: int = 2048
    max_prompt_length: int = 4096
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    batch_size: int = 32
    evidence_probe: bool = False
    evidence_samples: int = 3
    protocol: str = "tags"  # of agent rows: "tags" (Search-R1's) or "tool_calls"
    # Where an agent row's tags turn stops (rollout.stop_strings; `--run` takes the run's).
    stop_strings: tuple[str, ...] = STOP_STRINGS
    # tool_calls agent rows: ask the data's own prompt (a run's evaluation does; `--run`)
    # instead of TOOL_AGENT_TEMPLATE (the data's prompt usually teaches tags).
    data_prompt: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The config's settings. The probe's fields appear only when it is on, the protocol
        only when it is not `tags` and the stop strings only when not Search-R1's, so an
        output directory written before they existed still resumes."""
        out = asdict(self)
        if not self.evidence_probe:
            out.pop("evidence_probe")
            out.pop("evidence_samples")
        if self.protocol == "tags":
            out.pop("protocol")
        if tuple(self.stop_strings) == STOP_STRINGS:
            out.pop("stop_strings")
        else:
            out["stop_strings"] = list(self.stop_strings)
        if not (self.data_prompt and self.protocol == "tool_calls"):
            out.pop("data_prompt")
        return out


def agent_prompt(settings: EvalSettings, question: Question) -> Any:
    """An agent row's prompt: the data's own, except under tool_calls without `data_prompt`
    (TOOL_AGENT_TEMPLATE's)."""
    if settings.protocol == "tool_calls" and not settings.data_prompt:
        return tool_agent_prompt(question.question)
    return question.agent_prompt


def tool_mode(settings: EvalSettings, mode: str) -> bool:
    """Whether a row of `mode` plays the tool_calls protocol (agent rows only)."""
    return mode == "agent" and settings.protocol == "tool_calls"


@dataclass(frozen=True)
class Row:
    """One row of the table: a model played in one mode."""

    number: int
    label: str
    model_dir: str
    mode: str


def _loop_settings(settings: EvalSettings, mode: str) -> Any:
    from services.rollout.agent import LoopSettings

    agent = mode == "agent"
    if tool_mode(settings, mode):
        return LoopSettings(
            max_turns=settings.max_turns, max_tokens_per_turn=settings.max_tokens_per_turn,
            max_obs_length=settings.max_obs_length,
            max_response_length=settings.max_response_length,
            max_prompt_length=settings.max_prompt_length, use_search=True,
            temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
            scheduling="lockstep", protocol="tool_calls", tools=("search",))
    return LoopSettings(
        max_turns=settings.max_turns, max_tokens_per_turn=settings.max_tokens_per_turn,
        max_obs_length=settings.max_obs_length, max_response_length=settings.max_response_length,
        max_prompt_length=settings.max_prompt_length, use_search=agent,
        temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
        stop_strings=settings.stop_strings if agent else ("</answer>",),
        scheduling="lockstep")


def sample_line(row: Row, question: Question, trajectory: Trajectory, tokenizer: Any,
                index_id: str | None, rag_docs: list[dict[str, str]] | None) -> dict[str, Any]:
    """One samples.jsonl line: the learner's decoded-sample fields (so `forage inspect` reads
    it) plus the row, the question id and the three scores. No wall-clock field: a replayed
    run writes identical lines."""
    from services.learner.samples import sample_row

    ids = [int(t) for t in trajectory.response_ids]
    # As the scorer's `response_text`: a tool_calls response keeps the template's markers,
    # whose turns the answer rule splits (services/common/tool_calls.py).
    protocol = trajectory.protocol
    text = tokenizer.decode(ids, skip_special_tokens=protocol != "tool_calls")
    scores = score_response(text, question.ground_truth, protocol)
    scored = ScoredTrajectory(trajectory, reward=scores["em"], reward_components=scores)
    line = sample_row(scored, tokenizer, step=row.number, kind="eval")
    line.pop("time", None)
    for turn in line["turns"]:
        if turn["action"] == "search" and turn["docs"]:
            turn["index"] = index_id
    line.update({
        "row": row.label, "model": row.model_dir, "mode": row.mode, "qid": question.qid,
        "question": question.question, **scores,
        "turns_count": len(trajectory.turns), "response_sha256":
            hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest(),
    })
    if rag_docs is not None:
        line["rag_docs"] = rag_docs
        line["index"] = index_id
    if row.mode == "agent":
        # Retrieval health's reproducible counts (no latency, no cache: a replay writes the
        # same line); eval.md's retrieval table pools them (services/common/retrieval_health.py).
        line["retrieval"] = trajectory_health(trajectory).counts()
        line["support"] = asdict(question.support) if question.support is not None else None
        line["error"] = None if scores["em"] >= 1 else attribute_error(
            trajectory.num_searches > 0, retrieved_passages(trajectory, tokenizer),
            gold_answers(question.ground_truth), question.support)
    return line


def retrieved_passages(trajectory: Trajectory, tokenizer: Any) -> list[str]:
    """Every passage the trajectory's searches retrieved, decoded in full from its own
    observation tokens (the samples line keeps a clipped observation only)."""
    ids = [int(t) for t in trajectory.response_ids]
    if trajectory.protocol == "tool_calls":  # the tool messages, without the template's markers
        return [passage for start, end in information_runs(trajectory.turns, len(ids))
                for passage in split_passages(observation_text(
                    tokenizer.decode(ids[start:end], skip_special_tokens=False)))]
    return [passage for start, end in information_runs(trajectory.turns, len(ids))
            for passage in split_passages(tokenizer.decode(ids[start:end],
                                                           skip_special_tokens=True))]


class Progress:
    """One progress line on stderr: rewritten in place on a terminal, one line per batch
    otherwise (a log file should not fill with carriage returns)."""

    def __init__(self, label: str, total: int, done: int) -> None:
        self.label, self.total, self.done = label, total, done
        self.started, self.played, self.correct = time.monotonic(), 0, 0.0
        self.tty = sys.stderr.isatty()

    def add(self, em: float) -> None:
        self.done += 1
        self.played += 1
        self.correct += em

    def show(self, final: bool = False) -> None:
        rate = self.played / max(time.monotonic() - self.started, 1e-9)
        em = self.correct / self.played if self.played else 0.0
        line = (f"forage eval: {self.label}: {self.done}/{self.total} questions, "
                f"EM {em:.3f} (this run), {rate:.2f} q/s")
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if final else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _retrieve_donors(backend: Backend | None, texts: list[str]) -> dict[str, Any]:
    """Each donor question's passages (one call for the batch), through the evaluation's own
    backend: recorded under --retrieval record, read from the store under replay."""
    unique = list(dict.fromkeys(texts))
    if not unique or backend is None:
        return {}
    try:
        found = backend.retrieve(unique)
    except RetrieverError as exc:
        raise PlayError(f"retrieval for the evidence probe failed: {exc}; finished questions "
                        "are kept, so running the same command again goes on from here") from None
    return dict(zip(unique, found, strict=True))


def probe_evidence(engine: Any, played: list[tuple[dict[str, Any], Trajectory, Question]],
                   donor_of: dict[str, Question], backend: Backend | None,
                   settings: EvalSettings, chat: ToolChat | None = None) -> None:
    """Add each line's `evidence` field (services/eval/evidence.py): the forced answers'
    EM per variant and sample, or why it was skipped. `chat`: the tool_calls protocol's
    template (evidence replaced by rendered tool messages)."""
    searched = [(line, t, q) for line, t, q in played if t.num_searches > 0]
    found = _retrieve_donors(backend, [donor_of[q.qid].question for _, _, q in searched
                                       if q.qid in donor_of])
    prepared, golds = {}, {}
    for line, trajectory, question in played:
        donor = donor_of.get(question.qid)
        if chat is not None:
            block = swapped_result(found.get(donor.question)) if donor is not None else None
            item = (prepare_tool_calls(chat, trajectory, agent_prompt(settings, question),
                                       block, settings.max_obs_length)
                    if trajectory.num_searches > 0 else None)
        else:
            block = swapped_block(found.get(donor.question)) if donor is not None else None
            item = (prepare(engine.tokenizer, trajectory, block, settings.max_obs_length)
                    if trajectory.num_searches > 0 else None)
        if item is None:
            line["evidence"] = {"skipped": NO_SEARCH}
            continue
        prepared[question.qid], golds[question.qid] = item, question.ground_truth
        line["evidence"] = {"donor": donor.qid if donor is not None and block is not None
                            else None}
    scores = force_answers(engine, prepared, golds,
                           EvidenceSettings(samples=settings.evidence_samples,
                                            max_tokens=settings.max_tokens_per_turn),
                           chat)
    for line, _, question in played:
        if question.qid in scores:
            line["evidence"].update(scores[question.qid])


def play_row(engine: Any, row: Row, questions: Sequence[Question], total: int,
             settings: EvalSettings, backend: Backend | None, index_id: str | None,
             write: Callable[[list[dict[str, Any]]], None],
             donor_of: dict[str, Question] | None = None) -> None:
    """Play `questions` (those of the row not done yet; `total` counts all) and write each.

    With the evidence probe on (`donor_of` given, agent rows), a batch's lines are written
    once the batch is probed, so a resumed run never holds a line without its probe."""
    from services.rollout.agent import AgentLoop

    if not questions:
        return
    probing = donor_of is not None and row.mode == "agent"
    progress = Progress(row.label, total, total - len(questions))
    loop = AgentLoop(engine, _loop_settings(settings, row.mode),
                     backend if row.mode == "agent" else None)  # type: ignore[arg-type]
    sampling = {"temperature": settings.temperature, "top_p": settings.top_p,
                "top_k": settings.top_k}
    try:
        for start in range(0, len(questions), settings.batch_size):
            chunk = list(questions[start:start + settings.batch_size])
            prompts: list[Any] = [agent_prompt(settings, q) for q in chunk]
            rag_docs: dict[str, list[dict[str, str]]] = {}
            if row.mode == "direct":
                prompts = [direct_prompt(q.question) for q in chunk]
            elif row.mode == "rag":
                assert backend is not None
                try:
                    found = backend.retrieve([q.question for q in chunk])
                except RetrieverError as exc:
                    raise PlayError(f"retrieval for {row.label} failed: {exc}; finished "
                                    "questions are kept, so running the same command again "
                                    "goes on from here") from None
                prompts = []
                for q, docs in zip(chunk, found, strict=True):
                    docs = [] if isinstance(docs, QueryRejected) else docs
                    rag_docs[q.qid] = doc_refs(docs)
                    prompts.append(rag_prompt(q.question, docs))
            by_uid = {q.qid: q for q in chunk}
            played: list[tuple[dict[str, Any], Trajectory, Question]] = []
            groups = [PromptGroup(uid=q.qid, data_source=q.data_source, prompt=p,
                                  ground_truth=q.ground_truth, n=1, kind="eval",
                                  sampling=dict(sampling), extra={"question": q.question})
                      for q, p in zip(chunk, prompts, strict=True)]

            def done(group: PromptGroup, trajectories: list[Trajectory],
                     by_uid: dict[str, Question] = by_uid,
                     rag_docs: dict[str, list[dict[str, str]]] = rag_docs,
                     played: list[tuple[dict[str, Any], Trajectory, Question]] = played) -> None:
                question = by_uid[group.uid]
                if trajectories[0].finish_reason == "error":  # an outage, not a wrong answer
                    raise PlayError(f"question {question.qid} ({row.label}) failed: "
                                    f"{trajectories[0].error}; nothing was written for it, "
                                    "so running the same command again retries it")
                line = sample_line(row, question, trajectories[0], engine.tokenizer, index_id,
                                   rag_docs.get(question.qid) if row.mode == "rag" else None)
                if probing:
                    played.append((line, trajectories[0], question))
                else:
                    write([line])
                progress.add(line["em"])

            loop.run(groups, on_group_done=done)
            if probing and played:
                assert donor_of is not None
                chat = (ToolChat(loop.chat, loop.tool_stops, loop.tool_stop_ids)
                        if tool_mode(settings, row.mode) and loop.chat is not None else None)
                probe_evidence(engine, played, donor_of, backend, settings, chat)
                write([line for line, _, _ in played])
            progress.show(final=start + settings.batch_size >= len(questions))
    finally:
        loop.close()
