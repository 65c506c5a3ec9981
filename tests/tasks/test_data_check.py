"""`forage data check` reports every problem of a file in one pass (bad rows, empty targets,
unknown data sources), and `forage score` rejects a malformed --ground-truth."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.common.formats import search_r1_prompt
from services.tasks.data_check import check_dataset, empty_target

FORAGE = [sys.executable, "-m", "services.cli"]


def forage(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FORAGE, *args], capture_output=True, text=True, timeout=120)


def row(source: str, question: str, target) -> dict:
    return {"data_source": source, "prompt": json.dumps([{"role": "user",
                                                          "content": search_r1_prompt(question)}]),
            "reward_model": json.dumps({"style": "rule", "ground_truth": {"target": target}})}


def write(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture()
def messy(tmp_path: Path) -> Path:
    rows = [row("nq", "good?", ["a"]) for _ in range(12)]
    rows[1]["prompt"] = ""                                   # bad row
    rows[4]["prompt"] = ""                                   # bad row, same problem
    rows[6]["reward_model"] = json.dumps({"style": "rule"})  # bad row, another problem
    rows[2] = row("nq", "empty?", [])                        # empty targets
    rows[3] = row("nq", "blank?", ["  "])
    rows[7] = row("mystery", "m?", ["x"])                    # unknown data sources
    rows[9] = row("mystery", "m?", ["y"])
    rows[10] = row("webq", "w?", ["z"])
    return write(tmp_path / "messy.parquet", rows)


def test_every_bad_row_is_reported(messy: Path) -> None:
    report = check_dataset(messy)
    assert report.rows == 12 and report.bad_rows == 8
    assert report.problems == {
        "column 'prompt' is empty": [1, 4],
        "empty target in reward_model.ground_truth: no answer can match it (reward always 0)":
            [2, 3],
        "column 'reward_model' must be a map with a 'ground_truth' key": [6],
    }
    assert report.unknown_sources == {"mystery": [7, 9], "webq": [10]}


def test_cli_lists_every_problem_and_exits_2(messy: Path) -> None:
    """Failed before: the check stopped at row 1 ('column prompt is empty') and said nothing of
    the other seven bad rows, the empty targets or the unknown sources."""
    done = forage("data", "check", str(messy))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[0] == f"forage data check: error: {messy}: 5 of 12 rl rows are bad"
    assert "  2 rows 1, 4: column 'prompt' is empty" in lines
    assert "  2 rows 2, 3: empty target in reward_model.ground_truth: no answer can match it " \
           "(reward always 0)" in lines
    assert "  row 6: column 'reward_model' must be a map with a 'ground_truth' key" in lines
    last = lines[-1]
    assert last.startswith(f"forage data check: error: {messy}: no reward function for data_sources 'mystery', "
                           "'webq'; known: ")
    assert last.endswith("; 'mystery': 2 rows 7, 9; 'webq': row 10")
    short = forage("data", "check", str(messy), "--max-rows", "1")
    assert "  2 rows 1, ... (1 more): column 'prompt' is empty" in short.stderr


def test_unknown_sources_alone_stay_one_line(tmp_path: Path) -> None:
    path = write(tmp_path / "t.parquet", [row("nq", "q?", ["a"]), row("mystery", "m?", ["b"])])
    done = forage("data", "check", str(path))
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_clean_file_passes(tmp_path: Path) -> None:
    path = write(tmp_path / "ok.parquet", [row("nq", "q?", ["a"]), row("hotpotqa", "h?", ["b"])])
    done = forage("data", "check", str(path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{path}: 2 valid rl rows; data sources: hotpotqa, nq"


@pytest.mark.parametrize(("truth", "empty"), [
    ({"target": []}, True), ({"target": [""]}, True), ({"target": ["", " "]}, True),
    ({"target": None}, True), ({"target": ""}, True), ("", True), ("  ", True), ([], True),
    ({"target": ["a", ""]}, False), ({"target": 9, "numbers": [1, 2]}, False),
    ({"target": 0}, False), ("0.5", False), ({"answer": ""}, False), (3, False),
])
def test_empty_target_rule(truth, empty: bool) -> None:
    assert empty_target(truth) is empty


@pytest.mark.parametrize(("ground_truth", "message"), [
    ('{"target": ["paris"]', "starts with '{' but is not valid JSON"),
    ("['paris']", "starts with '[' but is not valid JSON"),
    ('"paris', "starts with '\"' but is not valid JSON"),
    ("", "--ground-truth is empty"),
    ("null", "a ground truth cannot be null"),
])
def test_score_rejects_a_malformed_ground_truth(ground_truth: str, message: str) -> None:
    """Failed before: each was scored as the plain string (0.0, exit 0), hiding the slip."""
    done = forage("score", "--data-source", "nq", "--solution", "<answer> Paris </answer>",
                  "--ground-truth", ground_truth)
    assert done.returncode == 2, done.stdout
    assert done.stdout == ""
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("source", "solution", "ground_truth", "score"), [
    ("nq", "<answer> Paris </answer>", '{"target": ["paris"]}', 1.0),   # JSON
    ("synth_math", "\\boxed{0.5}", "1/2", 1.0),                        # plain string
    ("synth_math", "\\boxed{0.5}", '"1/2"', 1.0),                      # a JSON string
    ("gsm8k", "#### 12", "12", 1.0),                                    # a JSON number
])
def test_score_reads_json_else_a_plain_string(source, solution, ground_truth, score) -> None:
    done = forage("score", "--data-source", source, "--solution", solution,
                  "--ground-truth", ground_truth)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["score"] == score
