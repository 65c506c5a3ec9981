"""Countdown and math generators, FlashRAG / GSM8K conversion, and the row loader's errors."""

from __future__ import annotations

import ast
import json
import operator
import subprocess
import sys
from fractions import Fraction
from itertools import combinations
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.common.formats import search_r1_prompt
from services.tasks.convert import convert, gsm8k_answer
from services.tasks.countdown import COUNTDOWN_TEMPLATE, countdown_rows
from services.tasks.datasets import DatasetError, load_rows, write_rows
from services.tasks.math_word import math_rows

FORAGE = [sys.executable, "-m", "services.cli"]


def _reachable(values: tuple[Fraction, ...]) -> set[Fraction]:
    """Every value of an expression using each number exactly once (+ - * /)."""
    if len(values) == 1:
        return {values[0]}
    out: set[Fraction] = set()
    for i, j in combinations(range(len(values)), 2):
        a, b = values[i], values[j]
        rest = tuple(v for k, v in enumerate(values) if k not in (i, j))
        candidates = {a + b, a - b, b - a, a * b}
        if b != 0:
            candidates.add(a / b)
        if a != 0:
            candidates.add(b / a)
        for c in candidates:
            out |= _reachable(rest + (c,))
    return out


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv}


def _evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """Exact value and the numbers used, by walking the AST (never eval)."""
    numbers: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            numbers.append(node.value)
            return Fraction(node.value)
        raise ValueError(ast.dump(node))

    return walk(ast.parse(expr, mode="eval").body), numbers


def test_countdown_problems_are_solvable_and_in_range() -> None:
    rows = countdown_rows(60, seed=1)
    sizes = set()
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        numbers, target = truth["numbers"], truth["target"]
        sizes.add(len(numbers))
        assert 3 <= len(numbers) <= 4 and all(1 <= n <= 99 for n in numbers)
        assert 10 <= target <= 100
        assert Fraction(target) in _reachable(tuple(Fraction(n) for n in numbers))
        value, used = _evaluate(row["extra_info"]["solution"])
        assert value == target and sorted(used) == sorted(numbers)
        assert row["data_source"] == "countdown"
        assert row["prompt"][0]["content"] == COUNTDOWN_TEMPLATE.format(
            numbers=numbers, target=target
        )
        assert row["prompt"][0]["content"].endswith("Let me solve this step by step.\n<think>")
    assert sizes == {3, 4}
    assert countdown_rows(5, seed=1) == rows[:5]  # deterministic


def test_math_problems_have_integer_answers_that_the_solution_reaches() -> None:
    rows = math_rows(80, seed=2)
    for row in rows:
        answer = row["reward_model"]["ground_truth"]
        assert isinstance(answer, str) and int(answer) >= 0
        solution = row["extra_info"]["solution"]
        assert solution.endswith(f"\\boxed{{{answer}}}")
        # every arithmetic step in the worked solution is right
        for a, op, b, result in _steps(solution):
            assert {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op] == result
        assert row["prompt"][0]["content"].endswith("within \\boxed{}.")
        assert row["data_source"] == "synth_math"
    assert len({r["prompt"][0]["content"] for r in rows}) > 70
    assert math_rows(3, seed=2) == rows[:3]


def _steps(text: str):
    import re

    for m in re.finditer(r"(\d+) ([-+*/]) (\d+)(?: ([-+*/]) (\d+))? = (\d+)", text):
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        if m.group(4):  # a * b + c
            first = {"+": a + b, "-": a - b, "*": a * b}[op]
            yield first, m.group(4), int(m.group(5)), int(m.group(6))
        else:
            yield a, op, b, int(m.group(6))


def test_flashrag_conversion(tmp_path: Path) -> None:
    src = tmp_path / "nq.jsonl"
    src.write_text(
        json.dumps({"id": "q1", "question": " who wrote hamlet ", "golden_answers": ["Shakespeare",
                                                                               "W. Shakespeare"]})
        + "\n\n"
        + json.dumps({"id": "q2", "question": "capital of france?", "golden_answers": ["Paris"]})
        + "\n"
    )
    out = convert("flashrag", src, tmp_path / "nq.parquet")
    rows = load_rows(out)
    assert [r["question"] for r in rows] == ["who wrote hamlet?", "capital of france?"]
    assert rows[0]["data_source"] == "nq"
    assert rows[0]["prompt"] == [{"role": "user", "content": search_r1_prompt("who wrote hamlet")}]
    assert rows[0]["prompt"][0]["content"].endswith("Question: who wrote hamlet?\n")
    assert rows[0]["reward_model"] == {
        "style": "rule", "ground_truth": {"target": ["Shakespeare", "W. Shakespeare"]}
    }
    assert rows[1]["extra_info"] == {"split": "train", "index": 1}
    assert rows[0]["id"] == "q1" and rows[0]["ability"] == "fact-reasoning"

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x", "golden_answers": []}) + "\n")
    with pytest.raises(DatasetError, match="line 1: 'golden_answers'"):
        convert("flashrag", bad, tmp_path / "bad.parquet")


def test_gsm8k_conversion(tmp_path: Path) -> None:
    src = tmp_path / "gsm8k.jsonl"
    src.write_text(
        json.dumps({"question": "Tom has 3 apples and buys 1,200 more. How many?",
                    "answer": "3 + 1200 = <<3+1200=1203>>1203\n#### 1,203"}) + "\n"
    )
    rows = load_rows(convert("gsm8k", src, tmp_path / "gsm8k.parquet", split="test"))
    assert rows[0]["reward_model"] == {"style": "rule", "ground_truth": "1203"}
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[0]["ability"] == "math"
    assert rows[0]["prompt"][0]["content"].endswith(
        'Let\'s think step by step and output the final answer after "####".'
    )
    assert rows[0]["extra_info"]["split"] == "test"
    assert gsm8k_answer("so #### -7") == "-7"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(DatasetError, match="line 1: no '#### <number>'"):
        convert("gsm8k", bad, tmp_path / "bad.parquet")


def _table(tmp_path: Path, rows: list[dict], name: str = "x.parquet") -> Path:
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


GOOD = {
    "data_source": "nq",
    "prompt": [{"role": "user", "content": "q?"}],
    "reward_model": {"style": "rule", "ground_truth": {"target": ["a"]}},
}


def test_loader_names_missing_column_and_bad_row(tmp_path: Path) -> None:
    no_prompt = {k: v for k, v in GOOD.items() if k != "prompt"}
    with pytest.raises(DatasetError, match=r"missing column\(s\) 'prompt' \(has: "):
        load_rows(_table(tmp_path, [no_prompt]))
    bad_row = dict(GOOD, reward_model={"style": "rule", "ground_truth": None})
    path = _table(tmp_path, [GOOD, GOOD, bad_row], "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad.parquet row 2: .*ground_truth"):
        load_rows(path)
    empty_source = dict(GOOD, data_source="")
    with pytest.raises(DatasetError, match="row 0: column 'data_source'"):
        load_rows(_table(tmp_path, [empty_source], "e.parquet"))
    with pytest.raises(DatasetError, match="no such file"):
        load_rows(tmp_path / "missing.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match="not a readable parquet"):
        load_rows(tmp_path / "junk.parquet")
    # plain-text prompts and JSON-encoded nested columns are accepted
    text_row = dict(GOOD, prompt="plain text", reward_model=json.dumps(GOOD["reward_model"]))
    rows = load_rows(_table(tmp_path, [text_row], "t.parquet"))
    assert rows[0]["reward_model"]["ground_truth"] == {"target": ["a"]}


def test_loader_sft_kind(tmp_path: Path) -> None:
    row = {"prompt": [{"role": "user", "content": "q"}],
           "segments": [{"text": "<answer> a </answer>", "trainable": True}]}
    assert load_rows(write_rows(tmp_path / "s.parquet", [row]), kind="sft")[0] == row
    no_train = dict(row, segments=[{"text": "obs", "trainable": False}])
    with pytest.raises(DatasetError, match="row 0: column 'segments' has no trainable"):
        load_rows(write_rows(tmp_path / "n.parquet", [no_train]), kind="sft")
    with pytest.raises(DatasetError, match="missing column"):
        load_rows(write_rows(tmp_path / "r.parquet", [GOOD]), kind="sft")


def test_cli_generators_convert_and_check(tmp_path: Path) -> None:
    def forage(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*FORAGE, *args], capture_output=True, text=True, timeout=120)

    done = forage("data", "countdown", "--out", str(tmp_path / "cd.parquet"), "--count", "20")
    assert done.returncode == 0, done.stderr
    done = forage("data", "math", "--out", str(tmp_path / "m.parquet"), "--count", "20")
    assert done.returncode == 0, done.stderr
    done = forage("data", "check", str(tmp_path / "cd.parquet"))
    assert done.returncode == 0 and "20 valid rl rows; data sources: countdown" in done.stdout
    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "#### 4"}) + "\n")
    done = forage("data", "convert", "--format", "gsm8k", "--input", str(src),
                  "--out", str(tmp_path / "g.parquet"))
    assert done.returncode == 0, done.stderr
    _table(tmp_path, [{"data_source": "nq", "prompt": "x"}], "broken.parquet")
    done = forage("data", "check", str(tmp_path / "broken.parquet"))
    assert done.returncode == 2 and "missing column(s) 'reward_model'" in done.stderr
