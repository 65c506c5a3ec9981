"""`forage eval` end to end in process: every mode on both file layouts, record then replay,
resume, and the errors a user meets. Real parts throughout: the tiny policy on the
transformers engine, the agent loop, a FAISS flat index searched in process, the scorer's
rules. Some turns are scripted through the engine's own `forced_tokens` hook (conftest.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from services.eval.evaluate import EvalError, EvalRequest, run
from services.eval.runner import EvalSettings
from services.launch.cli_inspect import format_sample, load_samples, select

from .conftest import PEOPLE, build_index, scripted, write_flashrag

SETTINGS = EvalSettings(topk=2, max_turns=2, max_tokens_per_turn=12, max_obs_length=120,
                        max_response_length=200, batch_size=6)


def request(world: dict[str, Path], out: Path, modes=("direct", "rag", "agent"),
            counter: dict | None = None, **kwargs) -> EvalRequest:
    def prepare(engine) -> None:
        started = scripted(engine)
        if counter is not None:
            counter["started"] = started

    fields = {"models": [str(world["policy"])],
              "data": [str(world["flashrag"]), str(world["search_r1"])],
              "modes": list(modes), "out": str(out), "index": str(world["index"]),
              "settings": SETTINGS, "prepare_engine": prepare, **kwargs}
    return EvalRequest(**fields)


def lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_every_mode_on_both_layouts_table_intervals_comparisons_and_inspect(eval_world, tmp_path):
    out = tmp_path / "out"
    doc = run(request(eval_world, out))
    assert doc["data_sources"] == ["nq", "hotpotqa"]  # Search-R1's paper order
    rows = {row["mode"]: row for row in doc["rows"]}
    assert list(rows) == ["direct", "rag", "agent"]
    # Scripted: direct right on persons 0 and 3, rag on 0, 2, 4, agent on 0, 2, 4.
    assert rows["direct"]["em"]["nq"] == pytest.approx(2 / 6)
    assert rows["rag"]["em"]["hotpotqa"] == pytest.approx(3 / 6)
    assert rows["agent"]["em"]["average"] == pytest.approx(3 / 6)
    for row in rows.values():
        assert row["n"] == {"nq": 6, "hotpotqa": 6, "all": 12}
        for name in ("em", "subem", "f1"):
            low, high = row[f"{name}_ci"]["nq"]
            assert 0 <= low <= row[name]["nq"] <= high <= 1
    assert rows["agent"]["searches"]["all"] == 1.0 and rows["direct"]["searches"]["all"] == 0
    assert rows["agent"]["turns"]["all"] >= 2
    assert "Wilson" in doc["intervals"]["em"] and "bootstrap" in doc["intervals"]["f1"]
    pair = next(p for p in doc["comparisons"] if p["a"].endswith("direct")
                and p["b"].endswith("agent"))
    assert (pair["all"]["a_only"], pair["all"]["b_only"]) == (2, 4)  # persons 3 vs 2 and 4
    assert pair["all"]["p_value"] == pytest.approx(2 * (1 + 6 + 15) / 64)
    table = (out / "eval.md").read_text()
    assert "| Method | NQ | HotpotQA | Avg. |" in table
    assert f"| {rows['rag']['label']} | 0.500 | 0.500 | 0.500 |" in table
    assert "McNemar" in table and "0.6875" in table

    found = lines(out)
    agent = [x for x in found if x["mode"] == "agent"]
    search = agent[0]["turns"][0]
    assert search["action"] == "search" and search["query"] == PEOPLE[0][0]
    assert search["index"] == doc["config"]["index"] and search["docs"][0]["id"] == "0"
    assert "Brixol was born in Corvale" in search["observation"]
    rag = next(x for x in found if x["mode"] == "rag")
    assert rag["rag_docs"][0]["title"] == PEOPLE[0][0] and rag["index"] == doc["config"]["index"]
    # Retrieval health: only person i's passage (id i) names their city, so a question's gold
    # is in its passages exactly when that id was retrieved; one search each, nothing empty.
    names = [name for name, _ in PEOPLE]
    expected = [any(d["id"] == str(names.index(next(n for n in names if n in x["question"])))
                    for d in x["turns"][0]["docs"]) for x in agent]
    assert [x["retrieval"]["gold_hit"] for x in agent] == expected and any(expected)
    health = rows["agent"]["retrieval"]
    assert health["gold_hit_rate"]["all"] == pytest.approx(sum(expected) / 12, abs=1e-6)
    assert health["search_turns"] == {"nq": 6, "hotpotqa": 6, "all": 12}
    assert health["empty_rate"]["all"] == 0 and health["repeated_query_rate"]["all"] == 0
    assert "latency_p50_ms" not in health and "retrieval" not in rows["rag"]
    assert (f"| {rows['agent']['label']} | 12 | {health['gold_hit_rate']['all']:.3f} | 0.000 | "
            "0.000 | 0.000 |") in table

    samples, skipped = load_samples(out)  # what `forage inspect OUT --step 2` shows
    chosen, step = select(samples, 2, wrong=False, kind=None)
    assert skipped == 0 and step == 2 and len(chosen) == 12
    assert 'retrieved: 0 "Brixol"' in format_sample(chosen[0])


def test_record_then_replay_gives_the_same_trajectories_and_metrics(eval_world, tmp_path):
    recorded, replayed = tmp_path / "recorded", tmp_path / "replayed"
    run(request(eval_world, recorded, modes=("rag", "agent"), retrieval="record"))
    store = recorded / "retrieval.sqlite"
    assert store.is_file()
    run(request(eval_world, replayed, modes=("rag", "agent"), retrieval="replay", index=None,
                store=str(store)))
    assert (replayed / "eval.json").read_bytes() == (recorded / "eval.json").read_bytes()
    assert (replayed / "samples.jsonl").read_bytes() == (recorded / "samples.jsonl").read_bytes()
    assert (replayed / "eval.md").read_bytes() == (recorded / "eval.md").read_bytes()
    assert not (replayed / "retrieval.sqlite").exists()

    # Another index (one more passage): its identity differs, so replay refuses it.
    other = build_index(tmp_path, [*PEOPLE, ("Zed", "Ymir")], name="other-index")
    with pytest.raises(EvalError, match="different index"):
        run(request(eval_world, tmp_path / "other", modes=("agent",), retrieval="replay",
                    index=str(other), store=str(store)))
    # A question the recorded run never asked: the error names its query.
    extra = write_flashrag(tmp_path / "more" / "nq" / "test.jsonl", [*PEOPLE, ("Zed", "Ymir")])
    with pytest.raises(EvalError, match="query 'where was Zed born\\?'.* is not in"):
        run(request(eval_world, tmp_path / "missing", modes=("rag",), retrieval="replay",
                    index=None, store=str(store), data=[str(extra)]))


def test_an_interrupted_run_resumes_where_it_stopped(eval_world, tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run(request(eval_world, whole, modes=("direct", "agent")))
    run(request(eval_world, cut, modes=("direct", "agent")))
    kept = (cut / "samples.jsonl").read_text().splitlines()[:-5]
    (cut / "samples.jsonl").write_text("\n".join(kept) + "\n" + '{"step": 1, "kind": "ev')
    counter: dict = {}
    run(request(eval_world, cut, modes=("direct", "agent"), counter=counter))
    assert counter["started"]["questions"] == 5  # only the missing ones were played
    assert (cut / "eval.json").read_bytes() == (whole / "eval.json").read_bytes()
    assert len(lines(cut)) == 24

    with pytest.raises(EvalError, match="another config .*max_turns"):
        run(request(eval_world, cut, modes=("direct", "agent"),
                    settings=replace(SETTINGS, max_turns=3)))
    with pytest.raises(EvalError, match="another config .*modes"):
        run(request(eval_world, cut, modes=("direct",)))


def test_inputs_are_checked_before_any_model_loads(eval_world, tmp_path):
    with pytest.raises(EvalError, match="no such file"):
        run(request(eval_world, tmp_path / "a", data=[str(tmp_path / "nope.jsonl")]))
    with pytest.raises(EvalError, match="pass --index DIR"):
        run(request(eval_world, tmp_path / "b", modes=("rag",), index=None))
    with pytest.raises(EvalError, match="no retrieval store"):
        run(request(eval_world, tmp_path / "c", modes=("agent",), index=None,
                    retrieval="replay"))
    with pytest.raises(EvalError, match="record keys results by the index"):
        run(request(eval_world, tmp_path / "d", modes=("agent",), index=None,
                    retriever_url="http://127.0.0.1:9/retrieve", retrieval="record"))
    bad = tmp_path / "countdown.jsonl"
    bad.write_text(json.dumps({"question": "2 3 = 5", "golden_answers": ["2+3"]}) + "\n")
    with pytest.raises(EvalError, match="scored by countdown"):
        run(request(eval_world, tmp_path / "e", data=[str(bad)], data_source="countdown"))
    assert not any((tmp_path / name).exists() for name in "abcde")


def test_a_retriever_that_stops_answering_is_a_play_error_and_nothing_is_written(eval_world,
                                                                                 tmp_path):
    from services.common.ports import free_port
    from services.eval.runner import PlayError

    dead = f"http://127.0.0.1:{free_port()}/retrieve"  # nothing listens there
    for mode in ("rag", "agent"):
        out = tmp_path / mode
        with pytest.raises(PlayError, match="running the same command again"):
            run(request(eval_world, out, modes=(mode,), index=None, retriever_url=dead,
                        limit=2, data=[str(eval_world["flashrag"])]))
        assert (out / "samples.jsonl").read_text() == ""


def test_several_models_make_one_table_with_paired_comparisons(eval_world, tmp_path):
    import shutil

    twin = shutil.copytree(eval_world["policy"], tmp_path / "twin_policy")
    doc = run(request(eval_world, tmp_path / "out", modes=("direct",), index=None,
                      models=[str(eval_world["policy"]), str(twin)], limit=3,
                      data=[str(eval_world["flashrag"])]))
    labels = [row["label"] for row in doc["rows"]]
    assert labels == ["tiny_policy · direct", "twin_policy · direct"]
    assert doc["rows"][0]["em"] == doc["rows"][1]["em"]  # the same weights, greedy
    (pair,) = doc["comparisons"]
    assert (pair["all"]["n"], pair["all"]["a_only"], pair["all"]["b_only"]) == (3, 0, 0)
    assert pair["all"]["p_value"] == 1.0
    table = (tmp_path / "out" / "eval.md").read_text()
    assert "| tiny_policy · direct | 0.333 | 0.333 |" in table
    assert "| twin_policy · direct | 0.333 | 0.333 |" in table


def test_sampling_is_an_option_and_seeded(eval_world, tmp_path):
    sampled = replace(SETTINGS, temperature=1.0, seed=3)
    for name in ("one", "two"):
        doc = run(request(eval_world, tmp_path / name, modes=("direct",), index=None, limit=3,
                          data=[str(eval_world["flashrag"])], settings=sampled))
    assert doc["config"]["settings"]["temperature"] == 1.0
    assert (tmp_path / "one" / "samples.jsonl").read_bytes() == \
        (tmp_path / "two" / "samples.jsonl").read_bytes()
    greedy = run(request(eval_world, tmp_path / "greedy", modes=("direct",), index=None,
                         limit=3, data=[str(eval_world["flashrag"])]))
    assert greedy["config"]["settings"]["temperature"] == 0.0
    assert (tmp_path / "greedy" / "samples.jsonl").read_bytes() != \
        (tmp_path / "one" / "samples.jsonl").read_bytes()
