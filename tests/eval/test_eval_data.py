"""Question files `forage eval` reads (services/eval/data.py): Search-R1's parquet, FlashRAG's
JSON Lines and parquet, Forage's own rows; ids, limits and refusals."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.common.formats import search_r1_prompt
from services.eval.data import load_questions
from services.tasks.datasets import DatasetError, write_rows

from .conftest import write_flashrag, write_search_r1


def test_flashrag_jsonl_takes_its_source_from_the_folder(tmp_path):
    questions = load_questions([str(write_flashrag(tmp_path / "nq" / "test.jsonl"))])
    first = questions[0]
    assert (first.qid, first.data_source, first.question) == ("nq/test_0",
                                                               "nq", "where was Brixol born?")
    assert first.ground_truth == {"target": ["Corvale"]}
    assert first.agent_prompt[0]["content"] == search_r1_prompt("where was Brixol born")


def test_search_r1_parquet_keeps_its_prompt_and_ids(tmp_path):
    questions = load_questions([str(write_search_r1(tmp_path / "x.parquet"))], limit=2)
    assert [q.qid for q in questions] == ["hotpotqa/dev_0", "hotpotqa/dev_1"]
    assert questions[0].question == "Which city was Brixol born in?"


def test_flashrag_parquet_and_forage_rows_without_a_question_column(tmp_path):
    flash = tmp_path / "triviaqa" / "dev.parquet"
    flash.parent.mkdir()
    pq.write_table(pa.Table.from_pylist([{"id": "a", "question": "Who?",
                                          "golden_answers": ["Me"]}]), flash)
    forage_rows = write_rows(tmp_path / "test.parquet", [{
        "data_source": "synth_single",
        "prompt": [{"role": "user", "content": search_r1_prompt("Where is Ashby")}],
        "reward_model": {"style": "rule", "ground_truth": {"target": ["North"]}},
        "extra_info": {"index": 7}}] * 2)
    questions = load_questions([str(flash), str(forage_rows)])
    assert [(q.qid, q.question) for q in questions] == [
        ("triviaqa/a", "Who?"), ("synth_single/7", "Where is Ashby?"),
        ("synth_single/7#1", "Where is Ashby?")]  # no id: extra_info.index; a repeat renamed


def test_bad_files_are_named(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_questions([str(tmp_path / "missing.jsonl")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "Who?", "golden_answers": 3}) + "\n")
    with pytest.raises(DatasetError, match="line 1: 'golden_answers' must be a list"):
        load_questions([str(bad)])
    with pytest.raises(DatasetError, match="scored by gsm8k"):
        load_questions([str(write_flashrag(tmp_path / "gsm8k" / "test.jsonl"))])
