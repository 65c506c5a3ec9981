"""Recorded search results: the store `forage eval --retrieval record|replay` keeps, and the
rollout's `rollout.retrieval_cache` (docs/eval.md, docs/rollout.md).

A backend answers `retrieve(queries) -> per query: [{"document", "score"}, ...] or
QueryRejected`, the interface of the rollout's RetrieverClient, so the agent loop takes any of
them. `Recording` writes every answer of a live backend to the store; `Replay` answers from the
store alone; `ReadThrough` answers from the store what it holds, asks the live backend the rest
and keeps the rows under a byte bound by evicting the least recently used (the only one that
evicts: a cache's rows carry a last-use time and the file a running byte count).

Index identity: a hash of the index's manifest (its build key, each file's checksum, the
count and type), never of its path or build time: a copied index keeps its identity, a rebuilt
or changed one gets another. Every recorded result is keyed by (identity, retriever settings,
top-k, query), so evaluation and training read each other's stores. The settings are everything
else that can change a result: the search parameters the server applies (the build's, then its
own nprobe / ef_search / k_factor) and the precision queries are encoded in (`auto` resolves to
float16 on CUDA and bfloat16 on some CPUs, float32 elsewhere). A running retriever reports its
index's identity and settings on /healthz (`served_fields`), so a client keys results by what the
server actually serves, never by what a copy of the index directory says it would.

A recorded result is the truth for its key: a later answer under the same key with other
passages (or their order) is refused (`Conflict`), never written over it, because it means the
key misses something that changed the result and a replay could not give both. An answer with
the same passages is the same result (scores are never shown to the policy) and the recorded one
is returned, so the recording run and its replay see the same bytes. A store also remembers each
key it was recorded under, so a recording whose policy never searched replays too.

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


def _row_bytes(row: str = "") -> str:
    """A row's bytes as a cache counts them (cache_usage), as SQL: its key's and result's text
    in UTF-8 plus its two integers. SQLite's pages and the key index add to the file."""
    return " + ".join([*(f"length(CAST({row}{column} AS BLOB))"
                         for column in ("index_id", "settings", "query", "result")), "16"])



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


def search_settings(manifest: dict[str, Any], overrides: dict[str, Any] | None = None,
                    query_dtype: str | None = None) -> dict[str, Any]:
    """The retriever settings part of the key: the index's search parameters as the server
    applies them (the manifest's, then the server's non-null overrides such as nprobe) and,
    for an index with an encoder, the resolved precision queries are encoded in (None: BM25,
    or not known)."""
    params = dict(manifest.get("params") or {})
    params.update({k: v for k, v in (overrides or {}).items() if v is not None})
    settings: dict[str, Any] = {"search_params": params}
    if query_dtype is not None:
        settings["query_dtype"] = query_dtype
    return settings


def settings_key(settings: dict[str, Any]) -> str:
    return json.dumps(settings, sort_keys=True)


def served_fields(manifest: dict[str, Any], overrides: dict[str, Any] | None = None,
                  query_dtype: str | None = None) -> dict[str, Any]:
    """What a retriever's /healthz reports about the index it serves, so a client keys
    results by what it serves: `index_id` (index_identity of its manifest) and
    `search_settings` (search_settings with the server's own overrides and query precision)."""
    return {"index_id": index_identity(manifest),
            "search_settings": search_settings(manifest, overrides, query_dtype)}


def retrieval_tag(identity: str, settings: dict[str, Any], topk: int) -> str:
    """What a recorded search turn carries about who answered it, compactly:
    `<index identity>@<8 hex of the settings and top-k>` (the whole store key but the query).
    Two turns with the same tag were answered under the same key."""
    digest = hashlib.sha256(f"{settings_key(settings)}|{topk}".encode()).hexdigest()[:8]
    return f"{identity}@{digest}"


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


def served_key(health: dict[str, Any], manifest: dict[str, Any], index_dir: str | Path,
               retrieve_url: str) -> tuple[str, dict[str, Any]]:
    """(identity, settings) to key a retriever's results by, given the index directory it
    should serve: check_served first, then the settings the server reports (its own overrides
    and query precision), never the directory's, which say only what the build chose. A
    retriever older than the settings field: the directory's (its query precision unknown)."""
    check_served(health, manifest, index_dir, retrieve_url)
    settings = health.get("search_settings")
    if isinstance(health.get("index_id"), str) and isinstance(settings, dict):
        return str(health["index_id"]), settings
    return index_identity(manifest), search_settings(manifest)


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


def _passages(result: Result) -> Any:
    """What the policy sees of a result: its passages in order (scores are never shown),
    or the refusal."""
    if isinstance(result, QueryRejected):
        return ("rejected",)
    return [item.get("document", item) if isinstance(item, dict) else item for item in result]


def _describe(result: Result) -> str:
    """A result in an error message: the refusal, or its passages' ids."""
    if isinstance(result, QueryRejected):
        return f"refused ({result.reason})"
    ids = [str(doc.get("id", "?")) if isinstance(doc, dict) else "?" for doc in _passages(result)]
    return f"passages [{', '.join(ids)}]"


@dataclass(frozen=True)
class Conflict:
    """A new answer under a key the store already holds another result for."""

    query: str
    held: Result
    new: Result

    def message(self, path: Path, index_id: str, settings: str, topk: int) -> str:
        return (f"query {self.query!r} (top-k {topk}, index {index_id}, settings {settings}) "
                f"is recorded in {path} with {_describe(self.held)}, but the retriever now "
                f"answers {_describe(self.new)}: a setting outside the key changed or the search "
                "is not deterministic; the recorded result is kept (record into a new store to "
                "keep the new ones)")


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
        # Each (identity, settings) a recording ran under, results or not: a recording whose
        # policy never searched is a valid one, and replays.
        self._db.execute("CREATE TABLE IF NOT EXISTS recordings (index_id TEXT, settings TEXT, "
                         "PRIMARY KEY (index_id, settings))")
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
        """Every (index identity, settings key) the store was recorded under."""
        rows = self._retrying(lambda: self._db.execute(
            "SELECT index_id, settings FROM recordings UNION "
            "SELECT DISTINCT index_id, settings FROM results").fetchall())
        return sorted((str(a), str(b)) for a, b in rows)

    def register(self, index_id: str, settings: str) -> None:
        """Note that a recording runs under this key (before any result is written)."""
        def write() -> None:
            self._db.execute("INSERT OR IGNORE INTO recordings VALUES (?, ?)",
                             (index_id, settings))
            self._db.commit()

        self._retrying(write)

    def put(self, index_id: str, settings: str, topk: int,
            items: Sequence[tuple[str, Result]]) -> list[Result | Conflict]:
        """Write each (query, result) the store does not hold yet, in one transaction, and
        return per item what the store now holds: the new result, the recorded one when its
        passages are the same, or a Conflict (nothing written) when they differ."""
        def write() -> list[Result | Conflict]:
            self._db.execute("BEGIN IMMEDIATE")  # read and write under one lock: no race
            out = self._insert(index_id, settings, topk, items, None)
            self._db.commit()
            return out

        return self._retrying(write)

    def _insert(self, index_id: str, settings: str, topk: int,
                items: Sequence[tuple[str, Result]], used_at: int | None
                ) -> list[Result | Conflict]:
        """put's rows, inside the caller's transaction; `used_at` (a cache store) also marks
        each row written or matched as used then."""
        out: list[Result | Conflict] = []
        for query, result in items:
            key = (index_id, settings, topk, query)
            row = self._db.execute(
                "SELECT result FROM results WHERE index_id=? AND settings=? AND topk=? "
                "AND query=?", key).fetchone()
            if row is None:
                if used_at is None:
                    self._db.execute("INSERT INTO results (index_id, settings, topk, query, "
                                     "result) VALUES (?, ?, ?, ?, ?)", (*key, encode(result)))
                else:
                    self._db.execute("INSERT INTO results (index_id, settings, topk, query, "
                                     "result, last_used) VALUES (?, ?, ?, ?, ?, ?)",
                                     (*key, encode(result), used_at))
                out.append(result)
                continue
            held = decode(row[0])
            same = _passages(held) == _passages(result)
            if same and used_at is not None:
                self._touch(key, used_at)
            out.append(held if same else Conflict(query, held, result))
        return out

    # ------------------------------------------------------------ a size-bounded cache
    # Only `rollout.retrieval_cache.mode: cache` calls these: they add a last-use column and a
    # running byte count to the file, and evict rows; record and replay never evict.

    def enable_cache(self) -> None:
        """Make this store a cache: each row's last use (`last_used`, indexed, for LRU
        eviction) and the rows' bytes kept by triggers in `cache_usage`, so the size is known
        without a scan (whatever mode writes the rows). Idempotent, and safe when several
        replicas open the file at once (one transaction)."""
        def setup() -> None:
            self._db.execute("BEGIN IMMEDIATE")
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(results)")}
            if "last_used" not in columns:
                self._db.execute("ALTER TABLE results ADD COLUMN last_used INTEGER NOT NULL "
                                 "DEFAULT 0")
            self._db.execute("CREATE INDEX IF NOT EXISTS results_last_used ON results "
                             "(last_used)")
            if self._db.execute("SELECT name FROM sqlite_master WHERE type='table' "
                                "AND name='cache_usage'").fetchone() is None:
                self._db.execute("CREATE TABLE cache_usage (id INTEGER PRIMARY KEY "
                                 "CHECK (id = 0), bytes INTEGER NOT NULL, rows INTEGER NOT NULL)")
                self._db.execute(f"INSERT INTO cache_usage SELECT 0, "
                                 f"COALESCE(SUM({_row_bytes()}), 0), COUNT(*) FROM results")
            new_row, old_row = f"({_row_bytes('new.')})", f"({_row_bytes('old.')})"
            self._db.execute("CREATE TRIGGER IF NOT EXISTS results_usage_insert AFTER INSERT "
                             "ON results BEGIN UPDATE cache_usage SET bytes = bytes + "
                             f"{new_row}, rows = rows + 1; END")
            self._db.execute("CREATE TRIGGER IF NOT EXISTS results_usage_delete AFTER DELETE "
                             "ON results BEGIN UPDATE cache_usage SET bytes = bytes - "
                             f"{old_row}, rows = rows - 1; END")
            self._db.commit()

        self._retrying(setup)

    def _touch(self, key: tuple[str, str, int, str], used_at: int) -> None:
        self._db.execute("UPDATE results SET last_used=? WHERE index_id=? AND settings=? "
                         "AND topk=? AND query=?", (used_at, *key))

    def lookup(self, index_id: str, settings: str, topk: int, queries: Sequence[str],
               used_at: int) -> dict[str, Result]:
        """The results the store holds for these queries (each asked once), marking each
        found row used at `used_at`, in one transaction (a cache store: enable_cache)."""
        def read() -> dict[str, Result]:
            self._db.execute("BEGIN IMMEDIATE")
            found: dict[str, Result] = {}
            for query in dict.fromkeys(queries):
                key = (index_id, settings, topk, query)
                row = self._db.execute(
                    "SELECT result FROM results WHERE index_id=? AND settings=? AND topk=? "
                    "AND query=?", key).fetchone()
                if row is not None:
                    found[query] = decode(row[0])
                    self._touch(key, used_at)
            self._db.commit()
            return found

        return self._retrying(read)

    def cache_put(self, index_id: str, settings: str, topk: int,
                  items: Sequence[tuple[str, Result]], used_at: int, max_bytes: int
                  ) -> tuple[list[Result | Conflict], int, int]:
        """put for a cache store, then evict the least recently used rows until the rows'
        bytes are at most `max_bytes` (0: unbounded), in one transaction: (what put returns,
        rows evicted, the rows' bytes after)."""
        def write() -> tuple[list[Result | Conflict], int, int]:
            self._db.execute("BEGIN IMMEDIATE")
            out = self._insert(index_id, settings, topk, items, used_at)
            evicted = self._evict(max_bytes)
            used = self._db.execute("SELECT bytes FROM cache_usage").fetchone()[0]
            self._db.commit()
            return out, evicted, int(used)

        return self._retrying(write)

    def _evict(self, max_bytes: int) -> int:
        """Delete least-recently-used rows until the rows' bytes fit (inside a transaction):
        each round deletes about as many rows as the excess holds at the average row size."""
        evicted = 0
        while max_bytes > 0:
            used, rows = self._db.execute("SELECT bytes, rows FROM cache_usage").fetchone()
            if used <= max_bytes or rows <= 0:
                break
            count = max(1, -(-(used - max_bytes) * rows // used))
            evicted += self._db.execute(
                "DELETE FROM results WHERE rowid IN (SELECT rowid FROM results "
                "ORDER BY last_used LIMIT ?)", (count,)).rowcount
        return evicted

    def cache_bytes(self) -> int:
        """The rows' bytes of a cache store (enable_cache)."""
        row = self._retrying(lambda: self._db.execute(
            "SELECT bytes FROM cache_usage").fetchone())
        return int(row[0])

    def get(self, index_id: str, settings: str, topk: int, query: str) -> Result | None:
        row = self._retrying(lambda: self._db.execute(
            "SELECT result FROM results WHERE index_id=? AND settings=? AND topk=? AND query=?",
            (index_id, settings, topk, query)).fetchone())
        return None if row is None else decode(row[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()


def check_index(store: Store, identity: str, mode: str) -> None:
    """A store is for one index: `record` refuses a store holding another index's results,
    `replay` one without any recording of this index (a StoreError naming both)."""
    held = store.identities()
    others = sorted({i for i, _ in held} - {identity})
    if mode == "record" and others:
        raise StoreError(f"{store.path} holds results of index {', '.join(others)}, but this "
                         f"run searches {identity}: a store made for another index; use "
                         "another path")
    if mode == "replay":
        if not held:
            raise StoreError(f"{store.path} holds no recording (an empty store)")
        if identity not in {i for i, _ in held}:
            raise StoreError(f"{store.path} was recorded with index {', '.join(others)}, but "
                             f"this run searches {identity}: a store made for another index; "
                             "record again")


def replay_settings(store: Store, identity: str, overrides: dict[str, Any] | None = None,
                    query_dtype: str | None = None) -> dict[str, Any]:
    """The settings a replay of `identity` reads: the one set recorded for it that agrees with
    what the replay asks: each non-null search override (nprobe, ...) and the query precision
    (None: as recorded; `auto` is whatever the recording server resolved; a recording that
    names none, BM25's, agrees with any). StoreError naming what was recorded when none or
    several agree."""
    recorded = [json.loads(s) for i, s in store.identities() if i == identity]
    if not recorded:
        check_index(store, identity, "replay")
    wanted = {k: v for k, v in (overrides or {}).items() if v is not None}
    fits = [s for s in recorded
            if all((s.get("search_params") or {}).get(k) == v for k, v in wanted.items())
            and (query_dtype is None or s.get("query_dtype") in (None, query_dtype))]
    if len(fits) == 1:
        return fits[0]
    listed = "; ".join(settings_key(s) for s in recorded)
    asked = settings_key({"search_params": wanted, **({"query_dtype": query_dtype}
                                                      if query_dtype is not None else {})})
    if not fits:
        raise StoreError(f"{store.path} was recorded with other search settings ({listed}), "
                         f"but this run searches {identity} with {asked}: a store made for "
                         "other settings; record again")
    raise StoreError(f"{store.path} holds index {identity} under several search settings "
                     f"({listed}); name the query precision (retriever.query_dtype) or search "
                     "settings to pick one")


# ---------------------------------------------------------------------------- backends


class Recording:
    """A live backend whose every answer is also written to the store, and answered as the
    store holds it (a replay then gives the same bytes). A Conflict raises StoreError, or,
    with `fail_conflicts`, gets a QueryFailed (its trajectory alone fails, the recorded result
    stays). `retrieval_tag` is what the agent loop records on each search turn."""

    def __init__(self, inner: Backend, store: Store, index_id: str, settings: dict[str, Any],
                 topk: int, fail_conflicts: bool = False) -> None:
        self.inner, self.store, self.index_id = inner, store, index_id
        self.settings, self.topk = settings_key(settings), topk
        self.fail_conflicts = fail_conflicts
        self.retrieval_tag = retrieval_tag(index_id, settings, topk)
        store.register(index_id, self.settings)

    def retrieve(self, queries: Sequence[str]) -> list[Result | QueryFailed]:
        results = self.inner.retrieve(queries)
        held = self.store.put(self.index_id, self.settings, self.topk,
                              list(zip(queries, results, strict=True)))
        out: list[Result | QueryFailed] = []
        for item in held:
            if isinstance(item, Conflict):
                message = item.message(self.store.path, self.index_id, self.settings, self.topk)
                if not self.fail_conflicts:
                    raise StoreError(message)
                out.append(QueryFailed(message))
                continue
            out.append(item)
        return out


class Replay:
    """Answers from the store only. A query it lacks raises StoreError naming it, or, with
    `fail_missing`, gets a QueryFailed (its trajectory alone fails)."""

    # Every answer is read from the store: a cache hit in the search turns' retrieval health.
    answers_from_cache = True

    def __init__(self, store: Store, index_id: str, settings: dict[str, Any], topk: int,
                 hint: str = "record it first", fail_missing: bool = False) -> None:
        self.store, self.index_id = store, index_id
        self.settings, self.topk = settings_key(settings), topk
        self.hint, self.fail_missing = hint, fail_missing
        self.retrieval_tag = retrieval_tag(index_id, settings, topk)

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


@dataclass(frozen=True)
class CacheBatch:
    """What one read-through batch did: per query whether the store answered it, how many
    distinct queries the retriever was asked, rows evicted, conflicts, and the rows' bytes."""

    hits: list[bool]
    asked: int
    evicted: int
    conflicts: list[Conflict]
    bytes: int | None  # None: nothing was written (an all-hit batch)


class ReadThrough:
    """A cache in front of a live backend: a query the store holds (same key as record and
    replay) is answered from it; the batch's misses go to the backend in one call, each
    distinct query once (a GRPO group's samples often search the same words), and are written
    with LRU eviction down to `max_bytes` (0: unbounded). A live answer whose passages differ
    from a stored one is served as it is and reported in `last.conflicts`; the stored one
    stays (never overwritten). Call `store.enable_cache()` first."""

    def __init__(self, inner: Backend, store: Store, index_id: str, settings: dict[str, Any],
                 topk: int, max_bytes: int) -> None:
        self.inner, self.store, self.index_id = inner, store, index_id
        self.settings, self.topk, self.max_bytes = settings_key(settings), topk, max_bytes
        self.retrieval_tag = retrieval_tag(index_id, settings, topk)
        self.last = CacheBatch([], 0, 0, [], None)
        store.register(index_id, self.settings)

    def retrieve(self, queries: Sequence[str]) -> list[Result]:
        used_at = time.time_ns() // 1000
        found = self.store.lookup(self.index_id, self.settings, self.topk, queries, used_at)
        missing = [q for q in dict.fromkeys(queries) if q not in found]
        evicted, used = 0, None
        conflicts: list[Conflict] = []
        if missing:  # an outage (the backend raises) writes nothing and fails the batch
            live = self.inner.retrieve(missing)
            held, evicted, used = self.store.cache_put(
                self.index_id, self.settings, self.topk, list(zip(missing, live, strict=True)),
                used_at, self.max_bytes)
            answers: dict[str, Result] = {}
            for query, item, fresh in zip(missing, held, live, strict=True):
                if isinstance(item, Conflict):
                    conflicts.append(item)
                    item = fresh
                answers[query] = item
            found = {**found, **answers}
        asked = set(missing)
        self.last = CacheBatch([q not in asked for q in queries], len(missing), evicted,
                               conflicts, used)
        return [found[q] for q in queries]
