"""`forage eval --namespace NS`: the questions played by running rollout replicas.

Instead of loading an engine, the evaluation publishes its questions as prompt groups on
`{ns}:prompts`, in the replicas' own wire format (services/common/codec.py), and reads the
trajectories back from `{ns}:rollouts` through a consumer group of its own, so the same
replicas (vLLM on GPU nodes) a deployment runs play them. Each trajectory is scored and
written exactly as an in-process one (runner.sample_line), so eval.json, eval.md,
samples.jsonl and `forage inspect` read the same.

Why it is safe on a namespace a learner trains on: the groups are `kind: eval` with uids of
their own (`forage-eval:<tag>:<qid>`). A scorer scores them like the learner's own evaluation
groups, and the learner drops every eval trajectory that is not one of its own pending
evaluation questions (services/learner/loop.py, `_receive`): they are never trained on. The
replicas play them greedily (an eval group's temperature is 0 unless its `sampling` says
otherwise) at whatever policy version they serve; each line keeps that version.

Why a consumer group of its own: the scorer's group (if any) still sees every trajectory, and
ours, created at the stream's end before anything is published, sees only what comes after.
It is kept when a run stops early, so a rerun (same OUT, same config, hence the same tag)
reads the answers of the questions its predecessor had published, and is deleted when the
run completes.

What the replicas decide: the model, the engine and the agent-loop settings a group cannot
override. Each replica's heartbeat says which (worker.plays); they are adopted for the
evaluation's config, and a flag given on the command line that disagrees is refused.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from services.common.codec import CodecError, decode_as, encode
from services.common.redact import redact_text, redact_url
from services.common.trajectory import PromptGroup, Trajectory
from services.eval.data import Question
from services.eval.runner import (
    EvalSettings,
    PlayError,
    Progress,
    Row,
    agent_prompt,
    sample_line,
)

# How often a question whose trajectory failed (the replica's retriever was down, the engine
# refused it) is published again before the run stops: the learner's default max_attempts.
MAX_ATTEMPTS = 3
# The agent-loop settings the replicas' config decides, with the flags that name them here.
REPLICA_FLAGS = {"topk": "--topk", "max_tokens_per_turn": "--max-tokens-per-turn",
                 "max_obs_length": "--max-obs-length",
                 "max_response_length": "--max-response-length",
                 "max_prompt_length": "--max-prompt-length", "protocol": "--protocol"}
POLL_MS = 500
DEAD_CHECK_S = 2.0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ReplicaError(RuntimeError):
    """No replica serves the namespace, or they stopped serving it (exit code 75: run the same
    command again once they are back)."""


class ReplicaSettingsError(ValueError):
    """The replicas play other settings than the command line asks (a user mistake)."""


@dataclass(frozen=True)
class Target:
    """Where the replicas are: a Redis URL and the namespace they serve."""

    url: str
    namespace: str
    timeout_s: float = 60.0


def connect(target: Target) -> Any:
    """RedisStreams on the replicas' namespace. Never an embedded Redis: no replica could be
    on it. ReplicaError (one line) when Redis does not answer."""
    import redis

    from services.common.config import load_config
    from services.common.redis_server import RedisUnavailable
    from services.common.streams import RedisStreams

    config = load_config(None, [f"redis.url={target.url}", f"redis.namespace={target.namespace}",
                                "redis.embedded=false", "redis.retry_attempts=2"], environ={})
    try:
        streams = RedisStreams.from_config(config.redis)
        streams.client.ping()
    except RedisUnavailable:
        raise ReplicaError(f"--redis {redact_url(target.url)} does not answer: name the Redis "
                           "the replicas use (--redis URL, or REDIS_URL)") from None
    except (redis.RedisError, OSError) as exc:
        raise ReplicaError(f"--redis {redact_url(target.url)} does not answer "
                           f"({type(exc).__name__}: {redact_text(str(exc))})") from None
    return streams


def heartbeats(client: Any, namespace: str) -> list[dict[str, Any]]:
    """The live replicas' heartbeat bodies (`{ns}:heartbeat:rollout:*`), stopping ones left
    out."""
    beats = []
    for key in client.scan_iter(match=f"{namespace}:heartbeat:rollout:*", count=1000):
        raw = client.get(key)
        try:
            body = json.loads(raw) if raw is not None else None
        except ValueError:
            continue
        if isinstance(body, dict) and not body.get("stopping"):
            beats.append(body)
    return beats


def wait_for_replicas(client: Any, target: Target) -> list[dict[str, Any]]:
    """Heartbeats of the replicas serving the namespace, waiting up to `timeout_s` for one."""
    deadline = time.monotonic() + target.timeout_s
    while True:
        beats = heartbeats(client, target.namespace)
        if beats:
            return beats
        if time.monotonic() >= deadline:
            raise ReplicaError(
                f"no rollout replica serves namespace {target.namespace!r} at "
                f"{redact_url(target.url)}: no "
                f"heartbeat ({target.namespace}:heartbeat:rollout:*) within "
                f"{target.timeout_s:g}s; start one (`forage rollout serve --config FILE --set "
                f"redis.namespace={target.namespace}`) or check --redis and --namespace")
        time.sleep(0.2)


def adopt_settings(settings: EvalSettings, given: set[str],
                   beats: Sequence[dict[str, Any]]) -> tuple[EvalSettings, dict[str, Any]]:
    """The evaluation's settings with the ones the replicas decide taken from their
    heartbeats, and what the replicas reported (model, engine). ReplicaSettingsError when
    replicas disagree with each other or with a flag in `given`."""
    played = [b.get("settings") for b in beats if isinstance(b.get("settings"), dict)]
    if not played:  # replicas older than the heartbeat's settings: the flags are trusted
        return settings, {"models": [], "engines": []}
    first = played[0]
    for other in played[1:]:
        if other != first:
            raise ReplicaSettingsError(f"the replicas serving this namespace play different "
                                       f"settings ({first} and {other})")
    if not first.get("use_search", True):
        raise ReplicaSettingsError("the replicas serving this namespace do not search "
                                   "(rollout.use_search is off): mode agent needs search")
    changes: dict[str, Any] = {}
    for key, flag in REPLICA_FLAGS.items():
        if key not in first:
            continue
        theirs = first[key]
        if key in given and getattr(settings, key) != theirs:
            where = "retriever.topk" if key == "topk" else f"rollout.{key}"
            raise ReplicaSettingsError(
                f"{flag} {getattr(settings, key)}, but the replicas play {where}={theirs}: "
                f"their config decides it; drop the flag or give {flag} {theirs}")
        changes[key] = theirs
    seen = {"models": sorted({str(b.get("model")) for b in beats if b.get("model")}),
            "engines": sorted({str(b.get("engine")) for b in beats if b.get("engine")})}
    return replace(settings, **changes), seen


def run_tag(out: str, config: dict[str, Any]) -> str:
    """The same OUT and config give the same tag, hence the same uids and consumer group, so
    a rerun picks up the answers to what its predecessor published."""
    from pathlib import Path

    text = json.dumps({"out": str(Path(out).resolve()), "config": config}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class ReplicaPlayer:
    """Publishes one row's questions, reads their trajectories back, writes each line."""

    def __init__(self, streams: Any, target: Target, tag: str) -> None:
        self.streams, self.target, self.tag = streams, target, tag
        self.group = f"forage-eval-{tag}"
        self.prefix = f"forage-eval:{tag}:"
        self._create_group()
        # Dead letters are watched from before the first publish on.
        last = self.streams.client.xrevrange(self.streams.key("dead"), count=1)
        self._dead_from = _text(last[0][0]) if last else "0-0"

    def _create_group(self) -> None:
        """Our consumer group on `{ns}:rollouts`, at the stream's end (a rerun keeps its
        position: BUSYGROUP is fine)."""
        import redis

        try:
            self.streams.client.xgroup_create(self.streams.key("rollouts"), self.group,
                                              id="$", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def close(self) -> None:
        """Delete our consumer group once every question is written: nothing more to read.
        (A run that stops early keeps it, for the rerun.)"""
        self.streams.client.xgroup_destroy(self.streams.key("rollouts"), self.group)

    def _group(self, question: Question, prompt: Any, settings: EvalSettings,
               attempt: int) -> PromptGroup:
        return PromptGroup(
            uid=self.prefix + question.qid, data_source=question.data_source, prompt=prompt,
            ground_truth=question.ground_truth, n=1, kind="eval", attempt=attempt,
            sampling={"temperature": settings.temperature, "top_p": settings.top_p,
                      "top_k": settings.top_k, "max_turns": settings.max_turns},
            extra={"question": question.question})

    def play_row(self, row: Row, questions: Sequence[Question], total: int,
                 settings: EvalSettings, tokenizer: Any,
                 write: Callable[[list[dict[str, Any]]], None]) -> None:
        """Play `questions` (the row's unfinished ones; `total` counts all), at most
        `batch_size` published and unanswered at a time, writing each as it comes back."""
        if not questions:
            return
        progress = Progress(row.label, total, total - len(questions))
        queue = list(questions)
        by_uid = {self.prefix + q.qid: q for q in questions}
        attempts: dict[str, int] = {}
        prompts = {q.qid: agent_prompt(settings, q) for q in questions}
        outstanding: set[str] = set()
        first_id: str | None = None
        started = last_result = time.monotonic()
        last_dead = 0.0
        while queue or outstanding:
            room = settings.batch_size - len(outstanding)
            batch, queue = queue[:max(0, room)], queue[max(0, room):]
            if batch:
                ids = self.streams.publish_many("prompts", [
                    encode(self._group(q, prompts[q.qid], settings, 0)) for q in batch])
                first_id = first_id or ids[0]
                outstanding.update(self.prefix + q.qid for q in batch)
            got = self._receive(outstanding, by_uid, attempts, row, settings, tokenizer,
                                prompts, write, progress)
            now = time.monotonic()
            if got:
                last_result = now
                # Answers to questions a stopped predecessor published may arrive before
                # this run publishes them again: they are done too.
                queue = [q for q in queue if self.prefix + q.qid in by_uid]
                progress.show(final=not queue and not outstanding)
            if now - last_dead >= DEAD_CHECK_S:
                last_dead = now
                self._check_dead(outstanding)
                self._check_serving(first_id, started, last_result)

    def _receive(self, outstanding: set[str], by_uid: dict[str, Question],
                 attempts: dict[str, int], row: Row, settings: EvalSettings, tokenizer: Any,
                 prompts: dict[str, Any], write: Callable[[list[dict[str, Any]]], None],
                 progress: Progress) -> int:
        """Read trajectories; write ours, retry failed ones, ack everything read (the others
        are training trajectories or another evaluation's: not ours to keep)."""
        messages = self.streams.consume("rollouts", consumer="eval", count=64,
                                        block_ms=POLL_MS, group=self.group)
        done = 0
        for message in messages:
            try:
                trajectory = decode_as(message.payload, Trajectory)
            except CodecError:
                continue
            uid = trajectory.uid
            if uid not in by_uid or not self._latest(trajectory, attempts.get(uid, 0)):
                continue  # not ours, already written, or a failure of an earlier issue
            question = by_uid[uid]
            if trajectory.finish_reason == "error":
                self._retry(question, trajectory, attempts, settings, prompts[question.qid],
                            row)
                continue
            line = sample_line(row, question, trajectory, tokenizer, None, None)
            # The question's own ids, as in process: the prefix only routes it on the streams.
            line["uid"] = question.qid
            line["sample_id"] = str(line["sample_id"]).removeprefix(self.prefix)
            write([line])
            progress.add(line["em"])
            outstanding.discard(uid)
            del by_uid[uid]  # written: a duplicate (a redelivery, a re-issue) is dropped
            done += 1
        if messages:
            self.streams.ack("rollouts", [m.id for m in messages], group=self.group)
        return done

    @staticmethod
    def _latest(trajectory: Trajectory, attempt: int) -> bool:
        """Whether the trajectory answers the question's latest issue (a failure of an issue
        already re-published must not spend another attempt)."""
        parts = str(trajectory.sample_id).rsplit(":", 2)
        return len(parts) != 3 or not parts[1].isdigit() or int(parts[1]) >= attempt

    def _retry(self, question: Question, trajectory: Trajectory, attempts: dict[str, int],
               settings: EvalSettings, prompt: Any, row: Row) -> None:
        """A failed trajectory says nothing about the policy: publish the question again, up to
        MAX_ATTEMPTS issues, then stop the run (nothing is written for it)."""
        uid = self.prefix + question.qid
        attempt = attempts.get(uid, 0) + 1
        if attempt >= MAX_ATTEMPTS:
            raise PlayError(f"question {question.qid} ({row.label}) failed {MAX_ATTEMPTS} times "
                            f"on the replicas: {trajectory.error}; nothing was written for it, "
                            "so running the same command again retries it")
        attempts[uid] = attempt
        self.streams.publish("prompts", encode(self._group(question, prompt, settings,
                                                           attempt)))

    def _check_dead(self, outstanding: set[str]) -> None:
        """A question a replica dead-lettered (it could not play it) never comes back: stop
        with the replica's reason instead of waiting for ever."""
        key = self.streams.key("dead")
        for entry_id, fields in self.streams.client.xrange(key, min=f"({self._dead_from}",
                                                           max="+"):
            self._dead_from = _text(entry_id)
            try:
                group = decode_as(fields.get(b"payload", b""), PromptGroup)
            except CodecError:
                continue
            if group.uid in outstanding:
                reason = fields.get(b"reason", b"").decode(errors="replace")
                raise PlayError(f"a replica dead-lettered question "
                                f"{group.uid.removeprefix(self.prefix)}: {reason}")

    def _check_serving(self, first_id: str | None, started: float, last_result: float) -> None:
        """Stop (ReplicaError) when no replica took the first question within the timeout, or
        when every replica is gone and nothing came back within the timeout."""
        from services.common.streams import delivered

        now = time.monotonic()
        timeout = self.target.timeout_s
        if first_id is not None and now - started >= timeout and not delivered(
                first_id, self.streams.last_delivered("prompts")):
            raise ReplicaError(
                f"no rollout replica took a question from {self.streams.key('prompts')} within "
                f"{timeout:g}s; finished questions are kept, so running the same command again "
                "goes on from here")
        if now - last_result >= timeout and not heartbeats(self.streams.client,
                                                           self.target.namespace):
            raise ReplicaError(
                f"the rollout replicas of namespace {self.target.namespace!r} stopped (no "
                f"heartbeat, no answer for {timeout:g}s); finished questions are kept, so "
                "running the same command again goes on from here")
