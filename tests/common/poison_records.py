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
