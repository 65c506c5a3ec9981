"""`forage data convert`: users' own data in the formats the learner reads.

- FlashRAG (`question`, `golden_answers`) -> Search-R1 parquet, as Search-R1's
  `nq_search.py` does it (question stripped, `?` added, the instruction template, answers as
  `ground_truth.target`), keeping FlashRAG's own `id` when there is one.
- GSM8K (`question`, `answer` ending in `#### n`) -> verl parquet, as verl's
  `gsm8k.py` preprocessor does it (instruction appended, ground truth = n without commas).

Input is JSON Lines or parquet (by the `.parquet` suffix). The `data_source` column names the
dataset, which is what picks the reward function: FlashRAG's layout is `<dataset>/<split>.jsonl`
(`nq/train.jsonl`), so a file named after a split takes its data source from its folder and its
split from its name; any other file takes the data source from its stem (`nq_train.jsonl` ->
`nq_train`, so name it with `--data-source`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from services.common.formats import normalize_question, search_r1_prompt
from services.tasks.datasets import DatasetError, iter_records, write_rows

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
# File names that are a split, not a dataset (FlashRAG: nq/train.jsonl, nq/dev.jsonl, ...).
SPLIT_NAMES = frozenset({"train", "dev", "test", "val", "valid", "validation"})


def dataset_name(path: str | os.PathLike[str]) -> tuple[str, str | None]:
    """(data_source, split or None) implied by a file's path: `nq/train.jsonl` -> ("nq",
    "train"), `nq_train.jsonl` -> ("nq_train", None)."""
    source = Path(path)
    stem = source.name.split(".")[0]
    if stem.lower() in SPLIT_NAMES and source.resolve().parent.name:
        return source.resolve().parent.name, stem
    return stem, None


def flashrag_to_rows(path: str | os.PathLike[str], data_source: str,
                     split: str = "train") -> list[dict[str, Any]]:
    rows = []
    for where, record in iter_records(path):
        question = record.get("question")
        answers = record.get("golden_answers")
        if not isinstance(question, str) or not question.strip():
            raise DatasetError(f"{path} {where}: missing 'question'")
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(answers, list) or not answers or not all(
            isinstance(a, str) for a in answers
        ):
            raise DatasetError(f"{path} {where}: 'golden_answers' must be a list of strings")
        index = len(rows)
        rows.append({
            "id": str(record.get("id", index)),
            "question": normalize_question(question),
            "golden_answers": answers,
            "data_source": data_source,
            "prompt": [{"role": "user", "content": search_r1_prompt(question)}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
            "extra_info": {"split": split, "index": index},
        })
    return rows


def gsm8k_answer(text: str) -> str:
    """The number after `####`, commas removed (verl's extract_solution)."""
    match = _GSM8K_ANSWER.search(text)
    if match is None:
        raise ValueError("no '#### <number>' in the answer")
    return match.group(1).replace(",", "")


def gsm8k_to_rows(path: str | os.PathLike[str], data_source: str = "openai/gsm8k",
                  split: str = "train") -> list[dict[str, Any]]:
    rows = []
    for where, record in iter_records(path):
        question, answer = record.get("question"), record.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str):
            raise DatasetError(f"{path} {where}: needs string 'question' and 'answer'")
        try:
            solution = gsm8k_answer(answer)
        except ValueError as exc:
            raise DatasetError(f"{path} {where}: {exc}") from None
        index = len(rows)
        rows.append({
            "data_source": data_source,
            "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": index, "answer": answer,
                           "question": question},
        })
    return rows


def convert(kind: str, src: str | os.PathLike[str], out: str | os.PathLike[str],
            data_source: str | None = None, split: str | None = None) -> Path:
    """Convert `src` (JSON Lines or parquet) to `out`; data_source and split default to what the
    path implies (see `dataset_name`), GSM8K's data_source to verl's `openai/gsm8k`."""
    implied_source, implied_split = dataset_name(src)
    split = split or implied_split or "train"
    if kind == "flashrag":
        rows = flashrag_to_rows(src, data_source or implied_source, split)
    elif kind == "gsm8k":
        rows = gsm8k_to_rows(src, data_source or "openai/gsm8k", split)
    else:
        raise ValueError(f"unknown input format {kind!r}; choose flashrag or gsm8k")
    if not rows:
        raise DatasetError(f"{src}: no rows")
    return write_rows(out, rows)
