"""Search results for `forage eval`: live, and recorded so an evaluation can be replayed.

A backend answers `retrieve(queries) -> per query: [{"document", "score"}, ...] or
QueryRejected`, the interface of the rollout's RetrieverClient, so the agent loop takes any of
them. Live results come from a retriever process (`--retriever-url`, the same HTTP client
training uses) or from the index loaded in this process (`--index`, the server's own Searcher).

Index identity: a hash of the index's manifest (its build key, each file's checksum, the
count and type), never of its path or build time: a copied index keeps its identity, a rebuilt
or changed one gets another. Every recorded result is keyed by (identity, retriever settings,
top-k, query).

The store is one SQLite file (`OUT/retrieval.sqlite`) rather than JSON Lines: a test set of
50k questions makes a few hundred thousand results, which replay looks up by key without
reading them all into memory; each batch is committed in one transaction, so an interrupted
run leaves a store that is whole up to its last batch (resume just continues it); and the
primary key makes a result recorded twice (a resumed run) one row. Results are stored as JSON
text with Python's exact float repr, so a replayed result equals the live one bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from services.rollout.retrieval import QueryRejected

Result = list[dict[str, Any]] | QueryRejected
STORE_FILE = "retrieval.sqlite"
UNKNOWN_INDEX = "unknown"
MAX_QUERY_CHARS = 2048  # the rollout client's default check, applied in-process too


class RetrievalError(RuntimeError):
    """A user-facing retrieval problem (no index, store mismatch, a query not recorded)."""


class Backend(Protocol):
    def retrieve(self, queries: Sequence[str]) -> list[Result]: ...


def index_identity(manifest: dict[str, Any]) -> str:
    """`<index_type>-<16 hex>` of what the index holds (see the module docstring)."""
    content = {key: manifest.get(key) for key in ("build_key", "count", "index_type", "dim",
                                                  "encoder_name", "query_prefix")}
    content["files"] = manifest.get("checksums") or manifest.get("files")
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
    return f"{manifest.get('index_type', 'index')}-{digest}"


def read_identity(index_dir: str | Path) -> tuple[str, dict[str, Any]]:
    """(identity, search settings) of an index directory, from its manifest alone."""
    from services.retriever.manifest import IndexLoadError, read_manifest

    try:
        manifest = read_manifest(index_dir)
    except IndexLoadError as exc:
        raise RetrievalError(str(exc)) from None
    return index_identity(manifest), {"search_params": dict(manifest.get("params") or {})}


class InProcess:
    """The index loaded in this process: what `forage retriever serve` would answer."""

    def __init__(self, index_dir: str | Path, topk: int) -> None:
        from services.retriever.manifest import IndexLoadError
        from services.retriever.searcher import Searcher

        try:
            self.searcher = Searcher.load(index_dir)
        except IndexLoadError as exc:
            raise RetrievalError(str(exc)) from None
        self.topk = topk

    def retrieve(self, queries: Sequence[str]) -> list[Result]:
        out: list[Result | None] = [None] * len(queries)
        asked = [i for i, q in enumerate(queries) if len(q) <= MAX_QUERY_CHARS]
        for i, q in enumerate(queries):
            if len(q) > MAX_QUERY_CHARS:
                out[i] = QueryRejected(f"the query is longer than {MAX_QUERY_CHARS} characters "
                                       f"({len(q)})")
        found = self.searcher.search([queries[i] for i in asked], self.topk) if asked else []
        for i, hits in zip(asked, found, strict=True):
            # Through JSON, as the server sends it: the same types either way.
            out[i] = json.loads(json.dumps([{"document": doc, "score": score}
                                            for doc, score in hits]))
        return [item for item in out if item is not None]


class Http:
    """A retriever process, through the rollout's client (timeouts, retries, bad queries)."""

    def __init__(self, url: str, topk: int, index_dir: str | None = None) -> None:
        from services.rollout.retrieval import RetrieverClient

        self.client = RetrieverClient(url, topk=topk)
        if index_dir is not None:
            self._check_serves(url, index_dir)

    @staticmethod
    def _check_serves(url: str, index_dir: str) -> None:
        """The server's /healthz must report the index's type and passage count: a cheap
        guard against recording one index's results under another's identity."""
        import httpx

        from services.retriever.manifest import read_manifest

        manifest = read_manifest(index_dir)
        health = url.rsplit("/", 1)[0] + "/healthz"
        try:
            said = httpx.get(health, timeout=10).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise RetrievalError(f"{health} does not answer: {exc}") from None
        if (said.get("docs"), said.get("index_type")) != (manifest["count"],
                                                          manifest["index_type"]):
            raise RetrievalError(
                f"{url} serves a {said.get('index_type')} index of {said.get('docs')} passages, "
                f"but --index {index_dir} is a {manifest['index_type']} index of "
                f"{manifest['count']}: not the same index")

    def retrieve(self, queries: Sequence[str]) -> list[Result]:
        return self.client.retrieve(list(queries))


def _encode(result: Result) -> str:
    if isinstance(result, QueryRejected):
        return json.dumps({"rejected": result.reason})
    return json.dumps({"results": result}, sort_keys=True)


def _decode(text: str) -> Result:
    value = json.loads(text)
    if "rejected" in value:
        return QueryRejected(str(value["rejected"]))
    return value["results"]


class Store:
    """The SQLite store of recorded results (thread-safe: the agent loop retrieves on a worker
    thread)."""

    def __init__(self, path: str | Path, create: bool) -> None:
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise RetrievalError(f"{self.path}: no retrieval store (record one with "
                                 "--retrieval record)")
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False)
        self._db.execute("CREATE TABLE IF NOT EXISTS results (index_id TEXT, settings TEXT, "
                         "topk INTEGER, query TEXT, result TEXT, "
                         "PRIMARY KEY (index_id, settings, topk, query))")
        self._db.commit()

    def identities(self) -> list[tuple[str, str]]:
        with self._lock:
            rows = self._db.execute("SELECT DISTINCT index_id, settings FROM results").fetchall()
        return [(str(a), str(b)) for a, b in rows]

    def put(self, index_id: str, settings: str, topk: int,
            items: Sequence[tuple[str, Result]]) -> None:
        with self._lock:
            self._db.executemany("INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?, ?)",
                                 [(index_id, settings, topk, q, _encode(r)) for q, r in items])
            self._db.commit()

    def get(self, index_id: str, settings: str, topk: int, query: str) -> Result | None:
        with self._lock:
            row = self._db.execute("SELECT result FROM results WHERE index_id=? AND settings=? "
                                   "AND topk=? AND query=?",
                                   (index_id, settings, topk, query)).fetchone()
        return None if row is None else _decode(row[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()


def settings_key(settings: dict[str, Any]) -> str:
    return json.dumps(settings, sort_keys=True)


class Recording:
    """A live backend whose every answer is also written to the store."""

    def __init__(self, inner: Backend, store: Store, index_id: str, settings: dict[str, Any],
                 topk: int) -> None:
        self.inner, self.store, self.index_id = inner, store, index_id
        self.settings, self.topk = settings_key(settings), topk

    def retrieve(self, queries: Sequence[str]) -> list[Result]:
        results = self.inner.retrieve(queries)
        self.store.put(self.index_id, self.settings, self.topk, list(zip(queries, results,
                                                                         strict=True)))
        return results


class Replay:
    """Answers from the store only; a query it lacks is an error naming the query."""

    def __init__(self, store: Store, index_id: str, settings: dict[str, Any], topk: int) -> None:
        self.store, self.index_id = store, index_id
        self.settings, self.topk = settings_key(settings), topk

    def retrieve(self, queries: Sequence[str]) -> list[Result]:
        out = []
        for query in queries:
            found = self.store.get(self.index_id, self.settings, self.topk, query)
            if found is None:
                raise RetrievalError(
                    f"query {query!r} (top-k {self.topk}, index {self.index_id}) is not in "
                    f"{self.store.path}: the recorded run never asked it; record again with "
                    "--retrieval record (same model, data, mode and settings)")
            out.append(found)
        return out


def replay_identity(store: Store, index_dir: str | None) -> tuple[str, dict[str, Any]]:
    """The identity and settings a replay uses: those of `index_dir` when given (which the
    store must hold), else the store's only one."""
    held = store.identities()
    if not held:
        raise RetrievalError(f"{store.path} holds no recorded results")
    if index_dir is not None:
        identity, settings = read_identity(index_dir)
        if identity not in {i for i, _ in held}:
            raise RetrievalError(
                f"index {index_dir} is {identity}, but {store.path} was recorded with "
                f"{', '.join(sorted({i for i, _ in held}))}: a different index gives different "
                "results; replay with the recorded index or record again")
        return identity, settings
    identities = sorted({i for i, _ in held})
    if len(identities) > 1:
        raise RetrievalError(f"{store.path} holds results of several indexes "
                             f"({', '.join(identities)}); pass --index DIR to pick one")
    chosen = [s for i, s in held if i == identities[0]]
    return identities[0], json.loads(chosen[0])
