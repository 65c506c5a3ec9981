"""Recorded search results: the store `forage eval --retrieval record|replay` keeps, and the
rollout's `rollout.retrieval_cache` (docs/eval.md, docs/rollout.md).

A backend answers `retrieve(queries) -> per query: [{"document", "score"}, ...] or
QueryRejected`, the interface of the rollout's RetrieverClient, so the agent loop takes any of
them. `Recording` writes every answer of a live backend to the store; `Replay` answers from the
store alone.

Index identity: a hash of the index's manifest (its build key, each file's checksum, the
count and type), never of its path or build time: a copied index keeps its identity, a rebuilt
or changed one gets another. Every recorded result is keyed by (identity, retriever settings,
top-k, query), so evaluation and training read each other's stores. A running retriever reports
its index's identity and search settings on /healthz (`served_fields`), so a client without a
copy of the index directory keys results by what the server actually serves.

The store is one SQLite file rather than JSON Lines: a test set of 50k questions makes a few
hundred thousand results, which replay looks up by key without reading them all into memory;
each batch is committed in one transaction, so an interrupted run leaves a store that is whole
up to its last batch; and the primary key makes a result recorded twice one row. Results are
stored as JSON text with Python's exact float repr, so a replayed result equals the live one
bit for bit. Several processes (rollout replicas) may share one file: it is opened in WAL mode
(readers never wait for a writer) with a busy timeout, and a write that still finds the
database locked is retried with backoff.

Pure: no service is imported here (tests/test_service_boundaries.py).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from services.common.redact import redact_text, redact_url

MANIFEST_FILE = "manifest.json"  # an index directory's manifest (services/retriever/manifest.py)
BUSY_TIMEOUT_S = 30.0  # SQLite waits this long for another writer's lock...
LOCK_RETRIES = 5  # ...and a statement that still fails is retried this many times
T = TypeVar("T")


@dataclass(frozen=True)
class QueryRejected:
    """A query that was not answered (the client's check or the server refused it)."""

    reason: str

    def observation(self) -> str:
        """What the trajectory sees instead of passages, in Search-R1's observation frame."""
        return f"\n\n<information>Search failed: {self.reason}</information>\n\n"


@dataclass(frozen=True)
class QueryFailed:
    """A query that cannot be answered at all, for its trajectory only (a replay store that
    lacks it): the agent loop ends that trajectory with finish_reason error, as an outage ends
    the whole batch's."""

    reason: str


Result = list[dict[str, Any]] | QueryRejected


class StoreError(RuntimeError):
    """A user-facing store problem (missing file, another index, a query not recorded)."""


class Backend(Protocol):
    def retrieve(self, queries: Sequence[str]) -> list[Result]: ...


# ---------------------------------------------------------------------------- the key


def index_identity(manifest: dict[str, Any]) -> str:
    """`<index_type>-<16 hex>` of what the index holds (see the module docstring)."""
    content = {key: manifest.get(key) for key in ("build_key", "count", "index_type", "dim",
                                                  "encoder_name", "query_prefix")}
    content["files"] = manifest.get("checksums") or manifest.get("files")
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
    return f"{manifest.get('index_type', 'index')}-{digest}"


def search_settings(manifest: dict[str, Any],
                    overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The retriever settings part of the key: the index's search parameters as the server
    applies them (the manifest's, then the server's non-null overrides such as nprobe)."""
    params = dict(manifest.get("params") or {})
    params.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return {"search_params": params}


def settings_key(settings: dict[str, Any]) -> str:
    return json.dumps(settings, sort_keys=True)


def served_fields(manifest: dict[str, Any], overrides: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """What a retriever's /healthz reports about the index it serves, so a client that has
    no copy of the index directory still keys results by it: `index_id` (index_identity of
    its manifest) and `search_settings` (search_settings with the server's own overrides)."""
    return {"index_id": index_identity(manifest),
            "search_settings": search_settings(manifest, overrides)}


def healthz_url(retrieve_url: str) -> str:
    """http://host:8000/retrieve -> http://host:8000/healthz"""
    return retrieve_url.rsplit("/", 1)[0] + "/healthz"


def fetch_health(retrieve_url: str, wait_s: float) -> dict[str, Any]:
    """The retriever's /healthz body once it answers 200 (it answers 503 while the index
    loads), polling up to `wait_s` seconds; StoreError naming the URL and the last problem."""
    import httpx

    health = healthz_url(retrieve_url)
    deadline = time.monotonic() + wait_s
    problem = "no answer"
    while True:
        try:
            response = httpx.get(health, timeout=5)
            if response.status_code == 200:
                body = response.json()
                if isinstance(body, dict):
                    return body
                problem = "not a JSON object"
            else:
                problem = f"HTTP {response.status_code}"
        except (httpx.HTTPError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise StoreError(f"{redact_url(health)} did not answer within {wait_s:g}s "
                             f"({redact_text(problem)})")
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def served_identity(health: dict[str, Any], retrieve_url: str) -> tuple[str, dict[str, Any]]:
    """(identity, search settings) a retriever reports in its /healthz body; StoreError when
    it reports none (a retriever older than the field)."""
    identity, settings = health.get("index_id"), health.get("search_settings")
    if not isinstance(identity, str) or not identity or not isinstance(settings, dict):
        raise StoreError(f"{redact_url(healthz_url(retrieve_url))} does not report the index "
                         "identity (index_id): a retriever older than this Forage")
    return identity, settings


def check_served(health: dict[str, Any], manifest: dict[str, Any], index_dir: str | Path,
                 retrieve_url: str) -> None:
    """The retriever must serve the index of `index_dir`: the same identity when its /healthz
    reports one, else (an older retriever) the same type and passage count. StoreError
    naming both otherwise: results of one index must never be keyed by another's identity."""
    reported = health.get("index_id")
    if isinstance(reported, str) and reported:
        expected = index_identity(manifest)
        if reported != expected:
            raise StoreError(f"{redact_url(retrieve_url)} serves index {reported}, but "
                             f"{index_dir} is {expected}: not the same index")
        return
    if (health.get("docs"), health.get("index_type")) != (manifest.get("count"),
                                                          manifest.get("index_type")):
        raise StoreError(
            f"{redact_url(retrieve_url)} serves a {health.get('index_type')} index of "
            f"{health.get('docs')} passages, but {index_dir} is a "
            f"{manifest.get('index_type')} index of {manifest.get('count')}: not the same index")


def read_index_manifest(index_dir: str | Path) -> dict[str, Any]:
    """An index directory's manifest as JSON (only what the identity needs; the retriever's
    own reader checks the format when it loads the index)."""
    path = Path(index_dir) / MANIFEST_FILE
    if not path.is_file():
        raise StoreError(f"{index_dir} has no {MANIFEST_FILE}: not a built index directory")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StoreError(f"{path} cannot be read: {exc}") from None
    if not isinstance(manifest, dict):
        raise StoreError(f"{path} is corrupt: not a JSON object")
    return manifest


# ---------------------------------------------------------------------------- the store


def encode(result: Result) -> str:
    if isinstance(result, QueryRejected):
        return json.dumps({"rejected": result.reason})
    return json.dumps({"results": result}, sort_keys=True)


def decode(text: str) -> Result:
    value = json.loads(text)
    if "rejected" in value:
        return QueryRejected(str(value["rejected"]))
    return value["results"]


def _locked(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


class Store:
    """The SQLite store of recorded results. Thread-safe (the agent loop retrieves on a worker
    thread) and shareable between processes (WAL mode, busy timeout, retries).

    `missing_hint` ends the message for a store file that does not exist (how to make one)."""

    def __init__(self, path: str | Path, create: bool,
                 missing_hint: str = "record one first") -> None:
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise StoreError(f"{self.path}: no retrieval store ({missing_hint})")
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S,
                                       check_same_thread=False)
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open the retrieval store: {exc}") from None
        self._retrying(self._setup)

    def _setup(self) -> None:
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) and _locked(exc):
                raise
            raise StoreError(f"{self.path}: not a retrieval store ({exc})") from None
        self._db.execute("CREATE TABLE IF NOT EXISTS results (index_id TEXT, settings TEXT, "
                         "topk INTEGER, query TEXT, result TEXT, "
                         "PRIMARY KEY (index_id, settings, topk, query))")
        self._db.commit()

    def _retrying(self, action: Callable[[], T]) -> T:
        """Run `action` under the thread lock; a 'database is locked' past the busy timeout
        (another process holds the write lock long) is rolled back and retried."""
        for attempt in range(LOCK_RETRIES + 1):
            with self._lock:
                try:
                    return action()
                except sqlite3.OperationalError as exc:
                    if not _locked(exc) or attempt == LOCK_RETRIES:
                        raise StoreError(f"{self.path}: {exc}") from None
                    self._db.rollback()
            time.sleep(min(2.0, 0.05 * 2 ** attempt))
        raise AssertionError("unreachable")

    def identities(self) -> list[tuple[str, str]]:
        """Every (index identity, settings key) the store holds results for."""
        rows = self._retrying(lambda: self._db.execute(
            "SELECT DISTINCT index_id, settings FROM results").fetchall())
        return [(str(a), str(b)) for a, b in rows]

    def put(self, index_id: str, settings: str, topk: int,
            items: Sequence[tuple[str, Result]]) -> None:
        rows = [(index_id, settings, topk, q, encode(r)) for q, r in items]

        def write() -> None:
            self._db.executemany("INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?, ?)", rows)
            self._db.commit()

        self._retrying(write)

    def get(self, index_id: str, settings: str, topk: int, query: str) -> Result | None:
        row = self._retrying(lambda: self._db.execute(
            "SELECT result FROM results WHERE index_id=? AND settings=? AND topk=? AND query=?",
            (index_id, settings, topk, query)).fetchone())
        return None if row is None else decode(row[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()


def check_index(store: Store, identity: str, settings: dict[str, Any], mode: str) -> None:
    """A store is for one index: `record` refuses a store holding another index's results,
    `replay` one without results for this index and settings (a StoreError naming both)."""
    held = store.identities()
    others = sorted({i for i, _ in held} - {identity})
    if mode == "record" and others:
        raise StoreError(f"{store.path} holds results of index {', '.join(others)}, but this "
                         f"run searches {identity}: a store made for another index; use "
                         "another path")
    if mode == "replay":
        if not held:
            raise StoreError(f"{store.path} holds no recorded results")
        if (identity, settings_key(settings)) not in held:
            found = sorted({i for i, _ in held})
            what = ("other search settings" if identity in found
                    else f"index {', '.join(found)}")
            raise StoreError(f"{store.path} was recorded with {what}, but this run searches "
                             f"{identity} with {settings_key(settings)}: a store made for "
                             "another index or settings; record again")


# ---------------------------------------------------------------------------- backends


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
    """Answers from the store only. A query it lacks raises StoreError naming it, or, with
    `fail_missing`, gets a QueryFailed (its trajectory alone fails)."""

    def __init__(self, store: Store, index_id: str, settings: dict[str, Any], topk: int,
                 hint: str = "record it first", fail_missing: bool = False) -> None:
        self.store, self.index_id = store, index_id
        self.settings, self.topk = settings_key(settings), topk
        self.hint, self.fail_missing = hint, fail_missing

    def missing(self, query: str) -> str:
        return (f"query {query!r} (top-k {self.topk}, index {self.index_id}) is not in "
                f"{self.store.path}: the recorded run never asked it; {self.hint}")

    def retrieve(self, queries: Sequence[str]) -> list[Result | QueryFailed]:
        out: list[Result | QueryFailed] = []
        for query in queries:
            found = self.store.get(self.index_id, self.settings, self.topk, query)
            if found is None:
                if not self.fail_missing:
                    raise StoreError(self.missing(query))
                out.append(QueryFailed(self.missing(query)))
                continue
            out.append(found)
        return out
