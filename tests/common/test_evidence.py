"""The evidence-reliance probe's shared rules (services/common/evidence.py), its record fields
(Trajectory.evidence, ScoredTrajectory.evidence_scores) and its config (probe.evidence)."""

from __future__ import annotations

import random

import msgpack
import pytest

from services.common import evidence
from services.common.codec import CodecError, decode_as, encode
from services.common.config import ConfigError, load_config
from services.common.trajectory import EvidenceProbe, ScoredTrajectory, Trajectory, Turn


def _trajectory(**kwargs) -> Trajectory:
    return Trajectory(uid="g1", sample_id="g1:0:0", data_source="nq", policy_version=3,
                      prompt_ids=[1, 2], response_ids=[5, 6, 7], loss_mask=[1, 0, 1],
                      rollout_logprobs=[-1.0, 0.0, -2.0],
                      turns=[Turn(0, 1, "search", "q", docs=[{"id": "1", "title": "t"}]),
                             Turn(2, 3, "answer", "x")],
                      ground_truth={"target": ["x"]}, **kwargs)


def test_cut_and_variant_prompts_reuse_the_policy_tokens() -> None:
    runs = [(3, 6), (8, 10)]
    assert evidence.evidence_cut(runs, 12) == 10
    assert evidence.evidence_cut(runs, 9) == 6  # the second block ends after the answer
    assert evidence.evidence_cut(runs, 5) is None
    response = list(range(100, 112))
    encoded = {evidence.EMPTY_BLOCK: [0], "SWAP": [7, 7]}
    prompts = evidence.variant_prompts([1], response, runs, 10, encoded.__getitem__, "SWAP")
    assert prompts["real"] == [1, *response[:10]]
    assert prompts["none"] == [1, 100, 101, 102, 0, 106, 107, 0]
    assert prompts["swapped"] == [1, 100, 101, 102, 7, 7, 106, 107, 7, 7]
    only = evidence.variant_prompts([1], response, runs, 10, encoded.__getitem__, None,
                                    evidence.REPLACED)
    assert set(only) == {"none", "swapped"} and only["swapped"] is None


def test_pick_donor_never_gives_the_same_question() -> None:
    pool = [("a", "x", "A"), ("b", "y", "B"), ("c", "x", "C")]
    rng = random.Random(0)
    drawn = {evidence.pick_donor(pool, "a", "x", rng) for _ in range(20)}
    assert drawn == {("b", "B")}  # c asks a question with a's answer: not a donor
    assert evidence.pick_donor(pool[:1], "a", "x", rng) is None


def test_evidence_scores_em_and_gap() -> None:
    assert evidence.evidence_scores(1.0, {"none": [0.0], "swapped": [1.0, 0.2]}) == {
        "real": 1.0, "none": 0.0, "swapped": 0.5, "gap": 0.5}
    assert evidence.evidence_scores(0.8, {"none": [1.0]}) == {"real": 0.0, "none": 1.0}
    assert evidence.evidence_scores(float("nan"), {}) == {"real": 0.0}


def test_records_carry_the_probe_only_when_present() -> None:
    plain = _trajectory()
    body = msgpack.unpackb(encode(plain), raw=False)
    assert "evidence" not in body  # a run without probe.evidence writes the same bytes
    scored_body = msgpack.unpackb(encode(ScoredTrajectory(plain, 1.0)), raw=False)
    assert "evidence_scores" not in scored_body
    assert decode_as(encode(plain), Trajectory).evidence is None
    probed = _trajectory(evidence=EvidenceProbe({"none": ["<answer> y </answer>"],
                                                 "swapped": []}, donor="g7"))
    back = decode_as(encode(ScoredTrajectory(probed, 1.0, evidence_scores={"real": 1.0,
                                                                           "none": 0.0})),
                     ScoredTrajectory)
    assert back.trajectory.evidence == probed.evidence
    assert back.evidence_scores == {"real": 1.0, "none": 0.0}
    body["evidence"] = {"samples": {"none": [3]}, "donor": None}
    with pytest.raises(CodecError, match="evidence.samples"):
        decode_as(msgpack.packb(body, use_bin_type=True), Trajectory)
    scored_body["evidence_scores"] = {"real": "yes"}
    with pytest.raises(CodecError, match="evidence_scores"):
        decode_as(msgpack.packb(scored_body, use_bin_type=True), ScoredTrajectory)


def test_config_is_off_by_default_and_checked() -> None:
    section = load_config().probe.evidence
    assert (section.enable, section.coeff, section.samples, section.temperature) == (
        False, 0.0, 1, 0.0)
    on = load_config(overrides=["probe.evidence.enable=true", "probe.evidence.fraction=0.25",
                                 "probe.evidence.coeff=0.1"]).probe.evidence
    assert (on.enable, on.fraction, on.coeff) == (True, 0.25, 0.1)
    for bad, words in ((["probe.evidence.fraction=2"], "fraction"),
                       (["probe.evidence.enable=true", "probe.evidence.samples=3"],
                        "temperature"),
                       (["probe.evidence.coeff=0.1"], "probe.evidence.enable"),
                       (["probe.evidence.typo=1"], "typo")):
        with pytest.raises(ConfigError, match=words):
            load_config(overrides=bad)
