"""The evidence-reliance probe of `forage eval` (services/eval/evidence.py): its pure parts,
then its plumbing end to end on the tiny world with two scripted policies. The "copier" answers
with the city of the first passage of its last information block; the "ignorer" answers the
question's city from memory. The probe must measure a gap near 1 for the copier and 0 for the
ignorer, skip (and count) the trajectory that never searched, and replay exactly."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from services.common.trajectory import Turn
from services.eval import evidence
from services.eval.evaluate import EvalError, EvalRequest, run
from services.eval.runner import EvalSettings

from .conftest import PEOPLE

SETTINGS = EvalSettings(topk=2, max_turns=2, max_tokens_per_turn=12, max_obs_length=120,
                        max_response_length=200, batch_size=6, evidence_probe=True,
                        evidence_samples=2)
QUESTION = re.compile(r"Question: where was (\w+) born")
BORN = re.compile(r"born in (\w+)")


def test_derangement_has_no_fixed_point_and_is_seeded() -> None:
    for n in range(2, 30):
        order = evidence.derangement(n, seed=n)
        assert sorted(order) == list(range(n)) and all(order[i] != i for i in range(n))
    assert evidence.derangement(10, 1) == evidence.derangement(10, 1)
    assert evidence.derangement(10, 1) != evidence.derangement(10, 2)
    assert evidence.donors(["a"], 0) == {}


def test_information_runs_and_token_rebuild() -> None:
    turns = [Turn(0, 3, "search", "q", docs=[{"id": "1", "title": "t"}]),
             Turn(6, 8, "search", "bad", docs=None),  # a rejected query: not evidence
             Turn(10, 12, "answer", "x")]
    assert evidence.information_runs(turns, 12) == [(3, 6)]
    response = list(range(100, 112))
    rebuilt = evidence.rebuild([1, 2], response, 10, [(3, 6)], [7], [9])
    assert rebuilt == [1, 2, 100, 101, 102, 7, 106, 107, 108, 109, 9]
    assert evidence.rebuild([1], response, 4, [(3, 6)], None, [9]) == [1, 100, 101, 102, 103, 9]
    assert evidence.rebuild([1], response, 3, [(3, 6)], [7], []) == [1, 100, 101, 102]


def test_summarise_averages_samples_then_trajectories() -> None:
    lines = [{"evidence": {"donor": "b", "real": [1.0, 1.0], "none": [0.0, 1.0],
                           "swapped": [0.0, 0.0]}},
             {"evidence": {"donor": "a", "real": [0.0, 1.0], "none": [0.0, 0.0],
                           "swapped": [1.0, 0.0]}},
             {"evidence": {"skipped": "no_search"}}, {}]
    found = evidence.summarise(lines)
    assert found is not None
    assert (found["probed"], found["skipped_no_search"], found["samples"]) == (2, 1, 2)
    assert found["accuracy"] == {"real": 0.75, "none": 0.25, "swapped": 0.25}
    assert found["gap"] == {"real_minus_none": 0.5, "real_minus_swapped": 0.5}
    assert evidence.summarise([{}]) is None


def script(engine, answer_from: str) -> None:
    """Turn 0 searches the person's name (except the last person, who answers at once: the
    trajectory the probe skips); the final turns the evidence probe samples follow `answer_from`
    ("sample": the tiny policy samples them itself)."""
    def encode(text: str) -> list[int]:
        return engine.tokenizer.encode(text, add_special_tokens=False)

    def forced(request):
        if request.tag[0] == "turn":
            state = request.tag[1]
            number = next(i for i, (name, _) in enumerate(PEOPLE)
                          if name in state.group.extra["question"])
            name, city = PEOPLE[number]
            if state.turns:
                return None
            if number == len(PEOPLE) - 1:
                return encode(f"<answer> {city} </answer>")
            return encode(f"<search> {name} </search>")
        if request.tag[0] != "evidence" or answer_from == "sample":
            return None
        text = engine.tokenizer.decode(request.prompt_ids)
        if answer_from == "memory":
            name = QUESTION.search(text).group(1)
            answer = dict(PEOPLE)[name]
        else:
            block = text.rsplit("<information>", 1)[1].split("</information>", 1)[0]
            found = BORN.search(block)
            answer = found.group(1) if found else "nothing"
        return encode(f"<answer> {answer} </answer>")  # the rewritten final turn

    engine.forced_tokens = forced


def probe_run(world: dict[str, Path], out: Path, answer_from: str | None, **kwargs) -> dict:
    def prepare(engine) -> None:
        if answer_from is not None:
            script(engine, answer_from)

    fields = {"models": [str(world["policy"])], "data": [str(world["flashrag"])],
              "modes": ["agent"], "out": str(out), "index": str(world["index"]),
              "settings": SETTINGS, "prepare_engine": prepare, **kwargs}
    return run(EvalRequest(**fields))


def test_copier_relies_on_evidence_and_ignorer_does_not(eval_world, tmp_path):
    row = probe_run(eval_world, tmp_path / "copier", "passages")["rows"][0]
    copier = row["evidence"]
    # Error attribution on the same run: the five searching trajectories saw their city in a
    # passage and wrote no answer (the random policy's turn 1); no row says anything of hops.
    assert row["errors"]["wrong"] == 5 and row["errors"]["counts"]["evidence_misread"] == 5
    assert row["errors"]["with_support"] == 0
    assert copier["probed"] == 5 and copier["skipped_no_search"] == 1
    assert copier["samples"] == 2 and copier["swapped_probed"] == 5
    assert copier["accuracy"] == {"real": 1.0, "none": 0.0, "swapped": 0.0}
    assert copier["gap"] == {"real_minus_none": 1.0, "real_minus_swapped": 1.0}

    ignorer = probe_run(eval_world, tmp_path / "ignorer", "memory")["rows"][0]["evidence"]
    assert ignorer["probed"] == 5 and ignorer["skipped_no_search"] == 1
    assert ignorer["accuracy"] == {"real": 1.0, "none": 1.0, "swapped": 1.0}
    assert ignorer["gap"] == {"real_minus_none": 0.0, "real_minus_swapped": 0.0}

    lines = [json.loads(x) for x in (tmp_path / "copier" / "samples.jsonl").read_text()
             .splitlines()]
    skipped = [x for x in lines if x["evidence"].get("skipped")]
    assert [x["qid"] for x in skipped] == ["nq/test_5"] and skipped[0]["num_searches"] == 0
    donors = {x["qid"]: x["evidence"]["donor"] for x in lines if "donor" in x["evidence"]}
    assert len(donors) == 5 and all(d != q and d.startswith("nq/") for q, d in donors.items())
    table = (tmp_path / "copier" / "eval.md").read_text()
    assert "Evidence reliance" in table and "| real − none |" in table


def test_replayed_probe_is_exact_and_needs_the_store(eval_world, tmp_path):
    recorded, replayed = tmp_path / "recorded", tmp_path / "replayed"
    # The copier's forced answers are read from the swapped passages, which replay takes from
    # the store: the same answers only if the store gave back the same passages.
    one = replace(SETTINGS, evidence_samples=1)
    probe_run(eval_world, recorded, "passages", retrieval="record", limit=3, settings=one)
    store = recorded / "retrieval.sqlite"
    probe_run(eval_world, replayed, "passages", retrieval="replay", index=None,
              store=str(store), limit=3, settings=one)
    for name in ("samples.jsonl", "eval.json", "eval.md"):
        assert (replayed / name).read_bytes() == (recorded / name).read_bytes(), name
    doc = json.loads((replayed / "eval.json").read_text())
    assert doc["rows"][0]["evidence"]["probed"] == 3
    assert doc["config"]["settings"]["evidence_samples"] == 1

    # A store recorded without the probe lacks the donors' passages: the error names a query.
    plain = tmp_path / "plain"
    probe_run(eval_world, plain, "sample", retrieval="record",
              settings=replace(SETTINGS, evidence_probe=False), limit=2)
    with pytest.raises(EvalError, match="query 'where was .* is not in"):
        probe_run(eval_world, tmp_path / "again", "sample", retrieval="replay", index=None,
                  store=str(plain / "retrieval.sqlite"), limit=2)


def test_probe_needs_agent_mode(eval_world, tmp_path):
    with pytest.raises(EvalError, match="--evidence-probe probes agent trajectories"):
        probe_run(eval_world, tmp_path / "x", None, modes=["direct"])


def test_the_final_turn_is_rewritten_right_after_the_last_evidence(tiny_policy_dir) -> None:
    """A policy that restates what it read before answering ("the passage says Ashby") must
    not carry the answer into the `none` prompt: the cut is the end of the last block."""
    import numpy as np
    from transformers import AutoTokenizer

    from services.common.trajectory import Trajectory

    tok = AutoTokenizer.from_pretrained(tiny_policy_dir)

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    search = ids("<think> I need Ana. </think>\n<search> Ana </search>")
    block = ids("\n\n<information>Doc 1(Title: \"Ana\") Ana was born in Ashby.</information>\n\n")
    after = ids("<think> The passage says Ashby. </think>\n<answer> Ashby </answer>")
    response = search + block + after
    mask = [1] * len(search) + [0] * len(block) + [1] * len(after)
    turns = [Turn(0, len(search), "search", "Ana", docs=[{"id": "1", "title": "Ana"}]),
             Turn(len(search) + len(block), len(response), "answer")]
    trajectory = Trajectory("q", "q:0:0", "nq", 0, np.array(ids("Where was Ana born?")),
                            np.array(response), np.array(mask), np.zeros(len(response)),
                            turns=turns, num_searches=1, kind="eval")
    prepared = evidence.prepare(tok, trajectory, "<information>Bo was born in Cray."
                                "</information>", max_obs_length=120)
    assert prepared is not None
    text = {v: tok.decode(p) for v, p in prepared.prompts.items()}
    assert text["real"].count("Ashby") == 1 and "passage says" not in text["real"]
    assert "Ashby" not in text["none"] and "Ashby" not in text["swapped"]
    assert "Cray" in text["swapped"]
    for prompt in text.values():
        assert prompt.rstrip().endswith("</information>")
