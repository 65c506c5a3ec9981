"""The index manifest: what was built from what, written last so its presence means "done".

`serve` and `Searcher.load` refuse a directory without a valid manifest, which is how an
interrupted build (that never got to write one, and never got renamed into place) can not be
mistaken for an index.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1


class IndexLoadError(RuntimeError):
    """An index directory that is missing, unfinished or corrupt; the message says which."""


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_manifest(index_dir: str | Path) -> dict[str, Any]:
    index_dir = Path(index_dir)
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
    """Cheap structural check (manifest + files + sizes), without loading the index.

    The server runs this before it starts listening, so a wrong path fails the command at
    once with the reason instead of a server that never becomes healthy.
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
