"""Search-R1's own parquet files load unchanged; `data convert` names the dataset (FlashRAG
layout) and reads parquet; `data check` and the learner reject a data_source without a reward
function, naming it and the known ones (process-level runs: exit code + one-line message)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from services.common.codec import decode_as, encode
from services.common.data_sources import (
    BUILTIN_DATA_SOURCES,
    SEARCH_R1_QA,
    UnknownDataSourceError,
    check_data_sources,
    known_data_sources,
)
from services.common.formats import search_r1_prompt
from services.common.trajectory import PromptGroup
from services.tasks.convert import dataset_name
from services.tasks.datasets import DatasetError, check_file_sources, data_sources_of, load_rows

FORAGE = [sys.executable, "-m", "services.cli"]

# The Arrow schema of Search-R1's published files (HF `datasets.to_parquet` of FlashRAG rows
# mapped by scripts/data_process/qa_search_{train,test}_merge.py): FlashRAG's own columns kept,
# Search-R1's added; nested values as structs and lists, the index as int64.
SEARCH_R1_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("question", pa.string()),
    ("golden_answers", pa.list_(pa.string())),
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([
        ("ground_truth", pa.struct([("target", pa.list_(pa.string()))])),
        ("style", pa.string()),
    ])),
    ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string())])),
], metadata={b"huggingface": b'{"info": {"features": {}}}'})


def search_r1_row(source: str, index: int, question: str, answers: list[str]) -> dict:
    return {
        "id": f"{source}_{index}", "question": question, "golden_answers": answers,
        "data_source": source,
        "prompt": [{"content": search_r1_prompt(question), "role": "user"}],
        "ability": "fact-reasoning",
        "reward_model": {"ground_truth": {"target": answers}, "style": "rule"},
        "extra_info": {"index": index, "split": "test"},
    }


def write_search_r1(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=SEARCH_R1_SCHEMA), path)
    return path


def forage(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*FORAGE, *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


def test_search_r1_published_parquet_loads_unchanged_through_the_learner(tmp_path):
    from services.learner.prompts import group_from_row, load_dataset

    rows = [search_r1_row(s, i, f"question {i} of {s}?", [f"answer {i}", "alias"])
            for i, s in enumerate(SEARCH_R1_QA)]
    path = write_search_r1(tmp_path / "test.parquet", rows)
    assert pq.read_schema(path).field("prompt").type == SEARCH_R1_SCHEMA.field("prompt").type
    loaded = load_dataset([str(path)])
    assert len(loaded) == len(SEARCH_R1_QA)
    for source_row, row in zip(rows, loaded, strict=True):
        group = group_from_row(row, "u1", 5)
        back = decode_as(encode(group), PromptGroup)  # what the rollout replicas receive
        assert back.data_source == source_row["data_source"]
        assert back.prompt == [{"role": "user", "content": source_row["prompt"][0]["content"]}]
        assert back.ground_truth == {"target": source_row["golden_answers"]}
        assert back.extra == source_row["extra_info"]
        assert back.n == 5
    assert check_file_sources([path]) == set(SEARCH_R1_QA)


def test_known_sources_are_the_scorers(tmp_path):
    from services.scorer.rewards import DEFAULT_DATA_SOURCES, RewardTable

    assert DEFAULT_DATA_SOURCES == BUILTIN_DATA_SOURCES  # one table, in services.common
    extra = {"mystery": [{"function": "qa_em"}]}
    assert known_data_sources(extra) == RewardTable(extra).known_sources()


def test_unknown_source_error_names_it_and_the_known_ones():
    with pytest.raises(UnknownDataSourceError) as info:
        check_data_sources(["nq", "mystery", "zzz"], where="f.parquet")
    message = str(info.value)
    assert message.startswith("f.parquet: no reward function for data_sources 'mystery', 'zzz'")
    assert "known: " in message and "hotpotqa" in message and "\n" not in message
    check_data_sources(["mystery"], {"mystery": [{"function": "qa_em"}]})


def test_dataset_name_follows_the_flashrag_layout(tmp_path):
    assert dataset_name(tmp_path / "nq" / "train.jsonl") == ("nq", "train")
    assert dataset_name(tmp_path / "hotpotqa" / "dev.parquet") == ("hotpotqa", "dev")
    assert dataset_name(tmp_path / "nq.jsonl") == ("nq", None)
    assert dataset_name(tmp_path / "triviaqa.test.jsonl") == ("triviaqa", None)


def test_data_sources_of_reads_one_column(tmp_path):
    path = write_search_r1(tmp_path / "x.parquet", [search_r1_row("nq", 0, "q?", ["a"]),
                                                    search_r1_row("nq", 1, "r?", ["b"])])
    assert data_sources_of(path) == {"nq"}
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "nosource.parquet")
    with pytest.raises(DatasetError, match="missing column 'data_source'"):
        data_sources_of(tmp_path / "nosource.parquet")


def test_cli_convert_derives_the_dataset_and_reads_parquet(tmp_path):
    nq = tmp_path / "nq"
    nq.mkdir()
    (nq / "train.jsonl").write_text(
        json.dumps({"id": "1", "question": "who wrote hamlet", "golden_answers": ["Shakespeare"]})
        + "\n")
    done = forage("data", "convert", "--format", "flashrag", "--input", str(nq / "train.jsonl"),
                  "--out", str(tmp_path / "nq_train.parquet"))
    assert done.returncode == 0, done.stderr
    assert "(data_source: nq)" in done.stdout and done.stderr == ""
    row = load_rows(tmp_path / "nq_train.parquet")[0]
    assert row["data_source"] == "nq" and row["extra_info"]["split"] == "train"
    # FlashRAG's files as parquet, named after the split: hotpotqa/dev.parquet.
    hotpot = tmp_path / "hotpotqa"
    hotpot.mkdir()
    pq.write_table(pa.Table.from_pylist([
        {"id": "h1", "question": "Which city? ", "golden_answers": ["Paris", "paris"]},
        {"id": "h2", "question": "Who?", "golden_answers": ["Ann"]}]), hotpot / "dev.parquet")
    done = forage("data", "convert", "--format", "flashrag", "--input",
                  str(hotpot / "dev.parquet"), "--out", str(tmp_path / "hp.parquet"))
    assert done.returncode == 0, done.stderr
    rows = load_rows(tmp_path / "hp.parquet")
    assert [r["data_source"] for r in rows] == ["hotpotqa", "hotpotqa"]
    assert rows[0]["extra_info"] == {"split": "dev", "index": 0}
    assert rows[0]["reward_model"]["ground_truth"] == {"target": ["Paris", "paris"]}
    assert rows[0]["question"] == "Which city?"
    # A bad parquet row is named by its row number.
    pq.write_table(pa.Table.from_pylist([{"question": "q", "golden_answers": ["a"]},
                                         {"question": "", "golden_answers": ["a"]}]),
                   tmp_path / "bad.parquet")
    done = forage("data", "convert", "--format", "flashrag", "--input",
                  str(tmp_path / "bad.parquet"), "--out", str(tmp_path / "o.parquet"))
    assert done.returncode == 2
    assert one_line(done.stderr).endswith("bad.parquet row 1: missing 'question'")
    # A dataset no reward function knows: written, with a one-line warning.
    odd = tmp_path / "mystery"
    odd.mkdir()
    (odd / "test.jsonl").write_text(json.dumps({"question": "q", "golden_answers": ["a"]}) + "\n")
    done = forage("data", "convert", "--format", "flashrag", "--input", str(odd / "test.jsonl"),
                  "--out", str(tmp_path / "m.parquet"))
    assert done.returncode == 0
    assert "no built-in reward function for data_source mystery" in one_line(done.stderr)


def test_cli_check_rejects_a_source_without_a_reward(tmp_path):
    rows = [search_r1_row("nq", 0, "q?", ["a"]), search_r1_row("mystery", 1, "r?", ["b"])]
    path = write_search_r1(tmp_path / "train.parquet", rows)
    done = forage("data", "check", str(path))
    assert done.returncode == 2
    line = one_line(done.stderr)
    assert f"forage data check: error: {path}: no reward function for data_source 'mystery'; known: " in line
    assert "'nq'" not in line and "hotpotqa" in line
    # A run that adds the source under scorer.rewards accepts it.
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"scorer": {"rewards": {"mystery": [{"function": "qa_em"}]}}}))
    done = forage("data", "check", str(path), "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert "2 valid rl rows; data sources: mystery, nq" in done.stdout


@pytest.mark.slow
def test_learner_rejects_a_source_without_a_reward_at_start(tmp_path, tiny_policy_dir):
    train = write_search_r1(tmp_path / "train.parquet", [search_r1_row("nq", 0, "q?", ["a"])])
    test = write_search_r1(tmp_path / "test.parquet", [search_r1_row("bamboogle", 0, "q?", ["a"]),
                                                       search_r1_row("webq", 1, "r?", ["b"])])
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"),
        "model": {"path": str(tiny_policy_dir)},
        "data": {"train_files": [str(train)], "test_files": [str(test)]},
    }))
    done = forage("learner", "train", "--config", str(config))
    assert done.returncode == 2
    line = one_line(done.stderr)
    assert f"{test}: no reward function for data_source 'webq'; known: " in line
    assert not (tmp_path / "run").exists()  # rejected before anything started
