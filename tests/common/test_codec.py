"""Codec round trips (property tests) and every way a payload can be wrong."""

from __future__ import annotations

import math
import pickle

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.codec import (
    SCHEMA_SCORED,
    SCHEMA_TRAJECTORY,
    CodecError,
    check_token_ids,
    decode,
    decode_as,
    encode,
)
from services.common.trajectory import (
    Probe,
    PromptGroup,
    ScoredTrajectory,
    Trajectory,
    Turn,
    TurnRetrieval,
)

text = st.text(max_size=40)
json_leaf = st.none() | st.booleans() | st.integers(-(2**31), 2**31) | text
json_value = st.recursive(
    json_leaf,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(text, children, max_size=4),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text}),
    min_size=1,
    max_size=3,
)
# A prompt must hold some text (an empty one is refused at decode).
prompt_text = st.text(max_size=40).filter(str.strip)
prompts = prompt_text | messages.filter(lambda ms: "".join(m["content"] for m in ms).strip())
# Sampling overrides within the ranges the codec accepts.
sampling_values = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, 100),
    "max_turns": st.integers(0, 10),
})


@st.composite
def retrievals(draw) -> TurnRetrieval:
    passages = draw(st.integers(0, 50))
    return TurnRetrieval(ms=draw(st.floats(0, 1e6, allow_nan=False)), cached=draw(st.booleans()),
                         passages=passages, empty=draw(st.integers(0, passages)),
                         gold=draw(st.none() | st.booleans()))


@st.composite
def trajectories(draw) -> Trajectory:
    length = draw(st.integers(0, 64))
    response = draw(st.lists(st.integers(0, 2**31 - 1), min_size=length, max_size=length))
    mask = draw(st.lists(st.integers(0, 1), min_size=length, max_size=length))
    logprobs = draw(
        st.lists(
            st.floats(-50, 0, allow_nan=False, width=32), min_size=length, max_size=length
        )
    )
    cuts = sorted(draw(st.lists(st.integers(0, length), max_size=4)))
    turns = [
        Turn(
            start=a,
            end=b,
            action=draw(st.sampled_from(["search", "answer", "invalid", "none", "tool"])),
            query=draw(st.none() | text),
            policy_version=draw(st.integers(0, 1000)),
            index=draw(st.none() | st.just("flat-0123456789abcdef@89abcdef")),
            retrieval=draw(st.none() | retrievals()),
        )
        for a, b in zip([0, *cuts], cuts, strict=False)
    ]
    num_fractions = draw(st.integers(0, 3))
    probe = draw(
        st.none()
        | st.just(
            Probe(
                fractions=[k / max(num_fractions - 1, 1) for k in range(num_fractions)],
                samples=[draw(st.lists(text, max_size=3)) for _ in range(num_fractions)],
            )
        )
    )
    return Trajectory(
        uid=draw(text),
        sample_id=draw(text),
        data_source=draw(st.sampled_from(["nq", "synth_single", "countdown"])),
        policy_version=draw(st.integers(0, 10**6)),
        prompt_ids=draw(st.lists(st.integers(0, 2**31 - 1), max_size=32)),
        response_ids=response,
        loss_mask=mask,
        rollout_logprobs=logprobs,
        turns=turns,
        finish_reason=draw(st.sampled_from(["answer", "max_turns", "length", "error"])),
        num_searches=draw(st.integers(0, 10)),
        ground_truth=draw(json_value),
        extra=draw(st.dictionaries(text, json_value, max_size=3)),
        probe=probe,
        kind=draw(st.sampled_from(["train", "eval"])),
        error=draw(st.none() | text),
    )


def assert_same_trajectory(a: Trajectory, b: Trajectory) -> None:
    for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs"):
        left, right = getattr(a, name), getattr(b, name)
        assert left.dtype == right.dtype, name
        np.testing.assert_array_equal(left, right, err_msg=name)
    for name in (
        "uid", "sample_id", "data_source", "policy_version", "turns", "finish_reason",
        "num_searches", "ground_truth", "extra", "probe", "kind", "error",
    ):
        assert getattr(a, name) == getattr(b, name), name


@settings(max_examples=150, deadline=None)
@given(trajectories())
def test_trajectory_round_trip(traj: Trajectory) -> None:
    decoded = decode_as(encode(traj), Trajectory)
    assert_same_trajectory(traj, decoded)


@settings(max_examples=100, deadline=None)
@given(
    trajectories(),
    st.floats(-10, 10, allow_nan=False),
    st.dictionaries(st.text(max_size=10), st.floats(-5, 5, allow_nan=False), max_size=3),
    st.none() | st.lists(st.floats(0, 1), max_size=6),
)
def test_scored_round_trip(traj, reward, components, probe_scores) -> None:
    scored = ScoredTrajectory(traj, reward, components, probe_scores)
    decoded = decode_as(encode(scored), ScoredTrajectory)
    assert_same_trajectory(traj, decoded.trajectory)
    assert decoded.reward == reward
    assert decoded.reward_components == components
    assert decoded.probe_scores == probe_scores


@settings(max_examples=100, deadline=None)
@given(
    st.text(min_size=1, max_size=20),
    prompts,
    json_value,
    st.integers(1, 64),
    st.dictionaries(text, json_value, max_size=3),
    st.integers(0, 100),
    st.sampled_from(["train", "eval"]),
    sampling_values,
)
def test_prompt_group_round_trip(uid, prompt, truth, n, extra, version, kind, sampling) -> None:
    group = PromptGroup(uid, "nq", prompt, truth, n, extra, version, kind, sampling, attempt=2)
    assert decode_as(encode(group), PromptGroup) == group


def test_nan_reward_survives_round_trip() -> None:
    """A reward function that returned None becomes NaN (TRL's convention) and must travel."""
    traj = _trajectory()
    decoded = decode_as(encode(ScoredTrajectory(traj, float("nan"))), ScoredTrajectory)
    assert math.isnan(decoded.reward)


def test_token_arrays_travel_as_little_endian_bytes() -> None:
    traj = _trajectory(response=[1, 2, 258], logprobs=[-0.5, 0.0, -1.25])
    body = msgpack.unpackb(encode(traj), raw=False)
    assert body["schema"] == SCHEMA_TRAJECTORY
    assert body["response_ids"] == np.array([1, 2, 258], dtype="<i4").tobytes()
    assert body["rollout_logprobs"] == np.array([-0.5, 0.0, -1.25], dtype="<f4").tobytes()
    assert isinstance(body["loss_mask"], bytes)


def _trajectory(response=(5, 6, 7), mask=(1, 0, 1), logprobs=(-1.0, 0.0, -2.0)) -> Trajectory:
    return Trajectory(
        uid="g1",
        sample_id="g1-0",
        data_source="nq",
        policy_version=3,
        prompt_ids=[1, 2],
        response_ids=list(response),
        loss_mask=list(mask),
        rollout_logprobs=list(logprobs),
        turns=[Turn(0, len(response), "answer")],
        ground_truth={"target": ["x"]},
    )


def _ids(values) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def _nested(depth: int):
    value = "x"
    for _ in range(depth):
        value = [value]
    return value


def _mutated(change) -> bytes:
    body = msgpack.unpackb(encode(_trajectory()), raw=False)
    change(body)
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1\xff garbage", "not a msgpack payload"),
        (b"", "payload is empty"),
        (None, "no 'payload' field"),
        (b"\xc1" * 1000, r"not a msgpack payload \(1000 bytes\): FormatError \(a byte"),
        (b"\x91" * 5000, "StackError \\(nested deeper"),
        (b"\x00\x00", "ExtraData"),
        (msgpack.packb([1, 2, 3]), "must be a map"),
        (msgpack.packb({"schema": "forage.trajectory/99"}), "unknown schema"),
        (msgpack.packb({"uid": "x"}), "unknown schema"),
        (_mutated(lambda b: b.update(loss_mask=b"\x01\x01")), "loss_mask has 2 entries"),
        (_mutated(lambda b: b.update(rollout_logprobs=b"\x00" * 4)), "rollout_logprobs has 1"),
        (_mutated(lambda b: b.update(response_ids=b"\x00" * 5)), "not a multiple of 4"),
        (_mutated(lambda b: b.update(response_ids=[1, 2, 3])), "'response_ids' must be raw bytes"),
        (_mutated(lambda b: b.update(uid=5)), "'uid' must be a string"),
        (_mutated(lambda b: b.pop("sample_id")), "missing field 'sample_id'"),
        (_mutated(lambda b: b.update(policy_version="3")), "'policy_version' must be an integer"),
        (_mutated(lambda b: b.update(finish_reason="done")), "'finish_reason' must be one of"),
        (_mutated(lambda b: b.update(turns=[[0, 9, "answer", None, 0]])), "outside the response"),
        (_mutated(lambda b: b.update(turns=[[0, 1, "jump", None, 0]])), "action 'jump'"),
        (_mutated(lambda b: b.update(loss_mask=b"\x01\x02\x01")), "must be 0 or 1"),
        (_mutated(lambda b: b.update(turn_index=["flat-0@0", None])), "turn_index must be"),
        (_mutated(lambda b: b.update(turn_retrieval=[None, None])), "turn_retrieval must be"),
        (_mutated(lambda b: b.update(turn_retrieval=[[1.0, False, 2, 3, None]])),
         r"turn_retrieval\[0\] must be null or \[ms >= 0.*got \[1.0, False, 2, 3, None\]"),
        (_mutated(lambda b: b.update(turn_retrieval=[[-1.0, False, 2, 0, True]])),
         r"turn_retrieval\[0\] must be"),
        (_mutated(lambda b: b.update(turn_retrieval=[[1.0, 1, 2, 0, True]])),
         r"turn_retrieval\[0\] must be"),
        (_mutated(lambda b: b.update(turn_retrieval=[[1.0, False, 2, 0, "yes"]])),
         r"turn_retrieval\[0\] must be"),
        (_mutated(lambda b: b.update(probe={"fractions": [0.0], "samples": []})), "one list per"),
        (
            _mutated(lambda b: b.update(schema=SCHEMA_SCORED, reward="high")),
            "'reward' must be a number",
        ),
        (_mutated(lambda b: b.update(schema=SCHEMA_SCORED)), "missing field 'reward'"),
        (_mutated(lambda b: b.update(response_ids=_ids([5, -1, 7]))),
         r"response_ids holds a negative token id \(-1\) at position 1"),
        (_mutated(lambda b: b.update(prompt_ids=_ids([-(2**31)]))), "prompt_ids holds a negative"),
        (_mutated(lambda b: b.update(ground_truth=_nested(33))),
         "field 'ground_truth' is nested too deep"),
        (_mutated(lambda b: b.update(ground_truth=_nested(1023))), "nested too deep"),
        (_mutated(lambda b: b.update(extra={"k": {"a": _nested(40)}})),
         "field 'extra' is nested too deep"),
    ],
)
def test_bad_payloads_raise_codec_error(payload: bytes, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        decode(payload)


def test_prompt_group_validation() -> None:
    good = msgpack.unpackb(encode(PromptGroup("u", "nq", "q?", None, n=2)), raw=False)
    for change, message in [
        ({"n": 0}, "'n' must be between 1 and 4096, got 0"),
        ({"n": 10**9}, "'n' must be between 1 and 4096"),
        ({"prompt": [{"role": "user"}]}, "need string 'role' and 'content'"),
        ({"prompt": 7}, "'prompt' must be a string or a list"),
        ({"prompt": ""}, "'prompt' is empty"),
        ({"prompt": " \n"}, "'prompt' is empty"),
        ({"prompt": []}, "'prompt' is empty"),
        ({"prompt": [{"role": "user", "content": ""}]}, "'prompt' is empty"),
        ({"sampling": {"temperature": "hot"}}, "sampling"),
        ({"sampling": {"temperature": math.nan}}, r"sampling\['temperature'\] must be a finite"),
        ({"sampling": {"temperature": -0.5}}, r"'temperature'\] must be >= 0"),
        ({"sampling": {"top_k": math.inf}}, r"'top_k'\] must be a finite"),
        ({"sampling": {"top_k": 2.5}}, r"'top_k'\] must be an integer"),
        ({"sampling": {"top_k": -2}}, r"'top_k'\] must be -1 or 0"),
        ({"sampling": {"top_p": 0.0}}, r"'top_p'\] must be in \(0, 1\]"),
        ({"sampling": {"top_p": 1.5}}, r"'top_p'\] must be in"),
        ({"sampling": {"max_turns": 1e300}}, r"'max_turns'\] must be between 0 and"),
        ({"sampling": {"custom": -math.inf}}, r"'custom'\] must be a finite"),
        ({"ground_truth": _nested(33)}, "'ground_truth' is nested too deep"),
        ({"extra": {"a": _nested(33)}}, "'extra' is nested too deep"),
    ]:
        with pytest.raises(CodecError, match=message):
            decode(msgpack.packb({**good, **change}))


def test_decode_as_rejects_the_wrong_record_type() -> None:
    with pytest.raises(CodecError, match="expected PromptGroup, got Trajectory"):
        decode_as(encode(_trajectory()), PromptGroup)


def test_pickle_payload_is_rejected_not_unpickled() -> None:
    with pytest.raises(CodecError):
        decode(pickle.dumps(_trajectory()))


def test_decoded_arrays_have_documented_dtypes() -> None:
    """Decoded arrays are usable numpy arrays with native byte order and the documented dtypes."""
    decoded = decode_as(encode(_trajectory()), Trajectory)
    assert decoded.response_ids.dtype == np.int32
    assert decoded.loss_mask.dtype == np.uint8
    assert decoded.rollout_logprobs.dtype == np.float32
    assert decoded.num_policy_tokens == 2
    assert decoded.num_invalid == 0


def test_nesting_at_the_limit_is_accepted_and_encode_refuses_deeper() -> None:
    traj = _trajectory()
    traj.ground_truth = _nested(32)  # 32 lists, one inside the other: the limit
    assert decode_as(encode(traj), Trajectory).ground_truth == traj.ground_truth
    traj.ground_truth = _nested(33)
    with pytest.raises(CodecError, match="nested too deep"):
        encode(traj)


def test_check_token_ids_bounds_ids_by_the_consumers_vocabulary() -> None:
    traj = decode_as(encode(_trajectory(response=(5, 6, 700))), Trajectory)
    check_token_ids(traj, 701)
    with pytest.raises(CodecError, match=r"response_ids holds token id 700 at position 2, "
                                         r"outside the vocabulary \(700 ids\)"):
        check_token_ids(traj, 700)
    with pytest.raises(CodecError, match="prompt_ids holds token id 2"):
        check_token_ids(ScoredTrajectory(traj, 1.0), 2)


def test_turn_retrieval_is_written_only_when_set_and_old_records_decode() -> None:
    """Retrieval health travels beside `turns` (optional): a record without it keeps its
    bytes, so older consumers read new records and new consumers read old ones."""
    plain = _trajectory()
    body = msgpack.unpackb(encode(plain), raw=False)
    assert "turn_retrieval" not in body
    assert decode_as(encode(plain), Trajectory).turns[0].retrieval is None
    searched = _trajectory()
    searched.turns = [Turn(0, 1, "search", "q", retrieval=TurnRetrieval(12.5, True, 3, 1, None)),
                      Turn(1, 3, "answer")]
    body = msgpack.unpackb(encode(searched), raw=False)
    assert body["turn_retrieval"] == [[12.5, True, 3, 1, None], None]
    assert decode_as(encode(searched), Trajectory).turns == searched.turns
