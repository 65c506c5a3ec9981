"""Hostile stream records for the poison and soak tests (issue 14): one of every kind.

Each poison is (name, raw stream fields, words the dead-letter reason must contain). They are
built from a good record's msgpack map and changed by hand, because `encode` refuses most of
them: these are what a buggy or hostile producer could XADD directly.

Not a test module (no `test_` prefix): tests load it by path (importlib.util), since the
suite runs with `--import-mode=importlib` and tests/ is not a package.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from services.common.codec import encode
from services.common.trajectory import PromptGroup, Trajectory

Poison = tuple[str, dict[bytes, bytes], tuple[str, ...]]


def nested(depth: int, leaf: Any = "x") -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def _fields(payload: bytes) -> dict[bytes, bytes]:
    return {b"payload": payload}


def _changed(record: Any, **changes: Any) -> bytes:
    body = msgpack.unpackb(encode(record), raw=False)
    body.update(changes)
    return msgpack.packb(body, use_bin_type=True)


def _ids(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def garbage(size: int) -> list[Poison]:
    """Undecodable bytes of the kinds msgpack reports with an empty message."""
    return [
        ("garbage-format", _fields(b"\xc1" * size), ("not a msgpack payload", "FormatError")),
        ("garbage-nesting", _fields(b"\x91" * size), ("not a msgpack payload", "nested")),
        ("garbage-extra", _fields(b"\x00" * size), ("not a msgpack payload", "extra")),
        ("missing-payload", {b"body": b"x"}, ("no 'payload' field",)),
        ("empty-payload", _fields(b""), ("payload is empty",)),
    ]


def trajectory_poisons(good: Trajectory, vocab_size: int, garbage_bytes: int = 1 << 16
                       ) -> list[Poison]:
    """Poison for the rollouts stream (the scorer's input)."""
    n = len(good.response_ids)
    group = PromptGroup("pg", good.data_source, "q?", None, n=1)
    return [
        ("negative-token", _fields(_changed(good, response_ids=_ids([5] * (n - 1) + [-1]))),
         ("response_ids", "negative")),
        ("token-beyond-vocab",
         _fields(_changed(good, response_ids=_ids([5] * (n - 1) + [vocab_size + 7]))),
         ("response_ids", "vocabulary")),
        ("negative-prompt-token", _fields(_changed(good, prompt_ids=_ids([-3, 4]))),
         ("prompt_ids", "negative")),
        ("deep-ground-truth", _fields(_changed(good, ground_truth=nested(1023))),
         ("ground_truth", "deep")),
        ("deep-extra", _fields(_changed(good, extra={"info": nested(200)})),
         ("extra", "deep")),
        ("wrong-record-type", _fields(encode(group)), ("expected Trajectory",)),
        ("unknown-schema", _fields(msgpack.packb({"schema": "forage.trajectory/99"})),
         ("unknown schema",)),
        ("unknown-data-source", _fields(_changed(good, data_source="mystery_task")),
         ("mystery_task",)),
        *garbage(garbage_bytes),
    ]


def prompt_group_poisons(good: PromptGroup, garbage_bytes: int = 1 << 16) -> list[Poison]:
    """Poison for the prompts stream (the rollout's input)."""
    sampling = dict(good.sampling)
    return [
        ("nan-temperature", _fields(_changed(good, sampling={**sampling,
                                                              "temperature": float("nan")})),
         ("temperature", "finite")),
        ("inf-top-k", _fields(_changed(good, sampling={**sampling, "top_k": float("inf")})),
         ("top_k",)),
        ("fractional-top-k", _fields(_changed(good, sampling={**sampling, "top_k": 2.5})),
         ("top_k", "integer")),
        ("zero-top-p", _fields(_changed(good, sampling={**sampling, "top_p": 0.0})),
         ("top_p",)),
        ("negative-temperature",
         _fields(_changed(good, sampling={**sampling, "temperature": -1.0})),
         ("temperature",)),
        ("huge-max-turns", _fields(_changed(good, sampling={**sampling, "max_turns": 1e300})),
         ("max_turns",)),
        ("empty-prompt", _fields(_changed(good, prompt="")), ("prompt", "empty")),
        ("empty-messages", _fields(_changed(good, prompt=[])), ("prompt", "empty")),
        ("blank-message", _fields(_changed(good, prompt=[{"role": "user", "content": "  "}])),
         ("prompt", "empty")),
        ("huge-n", _fields(_changed(good, n=10**9)), ("'n'",)),
        ("deep-ground-truth", _fields(_changed(good, ground_truth=nested(1023))),
         ("ground_truth", "deep")),
        ("deep-extra", _fields(_changed(good, extra={"info": nested(200)})), ("extra", "deep")),
        ("wrong-record-type", _fields(encode(Trajectory("u", "s", "nq", 0, [1], [2], [1],
                                                        [0.0]))),
         ("expected PromptGroup",)),
        *garbage(garbage_bytes),
    ]


# ----------------------------------------------------------------- seeded fuzzing

HOSTILE_VALUES: list[Any] = [
    None, True, -1, 0, 2**63 - 1, -(2**63), 1.5, float("nan"), float("inf"), "", "x" * 5000,
    b"\x00\xff", [], {}, nested(40), nested(3), {"k": float("nan")}, [1, [2, [3]]],
    {"role": "user"}, [{"role": "user", "content": ""}],
]
HOSTILE_NUMBERS = [float("nan"), float("inf"), float("-inf"), -1.0, 0.0, 1e-300, 1e308, 2.5,
                   0.5, 1, 2**40, -(2**31)]
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_turns", "repetition_penalty")


def _mutate_bytes(rng, payload: bytes) -> bytes:
    data = bytearray(payload)
    kind = rng.randrange(3)
    if kind == 0:
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 1:
        del data[rng.randrange(1, len(data)):]
    else:
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    return bytes(data)


def _mutate_fields(rng, body: dict, extra_fields: dict[str, list[Any]]) -> bytes:
    body = dict(body)
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(sorted(body))
        roll = rng.random()
        if roll < 0.2:
            body.pop(name, None)
        elif name in extra_fields and roll < 0.7:
            body[name] = rng.choice(extra_fields[name])
        else:
            body[name] = rng.choice(HOSTILE_VALUES)
    try:
        return msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return msgpack.packb({"schema": body.get("schema"), "uid": "x"}, use_bin_type=True)


def fuzz_prompt_groups(good: PromptGroup, rng, count: int) -> list[dict[bytes, bytes]]:
    """`count` mutated prompt-group entries (bytes flipped, cut or appended; fields dropped or
    set to hostile values). None decodes to a group of more than 4 samples, so a fuzzed record
    that happens to be valid stays cheap to play."""
    from services.common.codec import CodecError, decode

    body = msgpack.unpackb(encode(good), raw=False)
    sampling = [{rng.choice(SAMPLING_KEYS): rng.choice(HOSTILE_NUMBERS)} for _ in range(20)]
    fields = {"sampling": sampling, "n": [0, -1, 10**9, 4097, 2**64 - 1, 1.0, "2"],
              "prompt": ["", "   ", [], [{"role": "user", "content": " "}], 7]}
    out: list[dict[bytes, bytes]] = []
    while len(out) < count:
        if rng.random() < 0.4:
            payload = _mutate_bytes(rng, encode(good))
        else:
            payload = _mutate_fields(rng, body, fields)
        try:
            record = decode(payload)
            if isinstance(record, PromptGroup) and record.n > 4:
                continue
        except CodecError:
            pass
        out.append({b"payload": payload})
    return out


def fuzz_trajectories(good: Trajectory, rng, count: int) -> list[dict[bytes, bytes]]:
    """`count` mutated trajectory entries, as `fuzz_prompt_groups`."""
    body = msgpack.unpackb(encode(good), raw=False)
    n = len(good.response_ids)
    fields = {
        "response_ids": [_ids([rng.randrange(-(2**31), 2**31) for _ in range(n)])
                         for _ in range(5)] + [b"\x01\x02\x03"],
        "turns": [[[0, n + 5, "answer", None, 0]], [[0, 1, "jump", None, 0]], [[-1, 0]]],
        "probe": [{"fractions": [0.0], "samples": []}, {"fractions": [float("nan")],
                                                          "samples": [["x"]]}],
        "finish_reason": ["done", None, 3],
    }
    out: list[dict[bytes, bytes]] = []
    for _ in range(count):
        if rng.random() < 0.4:
            out.append({b"payload": _mutate_bytes(rng, encode(good))})
        else:
            out.append({b"payload": _mutate_fields(rng, body, fields)})
    return out
