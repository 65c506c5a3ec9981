"""Corpus input: JSON Lines or Parquet read one row at a time, normalised to Search-R1's rows.

A corpus can be wiki-18 sized (21M passages, ~14 GB), so nothing here holds more than one
line in memory. It may be gzipped (Search-R1 ships `wiki-18.jsonl.gz`): `CorpusFile` is the one
way the corpus is opened, and it decompresses as it reads, so a gzipped corpus is never
unpacked into memory or onto disk. Rows come as `id` + `contents` (Search-R1's format) or
`id` + `title` + `text` (FlashRAG / BEIR style); both become
`{"id": str, "contents": str, ...extra fields}` because that is what a Search-R1 client reads
back from /retrieve.

A `.parquet` corpus (or any file starting with Parquet's `PAR1` magic) is read with pyarrow's
`ParquetFile.iter_batches`, PARQUET_BATCH rows at a time, so it streams like JSON Lines; its
columns are the same fields, and a row that cannot be a passage is an error naming the file
and the row. pyarrow is needed only for Parquet: without it a Parquet corpus is a CorpusError
that names the package.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from services.common.formats import corpus_contents

_HASH_BLOCK = 8 * 1024 * 1024
GZIP_MAGIC = b"\x1f\x8b"
PARQUET_MAGIC = b"PAR1"
PARQUET_SUFFIXES = (".parquet", ".pq")
PARQUET_BATCH = 1024
# What Python's gzip module raises on a damaged stream: a bad header or CRC (BadGzipFile),
# a truncated file (EOFError), corrupt deflate data (zlib.error).
_GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)


class CorpusError(ValueError):
    """A corpus line that cannot be a passage; the message names the file and line."""


@dataclass(frozen=True)
class CorpusStats:
    sha256: str
    rows: int
    size_bytes: int


def normalize_row(row: Any, where: str) -> dict[str, Any]:
    """Turn one parsed JSON line into `{"id": str, "contents": str, ...}`.

    Extra fields pass through untouched (Search-R1's dense retriever returns the raw row), but
    `title` and `text` are folded into `contents` so every doc has the same two core fields.
    """
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: a corpus row must be a JSON object")
    if "id" not in row:
        raise CorpusError(f"{where}: missing 'id'")
    if row["id"] is None:
        raise CorpusError(f"{where}: 'id' is null")
    doc = dict(row)
    doc["id"] = str(row["id"])
    if "contents" in row:
        if not isinstance(row["contents"], str):
            raise CorpusError(f"{where}: 'contents' must be a string")
    elif "text" in row:
        title, text = row.get("title", ""), row["text"]
        if not isinstance(title, str) or not isinstance(text, str):
            raise CorpusError(f"{where}: 'title' and 'text' must be strings")
        doc.pop("title", None)
        doc.pop("text")
        doc["contents"] = corpus_contents(title, text)
    else:
        raise CorpusError(f"{where}: needs 'contents' or 'title' + 'text'")
    return doc


class CorpusFile:
    """The corpus opened for reading: its lines, decompressed on the fly when it is gzipped.

    Every pass over the corpus (the checksum scan, the docstore and embedding pass) opens it
    here, so a plain and a gzipped copy of the same passages build the same index. A file is
    gzip when it starts with gzip's magic bytes or is named `.gz`; a `.gz` file that is not
    gzip, or a damaged or truncated one, raises CorpusError naming the file rather than a
    traceback from deep inside zlib (the whole file is scanned before a build writes anything,
    so that is where a bad download shows up).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._raw: IO[bytes] = open(self.path, "rb")  # noqa: SIM115 (closed in close())
        try:
            magic = self._raw.read(len(GZIP_MAGIC))
            self._raw.seek(0)
        except BaseException:
            self._raw.close()
            raise
        self.gzipped = magic == GZIP_MAGIC or self.path.suffix.lower() == ".gz"
        self._lines: IO[bytes] = (
            gzip.GzipFile(fileobj=self._raw, mode="rb") if self.gzipped else self._raw)

    def __iter__(self) -> Iterator[bytes]:
        """Each line as stored (blank ones too, newline kept), one at a time."""
        if not self.gzipped:
            yield from self._lines
            return
        try:
            yield from self._lines
        except _GZIP_ERRORS as exc:
            raise CorpusError(f"corpus {self.path}: gzip data is corrupt or truncated "
                              f"({exc})") from None

    def position(self) -> int:
        """Bytes of the file read so far (compressed bytes for gzip), for a progress bar."""
        return self._raw.tell()

    def close(self) -> None:
        if self._lines is not self._raw:
            self._lines.close()
        self._raw.close()

    def __enter__(self) -> CorpusFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def iter_lines(path: str | Path, skip: int = 0) -> Iterator[tuple[int, bytes]]:
    """(row number, raw line) for each non-blank line, starting after `skip` rows.

    Skipped rows are not parsed, so resuming an interrupted build far into the file is cheap.
    """
    row = 0
    with CorpusFile(path) as handle:
        for line in handle:
            if not line.strip():
                continue
            if row >= skip:
                yield row, line
            row += 1


def is_parquet(path: str | Path) -> bool:
    """A Parquet corpus: named `.parquet` / `.pq`, or starting with Parquet's magic bytes."""
    path = Path(path)
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return True
    try:
        with open(path, "rb") as handle:
            return handle.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC
    except OSError:
        return False


def _json_type(kind: Any) -> bool:
    """Whether pyarrow type `kind` becomes a JSON value (str, number, bool, null, list, dict)."""
    import pyarrow as pa

    types = pa.types
    if (types.is_string(kind) or types.is_large_string(kind) or types.is_integer(kind)
            or types.is_floating(kind) or types.is_boolean(kind) or types.is_null(kind)):
        return True
    if getattr(types, "is_string_view", None) and types.is_string_view(kind):
        return True
    if types.is_dictionary(kind):
        return _json_type(kind.value_type)
    if types.is_list(kind) or types.is_large_list(kind) or types.is_fixed_size_list(kind):
        return _json_type(kind.value_type)
    if types.is_struct(kind):
        return all(_json_type(kind.field(i).type) for i in range(kind.num_fields))
    return False


def open_parquet(path: str | Path):
    """pyarrow's ParquetFile for the corpus, its columns checked; a CorpusError (naming the
    file, or the pyarrow package when it is missing) rather than a traceback."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError(f"corpus {path} is Parquet, which needs the pyarrow package "
                          "(pip install pyarrow); or give the corpus as JSON Lines") from None
    try:
        handle = pq.ParquetFile(str(path))
    except Exception as exc:  # noqa: BLE001 (pyarrow raises ArrowInvalid, OSError, ...)
        raise CorpusError(f"corpus {path}: not a readable Parquet file ({exc})") from None
    schema = handle.schema_arrow
    names = set(schema.names)
    if "id" not in names:
        raise CorpusError(f"corpus {path}: Parquet file has no 'id' column "
                          f"(columns: {', '.join(schema.names)})")
    if "contents" not in names and "text" not in names:
        raise CorpusError(f"corpus {path}: Parquet file needs a 'contents' column or 'title' + "
                          f"'text' columns (columns: {', '.join(schema.names)})")
    for field in schema:
        if not _json_type(field.type):
            raise CorpusError(f"corpus {path}: column {field.name!r} has type {field.type}, "
                              "which has no JSON form; drop or cast it (strings, numbers, "
                              "booleans, lists and structs of them)")
    return handle


def _iter_parquet(path: str | Path, skip: int) -> Iterator[dict[str, Any]]:
    """Rows of a Parquet corpus, batch by batch; row groups wholly before `skip` are not read."""
    handle = open_parquet(path)
    meta = handle.metadata
    first_group, row = 0, 0
    while first_group < meta.num_row_groups:
        size = meta.row_group(first_group).num_rows
        if row + size > skip:
            break
        row += size
        first_group += 1
    try:
        # One iter_batches per row group: a single iter_batches over many groups kept every
        # group's buffers allocated (pyarrow 26: +30 MB per 50k 700-byte passages, 559 MB peak
        # at 1M), one per group stays flat (bench/docstore_scale.py).
        batches = (batch for group in range(first_group, meta.num_row_groups)
                   for batch in handle.iter_batches(batch_size=PARQUET_BATCH,
                                                    row_groups=[group]))
        for batch in batches:
            for record in batch.to_pylist():
                if row >= skip:
                    # A column is in every row of a Parquet file: a null is a field the row
                    # lacks (a mixed contents / title+text corpus has nulls in both).
                    present = {key: value for key, value in record.items() if value is not None}
                    yield normalize_row(present, f"{path}: row {row + 1}")
                row += 1
    except CorpusError:
        raise
    except Exception as exc:  # noqa: BLE001 (a damaged page or column chunk)
        raise CorpusError(f"corpus {path}: Parquet data after row {row} cannot be read "
                          f"({exc})") from None


def iter_corpus(path: str | Path, skip: int = 0) -> Iterator[dict[str, Any]]:
    """Normalised docs, one per non-blank line (or Parquet row), streamed."""
    if is_parquet(path):
        yield from _iter_parquet(path, skip)
        return
    for row, line in iter_lines(path, skip):
        where = f"{path}: row {row + 1}"
        try:
            parsed = json.loads(line)
        except ValueError as exc:
            raise CorpusError(f"{where}: not valid JSON ({exc})") from None
        except RecursionError:  # json's decoder recurses per level: 100k '[' ran out of stack
            raise CorpusError(f"{where}: nested too deeply to be a passage") from None
        yield normalize_row(parsed, where)


def scan_corpus(path: str | Path, show_progress: bool = False) -> CorpusStats:
    """Checksum and row count in one streaming pass: the key that decides whether a build's
    earlier work can be reused, and the size the build preallocates its arrays for.

    The checksum is of the passages' bytes (decompressed, for a gzipped corpus): the content
    is what the index depends on, so gzipping a corpus does not force a rebuild.
    `size_bytes` is the file's size on disk.
    """
    path = Path(path)
    if path.is_dir():
        raise CorpusError(f"corpus {path} is a directory; give the JSONL file of passages "
                          "(one {\"id\", \"contents\"} object per line)")
    if not path.is_file():
        raise CorpusError(f"corpus {path} does not exist")
    size = path.stat().st_size
    if is_parquet(path):
        return _scan_parquet(path, size, show_progress)
    digest = hashlib.sha256()
    rows = 0
    progress = None
    if show_progress:
        from tqdm import tqdm

        progress = tqdm(total=size, unit="B", unit_scale=True, desc="scan corpus")
    pending, shown = 0, 0
    with CorpusFile(path) as handle:
        for line in handle:
            digest.update(line)
            if line.strip():
                rows += 1
            pending += len(line)
            if progress is not None and pending >= _HASH_BLOCK:
                position = handle.position()
                progress.update(position - shown)
                pending, shown = 0, position
    if progress is not None:
        progress.update(size - shown)
        progress.close()
    return CorpusStats(sha256=digest.hexdigest(), rows=rows, size_bytes=size)


def _scan_parquet(path: Path, size: int, show_progress: bool) -> CorpusStats:
    """A Parquet corpus's key: the file's bytes (its row count is in the footer). Rows are
    checked in the streaming pass, as JSON Lines rows are."""
    rows = open_parquet(path).metadata.num_rows
    digest = hashlib.sha256()
    progress = None
    if show_progress:
        from tqdm import tqdm

        progress = tqdm(total=size, unit="B", unit_scale=True, desc="scan corpus")
    with open(path, "rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
            if progress is not None:
                progress.update(len(block))
    if progress is not None:
        progress.close()
    return CorpusStats(sha256=digest.hexdigest(), rows=rows, size_bytes=size)
