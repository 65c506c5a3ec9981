"""Document store: passage N by row number without loading the corpus into RAM.

Two files: `docs.jsonl` (one normalised doc per line, the exact JSON /retrieve returns) and
`docs.offsets.npy` (uint64 byte offsets, rows + 1 of them). Serving memory-maps the offsets and
reads each passage with one pread, so the process holds no per-row Python objects and its
private memory does not grow with the corpus (passages live in the shared page cache); wiki-18's
21M passages need a 168 MB offsets file. The store keeps its own normalised copy
rather than offsets into the user's corpus so that an index directory is self-contained (copy
it to a replica and serve) and the corpus file can change without corrupting a live server.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

DOCS_FILE = "docs.jsonl"
OFFSETS_FILE = "docs.offsets.npy"


class DocStoreError(ValueError):
    """A document store that is missing or inconsistent (e.g. a truncated copy)."""


class DocStoreWriter:
    """Appends docs; resumable at a row boundary (the build checkpoints `rows`/`bytes`)."""

    def __init__(self, directory: Path, total_rows: int, resume_rows: int = 0,
                 resume_bytes: int = 0) -> None:
        self.directory = Path(directory)
        offsets_path = self.directory / OFFSETS_FILE
        docs_path = self.directory / DOCS_FILE
        if resume_rows and offsets_path.exists() and docs_path.exists():
            self._offsets = np.lib.format.open_memmap(offsets_path, mode="r+")
            if self._offsets.shape != (total_rows + 1,):
                raise DocStoreError(f"{offsets_path}: unexpected shape, cannot resume")
            self._handle = open(docs_path, "r+b")  # noqa: SIM115 (closed in close())
            self._handle.truncate(resume_bytes)
            self._handle.seek(resume_bytes)
            self.rows, self.bytes = resume_rows, resume_bytes
        else:
            self._offsets = np.lib.format.open_memmap(
                offsets_path, mode="w+", dtype=np.uint64, shape=(total_rows + 1,)
            )
            self._handle = open(docs_path, "wb")  # noqa: SIM115
            self.rows, self.bytes = 0, 0
            self._offsets[0] = 0
        self.total_rows = total_rows

    def add(self, doc: dict[str, Any]) -> None:
        if self.rows >= self.total_rows:
            raise DocStoreError("more rows than the corpus scan counted (did the file change?)")
        line = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"
        self._handle.write(line)
        self.bytes += len(line)
        self.rows += 1
        self._offsets[self.rows] = self.bytes

    def flush(self) -> None:
        """Make the checkpointed rows durable before the build records them as done."""
        self._handle.flush()
        self._offsets.flush()

    def close(self) -> None:
        self.flush()
        self._handle.close()
        del self._offsets


class DocStore:
    """Read-only, memory-mapped; `get(row)` parses one line."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        docs_path, offsets_path = directory / DOCS_FILE, directory / OFFSETS_FILE
        for path in (docs_path, offsets_path):
            if not path.is_file():
                raise DocStoreError(f"document store file {path} is missing")
        try:
            self._offsets = np.load(offsets_path, mmap_mode="r")
        except (ValueError, OSError) as exc:
            raise DocStoreError(f"{offsets_path} is not a valid offsets file: {exc}") from None
        if self._offsets.ndim != 1 or self._offsets.dtype != np.uint64 or len(self._offsets) < 1:
            raise DocStoreError(f"{offsets_path} is not a valid offsets file")
        size = docs_path.stat().st_size
        if int(self._offsets[-1]) != size:
            raise DocStoreError(
                f"{docs_path} has {size} bytes but the offsets expect {int(self._offsets[-1])} "
                "(truncated or modified document store)"
            )
        self._file = open(docs_path, "rb")  # noqa: SIM115 (lives as long as the store)
        self._fd = self._file.fileno()

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def get(self, row: int) -> dict[str, Any]:
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} out of range (0..{len(self) - 1})")
        start, end = int(self._offsets[row]), int(self._offsets[row + 1])
        # pread, not a memory map: one system call per passage, safe from many threads, and the
        # passages stay in the shared page cache without being mapped into this process. A map
        # made every random lookup map its neighbours as well (the kernel's fault-around, which
        # MADV_RANDOM does not turn off): 20k lookups left 633 MB of a 1M-passage store
        # resident in the server (bench/docstore_scale.py).
        line = os.pread(self._fd, end - start, start)
        if len(line) != end - start:
            raise DocStoreError(f"{self._file.name}: short read at row {row} (file truncated "
                                "while serving?)")
        return json.loads(line)

    def close(self) -> None:
        self._file.close()
