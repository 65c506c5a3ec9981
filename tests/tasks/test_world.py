"""The synthetic world: answerable, split cleanly, deterministic, sized for a tiny model."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from services.common.formats import SEARCH_R1_TEMPLATE, search_r1_prompt
from services.tasks.datasets import load_rows, write_rows
from services.tasks.world import build_world, question_row, split_rows


@pytest.fixture(scope="module")
def world():
    return build_world(seed=3, size="small")


def _contents(world, doc_id: str) -> str:
    return next(d["contents"] for d in world.corpus if d["id"] == doc_id)


def test_every_answer_is_stated_in_its_last_gold_passage(world) -> None:
    for q in world.questions:
        gold = q["gold_doc_ids"]
        assert len(gold) == q["hops"]
        assert re.search(rf"\b{re.escape(q['answer'])}\b", _contents(world, gold[-1])), q
        # the question's own entity has a passage titled with its name
        assert _contents(world, gold[0]).startswith(f'"{q["subject"]}"\n')


def test_two_hop_questions_need_the_bridge_passage(world) -> None:
    multi = [q for q in world.questions if q["hops"] == 2]
    assert len(multi) > 50
    for q in multi:
        first, second = (_contents(world, d) for d in q["gold_doc_ids"])
        assert q["bridge"] in first  # the first passage names the bridge ...
        assert second.startswith(f'"{q["bridge"]}"\n')  # ... whose passage states the answer
        assert not re.search(rf"\b{re.escape(q['answer'])}\b", first.split("\n", 1)[1]), q


def test_no_test_entity_in_train_questions(world) -> None:
    test_names = {n for n, e in world.entities.items() if e.split == "test"}
    assert len(test_names) > 30
    for q in world.questions:
        if q["split"] != "train":
            continue
        for name in test_names:
            assert not re.search(rf"\b{re.escape(name)}\b", q["question"]), (name, q)
        if q["bridge"]:
            assert world.entities[q["bridge"]].split in ("train", "shared")
    # and the other way: test questions are about test entities
    for q in world.questions:
        if q["split"] == "test":
            assert world.entities[q["subject"]].split == "test"


def test_sizes_and_mix(world) -> None:
    counts = Counter((q["split"], q["hops"]) for q in world.questions)
    assert counts[("train", 1)] > 300 and counts[("train", 2)] > 150
    assert counts[("test", 1)] > 50 and counts[("test", 2)] > 20
    assert 250 < len(world.corpus) < 500
    ids = [d["id"] for d in world.corpus]
    assert len(set(ids)) == len(ids)
    # passages are short (a tiny model reads one or two)
    assert max(len(d["contents"]) for d in world.corpus) < 200


def test_distractors_mention_people_without_their_birthplace(world) -> None:
    distractors = [(i, f) for i, f in world.doc_facts.items() if "mentions_city" in f]
    assert len(distractors) >= 50
    people = {n: e for n, e in world.entities.items() if e.kind == "person"}
    mentioned = 0
    for doc_id, facts in distractors:
        text = _contents(world, doc_id)
        for name, person in people.items():
            if name in text:
                mentioned += 1
                if facts["mentions_city"] == person.facts["born_in"]:
                    # the other person may share it by chance; the first-named never does
                    assert not text.split("\n", 1)[1].startswith(name)
    assert mentioned >= len(distractors)


def test_easy_answers_and_names_are_from_the_closed_vocabulary(world) -> None:
    vocab = set(world.whole_words)
    for q in world.questions:
        assert q["answer"] in vocab
        for part in q["subject"].split(" "):
            assert part in vocab
    # every answer value used in test also appears as a train answer (copyable, not new)
    train_answers = {q["answer"] for q in world.questions if q["split"] == "train"}
    test_answers = {q["answer"] for q in world.questions if q["split"] == "test"}
    assert len(test_answers - train_answers) <= 2
    # every name part of a test person appears in training questions
    train_text = " ".join(q["question"] for q in world.questions if q["split"] == "train")
    for name, entity in world.entities.items():
        if entity.kind == "person" and entity.split == "test":
            for part in name.split(" "):
                assert part in train_text


def test_deterministic_per_seed() -> None:
    a, b = build_world(seed=5), build_world(seed=5)
    assert a.corpus == b.corpus and a.questions == b.questions
    c = build_world(seed=6)
    assert c.corpus != a.corpus


def test_hard_preset_has_long_names_and_top3() -> None:
    hard = build_world(seed=0, hard=True)
    assert hard.recommended_topk == 3 and hard.whole_words == []
    people = [n for n, e in hard.entities.items() if e.kind == "person"]
    assert sum(len(n) for n in people) / len(people) > 14
    with pytest.raises(ValueError, match="unknown world size"):
        build_world(size="huge")


def test_rows_are_search_r1_format_and_readable(world, tmp_path: Path) -> None:
    rows = split_rows(world, "train")
    path = write_rows(tmp_path / "train.parquet", rows)
    table = pq.read_table(path)
    for column in ("data_source", "prompt", "ability", "reward_model", "extra_info"):
        assert column in table.column_names
    loaded = load_rows(path)
    assert len(loaded) == len(rows)
    row = loaded[0]
    question = row["extra_info"]["question"]
    assert row["prompt"] == [{"role": "user", "content": search_r1_prompt(question)}]
    assert row["prompt"][0]["content"].startswith(SEARCH_R1_TEMPLATE.split("{")[0])
    assert row["prompt"][0]["content"].endswith(f"Question: {question}\n")
    assert row["data_source"] in ("synth_single", "synth_multihop")
    assert row["reward_model"]["style"] == "rule"
    assert isinstance(row["reward_model"]["ground_truth"]["target"], list)
    assert row["extra_info"]["split"] == "train"
    assert [r["extra_info"]["index"] for r in loaded] == list(range(len(rows)))
    assert question_row(world.questions[0], 7)["extra_info"]["index"] == 7
