"""msgpack codec for the stream payloads (docs/architecture.md). No pickle: data crosses processes.

Every payload is a msgpack map with a `schema` field naming the record type and version.
Token arrays travel as raw little-endian bytes. Anything that does not decode into a valid
record (garbage bytes, unknown schema, wrong types, inconsistent lengths, or values no consumer
can use: a negative token id, a NaN temperature, an empty prompt, a free-form field nested
deeper than `MAX_NESTING`) raises `CodecError`, the one exception type consumers need to catch
to dead-letter a message. Values are checked here, at the edge, because a value that passes
decoding reaches code (tokenizers, samplers, reward functions) that fails on it in ways the
consumer cannot tell apart from its own bugs. `check_token_ids` adds the bound only a consumer
knows: its vocabulary size.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from services.common.trajectory import (
    ACTIONS,
    FINISH_REASONS,
    PROTOCOLS,
    EvidenceProbe,
    Probe,
    PromptGroup,
    ScoredTrajectory,
    Trajectory,
    Turn,
    TurnRetrieval,
)

SCHEMA_PROMPT_GROUP = "forage.prompt_group/1"
SCHEMA_TRAJECTORY = "forage.trajectory/1"
SCHEMA_SCORED = "forage.scored/1"

Record = PromptGroup | Trajectory | ScoredTrajectory

# Free-form fields (ground_truth, extra) may nest at most this deep: deeper structures reach
# recursive code (reward functions, json, msgpack's own 1024-level stack) and fail there.
MAX_NESTING = 32
# Samples per prompt group: a group is played in one batch, so n is bounded by what a replica
# can hold; 4096 is far above any real group (GRPO uses 4-64) and below memory trouble.
MAX_GROUP_N = 4096
MAX_TURNS = 10_000
# Sampling overrides a prompt group may carry, and the values each accepts.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_turns")

_INT32 = np.dtype("<i4")
_UINT8 = np.dtype("u1")
_FLOAT32 = np.dtype("<f4")


class CodecError(ValueError):
    """A payload that is not a valid record; the message says what is wrong."""


# ---------------------------------------------------------------- encode


def encode(record: Record) -> bytes:
    if isinstance(record, ScoredTrajectory):
        body = _trajectory_to_map(record.trajectory)
        body["schema"] = SCHEMA_SCORED
        body["reward"] = float(record.reward)
        body["reward_components"] = {str(k): float(v) for k, v in record.reward_components.items()}
        body["probe_scores"] = (
            None if record.probe_scores is None else [float(x) for x in record.probe_scores]
        )
        if record.evidence_scores is not None:  # written only when probed (old readers skip it)
            body["evidence_scores"] = {str(k): float(v)
                                       for k, v in record.evidence_scores.items()}
    elif isinstance(record, Trajectory):
        body = _trajectory_to_map(record)
        body["schema"] = SCHEMA_TRAJECTORY
    elif isinstance(record, PromptGroup):
        body = {
            "schema": SCHEMA_PROMPT_GROUP,
            "uid": record.uid,
            "data_source": record.data_source,
            "prompt": record.prompt,
            "ground_truth": record.ground_truth,
            "n": record.n,
            "extra": record.extra,
            "policy_version_min": record.policy_version_min,
            "kind": record.kind,
            "sampling": record.sampling,
            "attempt": record.attempt,
        }
        if record.namespace:  # only when set: a record without it stays byte-identical
            body["namespace"] = record.namespace
    else:
        raise CodecError(f"cannot encode {type(record).__name__}")
    for name in ("ground_truth", "extra"):
        _check_nesting(body.get(name), f"{body['schema']}: field {name!r}")
    try:
        return msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode {type(record).__name__}: {exc}") from exc


def _trajectory_to_map(traj: Trajectory) -> dict[str, Any]:
    body: dict[str, Any] = {
        "uid": traj.uid,
        "sample_id": traj.sample_id,
        "data_source": traj.data_source,
        "policy_version": int(traj.policy_version),
        "prompt_ids": traj.prompt_ids.astype(_INT32, copy=False).tobytes(),
        "response_ids": traj.response_ids.astype(_INT32, copy=False).tobytes(),
        "loss_mask": traj.loss_mask.astype(_UINT8, copy=False).tobytes(),
        "rollout_logprobs": traj.rollout_logprobs.astype(_FLOAT32, copy=False).tobytes(),
        "turns": [
            [t.start, t.end, t.action, t.query, t.policy_version] for t in traj.turns
        ],
        "finish_reason": traj.finish_reason,
        "num_searches": int(traj.num_searches),
        "ground_truth": traj.ground_truth,
        "extra": traj.extra,
        "probe": None
        if traj.probe is None
        else {"fractions": list(traj.probe.fractions), "samples": traj.probe.samples},
        "kind": traj.kind,
        "error": traj.error,
    }
    if traj.protocol != "tags":
        # Written only when it is not the default: a tags record stays byte-identical, and
        # decoders that predate the key ignore it (forage.trajectory/1 readable both ways).
        body["protocol"] = traj.protocol
    if traj.evidence is not None:
        # Only when probed (probe.evidence): a record without it stays byte-identical.
        body["evidence"] = {"samples": {str(k): list(v) for k, v in traj.evidence.samples.items()},
                            "donor": traj.evidence.donor}
    if traj.namespace:  # only when set: older decoders ignore it, older records lack it
        body["namespace"] = traj.namespace
    if any(t.docs for t in traj.turns):
        # Beside `turns`, not in them: decoders that predate it ignore the key, so a new
        # rollout can feed an old scorer/learner (forage.trajectory/1 stays readable both ways).
        body["turn_docs"] = [
            None if not t.docs else [[d["id"], d["title"]] for d in t.docs] for t in traj.turns
        ]
    if any(t.index for t in traj.turns):  # only when set, beside `turns` as turn_docs
        body["turn_index"] = [t.index or None for t in traj.turns]
    if any(t.retrieval is not None for t in traj.turns):  # only when set, as turn_docs
        body["turn_retrieval"] = [None if t.retrieval is None else _retrieval_row(t.retrieval)
                                  for t in traj.turns]
    return body


def _retrieval_row(r: TurnRetrieval) -> list[Any]:
    """A search turn's retrieval health as [ms, cached, passages, empty, gold]."""
    return [float(r.ms), bool(r.cached), int(r.passages), int(r.empty),
            None if r.gold is None else bool(r.gold)]


# ---------------------------------------------------------------- decode


def decode(payload: bytes | None) -> Record:
    """Decode any record; raises CodecError for anything that is not a valid one.

    `None` is how a stream message says its entry had no `payload` field.
    """
    if payload is None:
        raise CodecError("the stream entry has no 'payload' field")
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
    if not payload:
        raise CodecError("payload is empty")
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CodecError(f"not a msgpack payload ({len(payload)} bytes): "
                         f"{_unpack_error(exc)}") from None
    if not isinstance(body, dict):
        raise CodecError(f"payload must be a map, got {type(body).__name__}")
    schema = body.get("schema")
    reader = _READERS.get(schema) if isinstance(schema, str) else None
    if reader is None:
        raise CodecError(f"unknown schema {_short(schema)}; expected one of {sorted(_READERS)}")
    try:
        return reader(_Fields(body, schema))
    except CodecError:
        raise
    except (TypeError, ValueError, KeyError, OverflowError, RecursionError) as exc:
        raise CodecError(f"{schema}: {type(exc).__name__}: {exc}") from None


# msgpack's own messages are empty for some errors (FormatError, StackError): say what they mean.
_UNPACK_ERRORS = {
    "ExtraData": "extra bytes after the first msgpack object",
    "FormatError": "a byte that starts no msgpack type",
    "StackError": "nested deeper than msgpack's 1024-level limit",
    "OutOfData": "truncated",
}


def _unpack_error(exc: Exception) -> str:
    name = type(exc).__name__
    meaning = _UNPACK_ERRORS.get(name)
    detail = str(exc)[:200]
    if meaning and detail:
        return f"{name} ({meaning}): {detail}"
    return f"{name} ({meaning})" if meaning else f"{name}: {detail or 'no detail'}"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _check_nesting(value: Any, what: str, limit: int = MAX_NESTING) -> None:
    """Raise CodecError when lists/maps in `value` nest deeper than `limit` (iteratively: a
    recursive walk would itself fail on the structures it is meant to refuse)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth >= limit:
            raise CodecError(f"{what} is nested too deep (more than {limit} levels)")
        stack.extend((child, depth + 1) for child in children)


def check_token_ids(record: Trajectory | ScoredTrajectory, vocab_size: int) -> None:
    """Raise CodecError when a token id is outside [0, vocab_size): the consumer's own bound
    (the codec already refuses negative ids)."""
    trajectory = record.trajectory if isinstance(record, ScoredTrajectory) else record
    for name in ("prompt_ids", "response_ids"):
        ids = getattr(trajectory, name)
        if ids.size and int(ids.max()) >= vocab_size:
            position = int(np.argmax(ids >= vocab_size))
            raise CodecError(
                f"{name} holds token id {int(ids[position])} at position {position}, outside "
                f"the vocabulary ({vocab_size} ids)"
            )


def decode_as(payload: bytes | None, record_type: type) -> Any:
    """Decode and check the record type (e.g. a prompt group on the trajectory stream)."""
    record = decode(payload)
    if type(record) is not record_type:
        raise CodecError(f"expected {record_type.__name__}, got {type(record).__name__}")
    return record


class _Fields:
    """Typed field access on a decoded map with errors that name the field."""

    def __init__(self, body: dict[str, Any], schema: str) -> None:
        self.body = body
        self.schema = schema

    def _get(self, name: str, optional: bool = False) -> Any:
        if name not in self.body:
            if optional:
                return None
            raise CodecError(f"{self.schema}: missing field {name!r}")
        return self.body[name]

    def _fail(self, name: str, expected: str, value: Any) -> CodecError:
        return CodecError(
            f"{self.schema}: field {name!r} must be {expected}, got {type(value).__name__}"
        )

    def str(self, name: str, optional: bool = False) -> Any:
        value = self._get(name, optional)
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise self._fail(name, "a string", value)
        return value

    def int(self, name: str, default: int | None = None) -> int:
        value = self._get(name, optional=default is not None)
        if value is None:
            return default  # type: ignore[return-value]
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._fail(name, "an integer", value)
        return value

    def float(self, name: str) -> float:
        value = self._get(name)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self._fail(name, "a number", value)
        return float(value)

    def map(self, name: str, default_empty: bool = True) -> dict[str, Any]:
        value = self._get(name, optional=default_empty)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self._fail(name, "a map", value)
        return value

    def choice(self, name: str, choices: tuple[str, ...], default: str | None = None) -> Any:
        value = self._get(name, optional=default is not None)
        if value is None:
            return default
        if value not in choices:
            raise CodecError(f"{self.schema}: field {name!r} must be one of {choices}, got {value!r}")
        return value

    def array(self, name: str, dtype: np.dtype) -> np.ndarray:
        value = self._get(name)
        if not isinstance(value, bytes):
            raise self._fail(name, "raw bytes", value)
        if len(value) % dtype.itemsize:
            raise CodecError(
                f"{self.schema}: field {name!r} has {len(value)} bytes, "
                f"not a multiple of {dtype.itemsize}"
            )
        return np.frombuffer(value, dtype=dtype).astype(dtype.newbyteorder("="), copy=False)

    def token_ids(self, name: str) -> np.ndarray:
        ids = self.array(name, _INT32)
        if ids.size and int(ids.min()) < 0:
            position = int(np.argmax(ids < 0))
            raise CodecError(
                f"{self.schema}: {name} holds a negative token id ({int(ids[position])}) at "
                f"position {position}"
            )
        return ids

    def raw(self, name: str) -> Any:
        return self._get(name, optional=True)

    def free_form(self, name: str) -> Any:
        """A field of any msgpack shape (ground truth), bounded in depth."""
        value = self._get(name, optional=True)
        _check_nesting(value, f"{self.schema}: field {name!r}")
        return value

    def free_map(self, name: str) -> dict[str, Any]:
        value = self.map(name)
        _check_nesting(value, f"{self.schema}: field {name!r}")
        return value


def _read_prompt_group(f: _Fields) -> PromptGroup:
    prompt = f.raw("prompt")
    if isinstance(prompt, list):
        for message in prompt:
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise CodecError(f"{f.schema}: prompt messages need string 'role' and 'content'")
        text = "".join(message["content"] for message in prompt)
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise f._fail("prompt", "a string or a list of chat messages", prompt)
    if not text.strip():
        raise CodecError(f"{f.schema}: field 'prompt' is empty (no text to generate from)")
    n = f.int("n")
    if not 1 <= n <= MAX_GROUP_N:
        raise CodecError(f"{f.schema}: field 'n' must be between 1 and {MAX_GROUP_N}, got {n}")
    sampling = f.map("sampling")
    for key, value in sampling.items():
        _check_sampling(f.schema, key, value)
    return PromptGroup(
        uid=f.str("uid"),
        data_source=f.str("data_source"),
        prompt=prompt,
        ground_truth=f.free_form("ground_truth"),
        n=n,
        extra=f.free_map("extra"),
        policy_version_min=f.int("policy_version_min", default=0),
        kind=f.choice("kind", ("train", "eval"), default="train"),
        sampling=sampling,
        attempt=f.int("attempt", default=0),
        namespace=f.str("namespace", optional=True) or "",
    )


def _check_sampling(schema: str, key: Any, value: Any) -> None:
    """Sampling overrides must be finite numbers in the range the samplers accept."""
    where = f"{schema}: sampling[{_short(key)}]"
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise CodecError(f"{where} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise CodecError(f"{where} must be a finite number, got {value}")
    if key == "temperature" and value < 0:
        raise CodecError(f"{where} must be >= 0 (0 = greedy), got {value}")
    if key == "top_p" and not 0 < value <= 1:
        raise CodecError(f"{where} must be in (0, 1], got {value}")
    if key in ("top_k", "max_turns") and value != int(value):
        raise CodecError(f"{where} must be an integer, got {value}")
    if key == "top_k" and not -1 <= value < 2**31:
        raise CodecError(f"{where} must be -1 or 0 (off) or a positive count, got {value}")
    if key == "max_turns" and not 0 <= value <= MAX_TURNS:
        raise CodecError(f"{where} must be between 0 and {MAX_TURNS}, got {value}")


def _read_trajectory(f: _Fields) -> Trajectory:
    response_ids = f.token_ids("response_ids")
    loss_mask = f.array("loss_mask", _UINT8)
    logprobs = f.array("rollout_logprobs", _FLOAT32)
    length = len(response_ids)
    if len(loss_mask) != length:
        raise CodecError(
            f"{f.schema}: loss_mask has {len(loss_mask)} entries, response_ids has {length}"
        )
    if len(logprobs) != length:
        raise CodecError(
            f"{f.schema}: rollout_logprobs has {len(logprobs)} entries, response_ids has {length}"
        )
    if loss_mask.size and loss_mask.max() > 1:
        raise CodecError(f"{f.schema}: loss_mask values must be 0 or 1")
    turns = _read_turns(f, length)
    return Trajectory(
        uid=f.str("uid"),
        sample_id=f.str("sample_id"),
        data_source=f.str("data_source"),
        policy_version=f.int("policy_version"),
        prompt_ids=f.token_ids("prompt_ids"),
        response_ids=response_ids,
        loss_mask=loss_mask,
        rollout_logprobs=logprobs,
        turns=turns,
        finish_reason=f.choice("finish_reason", FINISH_REASONS),
        num_searches=f.int("num_searches", default=0),
        ground_truth=f.free_form("ground_truth"),
        extra=f.free_map("extra"),
        probe=_read_probe(f),
        kind=f.choice("kind", ("train", "eval"), default="train"),
        error=f.str("error", optional=True),
        protocol=f.choice("protocol", PROTOCOLS, default="tags"),
        evidence=_read_evidence(f),
        namespace=f.str("namespace", optional=True) or "",
    )


def _read_turns(f: _Fields, length: int) -> list[Turn]:
    raw_turns = f.raw("turns") or []
    if not isinstance(raw_turns, list):
        raise f._fail("turns", "a list", raw_turns)
    turns = []
    for index, item in enumerate(raw_turns):
        if not isinstance(item, list) or len(item) != 5:
            raise CodecError(f"{f.schema}: turns[{index}] must be [start, end, action, query, version]")
        start, end, action, query, version = item
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, version)):
            raise CodecError(f"{f.schema}: turns[{index}] start/end/version must be integers")
        if not 0 <= start <= end <= length:
            raise CodecError(
                f"{f.schema}: turns[{index}] span [{start}, {end}) outside the response ({length})"
            )
        if action not in ACTIONS:
            raise CodecError(f"{f.schema}: turns[{index}] action {action!r} not in {ACTIONS}")
        if query is not None and not isinstance(query, str):
            raise CodecError(f"{f.schema}: turns[{index}] query must be a string or null")
        turns.append(Turn(start, end, action, query, version))
    _read_turn_docs(f, turns)
    _read_turn_index(f, turns)
    _read_turn_retrieval(f, turns)
    return turns


def _per_turn(f: _Fields, key: str, turns: list[Turn]) -> list[Any] | None:
    """An optional per-turn field: a list with one entry per turn, or None when absent (records
    that predate it)."""
    raw = f.raw(key)
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != len(turns):
        raise CodecError(f"{f.schema}: {key} must be a list with one entry per turn "
                         f"({len(turns)})")
    return raw


def _read_turn_retrieval(f: _Fields, turns: list[Turn]) -> None:
    """The optional `turn_retrieval`: per turn, null or [ms, cached, passages, empty, gold]
    (services/common/trajectory.TurnRetrieval); absent in records that predate it."""
    raw = _per_turn(f, "turn_retrieval", turns)
    if raw is None:
        return
    for index, (turn, row) in enumerate(zip(turns, raw, strict=True)):
        if row is None:
            continue
        ok = isinstance(row, list) and len(row) == 5
        if ok:
            ms, cached, passages, empty, gold = row
            ok = (isinstance(ms, int | float) and not isinstance(ms, bool) and ms >= 0
                  and isinstance(cached, bool) and isinstance(gold, bool | None)
                  and all(isinstance(n, int) and not isinstance(n, bool) for n in (passages, empty))
                  and 0 <= empty <= passages)
        if not ok:
            raise CodecError(f"{f.schema}: turn_retrieval[{index}] must be null or "
                             "[ms >= 0, cached bool, passages int, empty int <= passages, "
                             f"gold bool or null], got {_short(row)}")
        turn.retrieval = TurnRetrieval(float(ms), cached, passages, empty, gold)


def _read_turn_index(f: _Fields, turns: list[Turn]) -> None:
    """The optional `turn_index`: per turn, null or the retrieval tag that answered it."""
    raw = f.raw("turn_index")
    if raw is None:
        return
    if not isinstance(raw, list) or len(raw) != len(turns) or not all(
            tag is None or isinstance(tag, str) for tag in raw):
        raise CodecError(f"{f.schema}: turn_index must be a list of strings or nulls with one "
                         f"entry per turn ({len(turns)})")
    for turn, tag in zip(turns, raw, strict=True):
        turn.index = tag


def _read_turn_docs(f: _Fields, turns: list[Turn]) -> None:
    """The optional `turn_docs`: per turn, null or [[doc id, title], ...] (absent: none)."""
    raw = _per_turn(f, "turn_docs", turns)
    if raw is None:
        return
    for index, (turn, docs) in enumerate(zip(turns, raw, strict=True)):
        if docs is None:
            continue
        if not isinstance(docs, list) or not all(
            isinstance(d, list) and len(d) == 2 and all(isinstance(x, str) for x in d)
            for d in docs
        ):
            raise CodecError(f"{f.schema}: turn_docs[{index}] must be null or a list of "
                             "[doc id, title] string pairs")
        turn.docs = [{"id": doc_id, "title": title} for doc_id, title in docs]


def _read_probe(f: _Fields) -> Probe | None:
    raw_probe = f.raw("probe")
    if raw_probe is None:
        return None
    if not isinstance(raw_probe, dict):
        raise f._fail("probe", "a map", raw_probe)
    fractions = raw_probe.get("fractions")
    samples = raw_probe.get("samples")
    if not isinstance(fractions, list) or not all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in fractions
    ):
        raise CodecError(f"{f.schema}: probe.fractions must be a list of numbers")
    if not isinstance(samples, list) or len(samples) != len(fractions):
        raise CodecError(f"{f.schema}: probe.samples must hold one list per fraction")
    for group in samples:
        if not isinstance(group, list) or not all(isinstance(s, str) for s in group):
            raise CodecError(f"{f.schema}: probe.samples entries must be lists of strings")
    return Probe(fractions=[float(x) for x in fractions], samples=samples)


def _read_evidence(f: _Fields) -> EvidenceProbe | None:
    """The optional `evidence` map: {"samples": {variant: [text, ...]}, "donor": str | null}."""
    raw = f.raw("evidence")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise f._fail("evidence", "a map", raw)
    samples, donor = raw.get("samples"), raw.get("donor")
    if not isinstance(samples, dict) or not all(
        isinstance(k, str) and isinstance(v, list) and all(isinstance(t, str) for t in v)
        for k, v in samples.items()
    ):
        raise CodecError(f"{f.schema}: evidence.samples must map variant names to lists of "
                         "strings")
    if donor is not None and not isinstance(donor, str):
        raise CodecError(f"{f.schema}: evidence.donor must be a string or null")
    return EvidenceProbe(samples={k: list(v) for k, v in samples.items()}, donor=donor)


def _read_evidence_scores(f: _Fields) -> dict[str, float] | None:
    raw = f.raw("evidence_scores")
    if raw is None:
        return None
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
        for k, v in raw.items()
    ):
        raise CodecError(f"{f.schema}: evidence_scores must map names to numbers")
    return {k: float(v) for k, v in raw.items()}


def _read_scored(f: _Fields) -> ScoredTrajectory:
    trajectory = _read_trajectory(f)
    components = f.map("reward_components")
    for key, value in components.items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise CodecError(f"{f.schema}: reward_components[{key!r}] must be a number")
    probe_scores = f.raw("probe_scores")
    if probe_scores is not None:
        if not isinstance(probe_scores, list) or not all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in probe_scores
        ):
            raise CodecError(f"{f.schema}: probe_scores must be a list of numbers or null")
        probe_scores = [float(x) for x in probe_scores]
    reward = f.float("reward")
    if math.isinf(reward):
        raise CodecError(f"{f.schema}: reward must be finite or NaN, got {reward}")
    return ScoredTrajectory(
        trajectory=trajectory,
        reward=reward,
        reward_components={k: float(v) for k, v in components.items()},
        probe_scores=probe_scores,
        evidence_scores=_read_evidence_scores(f),
    )


_READERS = {
    SCHEMA_PROMPT_GROUP: _read_prompt_group,
    SCHEMA_TRAJECTORY: _read_trajectory,
    SCHEMA_SCORED: _read_scored,
}
