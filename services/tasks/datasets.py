"""Reading and writing the parquet row formats the learner consumes (Search-R1 / verl).

A verl / Search-R1 RL row: `data_source` (str), `prompt` (chat messages
[{"role", "content"}, ...] or a plain string), `reward_model` ({"style", "ground_truth"}),
and usually `ability` and `extra_info` ({"split", "index", ...}). An SFT row has `prompt` and
`segments` ([{"text", "trainable"}, ...]). `load_rows` checks every row and names the file, the
row and the column that is wrong, so a user's own dataset fails at load time with a message
instead of deep inside a training step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

RL_COLUMNS = ("data_source", "prompt", "reward_model")
SFT_COLUMNS = ("prompt", "segments")


class DatasetError(ValueError):
    """A dataset file that the learner cannot use; the message names file, row and column."""


def write_rows(path: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write rows as parquet (atomically: a reader never sees half a file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not rows:
        raise DatasetError(f"{out}: refusing to write an empty dataset")
    table = pa.Table.from_pylist([dict(r) for r in rows])
    tmp = out.with_name(f".{out.name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, out)
    return out


def load_rows(path: str | os.PathLike[str], kind: str = "rl",
              limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of a Search-R1 / verl parquet (kind="rl") or an SFT parquet (kind="sft"), checked.

    Raises DatasetError naming the missing column or the first bad row.
    """
    source = Path(path)
    table = read_table(source, kind)
    if limit is not None:
        table = table.slice(0, limit)
    rows = table.to_pylist()
    check = _check_rl_row if kind == "rl" else _check_sft_row
    for index, row in enumerate(rows):
        problem = check(row)
        if problem:
            raise DatasetError(f"{source} row {index}: {problem}")
    return rows


def read_table(path: str | os.PathLike[str], kind: str = "rl") -> Any:
    """The parquet table of an RL (kind="rl") or SFT (kind="sft") dataset, with the columns that
    kind needs; DatasetError for a missing or unreadable file or a missing column. Shared by the
    loader (first bad row) and `forage data check` (every bad row)."""
    import pyarrow.parquet as pq

    if kind not in ("rl", "sft"):
        raise ValueError(f"kind must be 'rl' or 'sft', got {kind!r}")
    source = Path(path)
    if not source.is_file():
        raise DatasetError(f"{source}: no such file")
    try:
        table = pq.read_table(str(source))
    except Exception as exc:  # pyarrow raises several types for a non-parquet file
        raise DatasetError(f"{source}: not a readable parquet file ({exc})") from None
    required = RL_COLUMNS if kind == "rl" else SFT_COLUMNS
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise DatasetError(
            f"{source}: missing column(s) {', '.join(repr(c) for c in missing)} "
            f"(has: {', '.join(table.column_names)}); a {kind} dataset needs "
            f"{', '.join(required)}"
        )
    return table


def _decode(value: Any) -> Any:
    """Some writers store nested columns as JSON text; accept that too."""
    if isinstance(value, str):
        stripped = value.strip()
        if stripped[:1] in ("[", "{"):
            try:
                return json.loads(stripped)
            except ValueError:
                return value
    return value


def _check_prompt(row: dict[str, Any]) -> str | None:
    prompt = row["prompt"] = _decode(row.get("prompt"))
    if isinstance(prompt, str):
        return None if prompt else "column 'prompt' is empty"
    if not isinstance(prompt, list) or not prompt:
        return f"column 'prompt' must be chat messages or text, got {type(prompt).__name__}"
    for position, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or (
            not isinstance(message.get("content"), str)
        ):
            return f"column 'prompt' message {position} needs string 'role' and 'content'"
    return None


def _check_rl_row(row: dict[str, Any]) -> str | None:
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        return f"column 'data_source' must be a non-empty string, got {source!r}"
    problem = _check_prompt(row)
    if problem:
        return problem
    reward = row["reward_model"] = _decode(row.get("reward_model"))
    if not isinstance(reward, dict) or "ground_truth" not in reward:
        return "column 'reward_model' must be a map with a 'ground_truth' key"
    if reward["ground_truth"] is None:
        return "column 'reward_model.ground_truth' is null"
    extra = row.get("extra_info")
    if extra is not None:
        extra = row["extra_info"] = _decode(extra)
        if not isinstance(extra, dict):
            return "column 'extra_info' must be a map"
    return None


def _check_sft_row(row: dict[str, Any]) -> str | None:
    problem = _check_prompt(row)
    if problem:
        return problem
    segments = row["segments"] = _decode(row.get("segments"))
    if not isinstance(segments, list) or not segments:
        return "column 'segments' must be a non-empty list of {text, trainable}"
    for position, segment in enumerate(segments):
        if not isinstance(segment, dict) or not isinstance(segment.get("text"), str):
            return f"column 'segments' item {position} needs a string 'text'"
        if not isinstance(segment.get("trainable"), bool):
            return f"column 'segments' item {position} needs a boolean 'trainable'"
    if not any(s["trainable"] for s in segments):
        return "column 'segments' has no trainable segment"
    return None


def ground_truth(row: Mapping[str, Any]) -> Any:
    """The row's ground truth, as the scorer takes it."""
    return row["reward_model"]["ground_truth"]


def iter_jsonl(path: str | os.PathLike[str]) -> Iterable[tuple[int, dict[str, Any]]]:
    """(line number, object) per non-empty line; a bad line raises with its number."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as exc:
                raise DatasetError(f"{path} line {number}: not JSON ({exc})") from None
            if not isinstance(value, dict):
                raise DatasetError(f"{path} line {number}: expected a JSON object")
            yield number, value


def iter_records(path: str | os.PathLike[str]) -> Iterable[tuple[str, dict[str, Any]]]:
    """("line N" / "row N", record) from JSON Lines, or from parquet when the name ends in
    `.parquet` (FlashRAG and GSM8K are published in both)."""
    source = Path(path)
    if not source.is_file():
        raise DatasetError(f"{source}: no such file")
    if source.suffix.lower() != ".parquet":
        for number, record in iter_jsonl(source):
            yield f"line {number}", record
        return
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(str(source))
    except Exception as exc:  # pyarrow raises several types for a non-parquet file
        raise DatasetError(f"{source}: not a readable parquet file ({exc})") from None
    index = 0
    for batch in parquet.iter_batches(batch_size=4096):
        for record in batch.to_pylist():
            yield f"row {index}", record
            index += 1


def data_sources_of(path: str | os.PathLike[str]) -> set[str]:
    """The distinct `data_source` values of an RL parquet, reading only that column."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    source = Path(path)
    if not source.is_file():
        raise DatasetError(f"{source}: no such file")
    try:
        table = pq.read_table(str(source), columns=["data_source"])
    except KeyError:
        raise DatasetError(f"{source}: missing column 'data_source'") from None
    except Exception as exc:  # not parquet, or no such column (pyarrow's several error types)
        if "data_source" in str(exc):
            raise DatasetError(f"{source}: missing column 'data_source'") from None
        raise DatasetError(f"{source}: not a readable parquet file ({exc})") from None
    return {str(v) for v in pc.unique(table.column("data_source")).to_pylist() if v is not None}


def check_file_sources(
    paths: Iterable[str | os.PathLike[str]], rewards: Mapping[str, Any] | None = None
) -> set[str]:
    """The data sources of RL parquet files, checked before anything runs: each must have a
    reward function (built in, or added by the run's `scorer.rewards`). Raises
    UnknownDataSourceError (a ValueError) naming the file, the unknown sources and the known
    ones; the scorer would otherwise dead-letter every such trajectory."""
    from services.common.data_sources import check_data_sources

    found: set[str] = set()
    for path in paths:
        sources = data_sources_of(path)
        check_data_sources(sources, rewards, where=str(path))
        found |= sources
    return found
