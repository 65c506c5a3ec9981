"""Question files `forage eval` reads, in the layouts people already have.

- Search-R1's / verl's RL parquet (and Forage's own, `forage data synth`'s test.parquet): columns
  `data_source`, `prompt`, `reward_model.ground_truth`, usually `id`/`question` (Search-R1 keeps
  FlashRAG's columns) or `extra_info.question` (Forage). Read with the learner's checked loader.
- FlashRAG's JSON Lines (or parquet without a `prompt` column): `id`, `question`,
  `golden_answers`; the data source is what the path implies (`nq/test.jsonl` -> `nq`, as
  `forage data convert` does) unless `--data-source` names it.

Every question gets a stable id (`<data_source>/<id or row>`), which is what resume and the
paired comparisons match on. `forage eval` scores QA exact match only, so a data source the
scorer grades with another rule (math, countdown) is refused rather than scored wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from services.common.data_sources import BUILTIN_DATA_SOURCES
from services.common.formats import normalize_question, search_r1_prompt
from services.eval.errors import Support, support_of
from services.scorer.rewards.text import gold_answers
from services.tasks.datasets import DatasetError, iter_records, load_rows


@dataclass(frozen=True)
class Question:
    """One evaluation question: what every mode needs to ask it and score it."""

    qid: str
    data_source: str
    question: str
    ground_truth: Any
    agent_prompt: Any  # chat messages or text: the dataset's own Search-R1 prompt
    # What the row says about the question's hops (services/eval/errors.py), if anything.
    support: Support | None = None


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))


def _question_of(row: dict[str, Any], where: str) -> str:
    """The bare question: a `question` column, `extra_info.question`, else the text after the
    last `Question:` of the prompt (Search-R1's template ends with it)."""
    extra = row.get("extra_info") or {}
    for value in (row.get("question"), extra.get("question") if isinstance(extra, dict) else None):
        if isinstance(value, str) and value.strip():
            return normalize_question(value)
    text = _prompt_text(row.get("prompt"))
    if "Question:" in text and text.rsplit("Question:", 1)[1].strip():
        return normalize_question(text.rsplit("Question:", 1)[1])
    raise DatasetError(f"{where}: no question found (no 'question' column, no "
                       "'extra_info.question', no 'Question:' in the prompt)")


def _golds(truth: Any) -> list[str]:
    try:
        return gold_answers(truth)
    except ValueError:  # the scorer reports a bad ground truth; here it only means no golds
        return []


def _check_source(source: str, where: str) -> None:
    rule = BUILTIN_DATA_SOURCES.get(source)
    if rule is not None and rule != "qa_em":
        raise DatasetError(f"{where}: data_source {source!r} is scored by {rule}, not QA exact "
                           "match; forage eval evaluates QA datasets only")


def _rl_questions(path: Path) -> list[Question]:
    out = []
    for index, row in enumerate(load_rows(path, kind="rl")):
        where = f"{path} row {index}"
        source = str(row["data_source"])
        _check_source(source, where)
        ident = row.get("id")
        if ident is None:
            extra = row.get("extra_info") or {}
            ident = extra.get("index", index) if isinstance(extra, dict) else index
        question, truth = _question_of(row, where), row["reward_model"]["ground_truth"]
        out.append(Question(f"{source}/{ident}", source, question, truth, row["prompt"],
                            support_of(row, question, _golds(truth))))
    return out


def _flashrag_questions(path: Path, data_source: str | None) -> list[Question]:
    from services.tasks.convert import dataset_name

    source = data_source or dataset_name(path)[0]
    _check_source(source, str(path))
    out = []
    for index, (where, record) in enumerate(iter_records(path)):
        question, answers = record.get("question"), record.get("golden_answers")
        if not isinstance(question, str) or not question.strip():
            raise DatasetError(f"{path} {where}: missing 'question'")
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(answers, list) or not answers or not all(
                isinstance(a, str) for a in answers):
            raise DatasetError(f"{path} {where}: 'golden_answers' must be a list of strings")
        ident = record.get("id", index)
        out.append(Question(f"{source}/{ident}", source, normalize_question(question),
                            {"target": answers},
                            [{"role": "user", "content": search_r1_prompt(question)}],
                            support_of(record, question, answers)))
    return out


def _is_rl_parquet(path: Path) -> bool:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(str(path)).names
    except Exception as exc:  # pyarrow raises several types for a non-parquet file
        raise DatasetError(f"{path}: not a readable parquet file ({exc})") from None
    return "prompt" in names and "reward_model" in names


def load_questions(paths: list[str], data_source: str | None = None,
                   limit: int | None = None) -> list[Question]:
    """Questions of every file, in file order; `limit` keeps the first N of each data source.

    Raises DatasetError (missing file, unknown layout, a bad row, a non-QA data source)."""
    questions: list[Question] = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise DatasetError(f"{path}: no such file")
        if path.suffix.lower() == ".parquet" and _is_rl_parquet(path):
            if data_source:
                raise DatasetError(f"{path}: --data-source applies to FlashRAG files only; "
                                   "this parquet names its data_source per row")
            questions.extend(_rl_questions(path))
        else:
            questions.extend(_flashrag_questions(path, data_source))
    if not questions:
        raise DatasetError(f"{', '.join(paths)}: no questions")
    seen: dict[str, int] = {}
    kept: list[Question] = []
    for q in limit_per_source(questions, limit):
        count = seen.get(q.qid, 0)
        seen[q.qid] = count + 1
        if count:  # a repeated id (two files of one source): keep both, distinctly named
            q = replace(q, qid=f"{q.qid}#{count}")
        kept.append(q)
    return kept


def limit_per_source(questions: list[Question], limit: int | None) -> list[Question]:
    """The first `limit` questions of each data source, in order (all of them: None)."""
    if limit is None:
        return list(questions)
    per_source: dict[str, int] = {}
    kept = []
    for q in questions:
        if per_source.get(q.data_source, 0) < limit:
            per_source[q.data_source] = per_source.get(q.data_source, 0) + 1
            kept.append(q)
    return kept
