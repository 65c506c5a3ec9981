"""The index manifest: what was built from what, written last so its presence means "done".

`serve` and `Searcher.load` refuse a directory without a valid manifest, which is how an
interrupted build (that never got to write one, and never got renamed into place) can not be
mistaken for an index. The manifest records each file's size and XXH3-64 checksum: sizes catch
a partial copy at once, checksums a same-size corruption (a flipped block in
`docs.offsets.npy` would otherwise serve and answer 500s). Checksums are verified once per
process per unchanged file (XXH3 runs at memory speed; the cost is one read of each file, whose
pages the index load then finds cached). Indexes built before checksums were recorded still
load, checked by size only.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
CHECKSUM_ALGO = "xxh3_64"
_BLOCK = 8 << 20
# (resolved path, size, mtime_ns, inode) -> checksum, for files verified in this process
_verified: dict[tuple[str, int, int, int], str] = {}
_verified_lock = threading.Lock()


class IndexLoadError(RuntimeError):
    """An index directory that is missing, unfinished or corrupt; the message says which."""


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def file_checksum(path: Path) -> str:
    """`xxh3_64:<hex>` of a file's bytes, read in 8 MiB blocks."""
    import xxhash

    hasher = xxhash.xxh3_64()
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            hasher.update(block)
    return f"{CHECKSUM_ALGO}:{hasher.hexdigest()}"


def checksums(index_dir: Path, names: list[str]) -> dict[str, str]:
    return {name: file_checksum(index_dir / name) for name in names}


def verify_checksums(index_dir: Path, manifest: dict[str, Any]) -> None:
    """Raise IndexLoadError naming the first file whose bytes do not match the manifest."""
    recorded = manifest.get("checksums") or {}
    if not isinstance(recorded, dict):
        raise IndexLoadError(f"{index_dir / MANIFEST_FILE} is corrupt: 'checksums' is not a map")
    for name, expected in recorded.items():
        path = index_dir / name
        stat = path.stat()
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)
        with _verified_lock:
            actual = _verified.get(key)
        if actual is None:
            actual = file_checksum(path)
        if actual != expected:
            raise IndexLoadError(
                f"{index_dir}: {name} is corrupt: its checksum is {actual}, the manifest "
                f"says {expected}; copy the index again or rebuild it"
            )
        with _verified_lock:
            _verified[key] = actual


def read_manifest(index_dir: str | Path) -> dict[str, Any]:
    index_dir = Path(index_dir)
    if index_dir.exists() and not index_dir.is_dir():
        raise IndexLoadError(f"index path {index_dir} is a file, not an index directory")
    if not index_dir.is_dir():
        raise IndexLoadError(f"index directory {index_dir} does not exist")
    path = index_dir / MANIFEST_FILE
    if not path.is_file():
        raise IndexLoadError(
            f"{index_dir} has no {MANIFEST_FILE}: not a built index, or its build did not finish "
            "(run `forage retriever build-index` again)"
        )
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise IndexLoadError(f"{path} is corrupt: {exc}") from None
    if not isinstance(manifest, dict):
        raise IndexLoadError(f"{path} is corrupt: not a JSON object")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise IndexLoadError(
            f"{path}: format_version {manifest.get('format_version')!r}, this build reads "
            f"{FORMAT_VERSION}; rebuild the index"
        )
    for key in ("index_type", "count", "files", "build_key"):
        if key not in manifest:
            raise IndexLoadError(f"{path} is corrupt: missing {key!r}")
    return manifest


def check_index_dir(index_dir: str | Path) -> dict[str, Any]:
    """Check the manifest, the files' sizes and checksums, without loading the index.

    The server runs this before it starts listening, so a wrong path or a corrupt file fails
    the command at once with the reason instead of a server that never becomes healthy (or
    answers 500s). Checksums are computed once per process per unchanged file.
    """
    from services.retriever.docstore import DocStore, DocStoreError

    index_dir = Path(index_dir)
    manifest = read_manifest(index_dir)
    for name, size in manifest["files"].items():
        path = index_dir / name
        if not path.exists():
            raise IndexLoadError(f"{index_dir}: {name} is missing")
        if size is not None and path.is_file() and path.stat().st_size != size:
            raise IndexLoadError(
                f"{index_dir}: {name} has {path.stat().st_size} bytes, the manifest says {size} "
                "(corrupt or partial copy)"
            )
    verify_checksums(index_dir, manifest)
    try:
        store = DocStore(index_dir)
    except DocStoreError as exc:
        raise IndexLoadError(str(exc)) from None
    try:
        if len(store) != manifest["count"]:
            raise IndexLoadError(
                f"{index_dir}: document store has {len(store)} rows, manifest says "
                f"{manifest['count']}"
            )
    finally:
        store.close()
    return manifest
