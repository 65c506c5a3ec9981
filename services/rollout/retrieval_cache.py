"""`rollout.retrieval_cache`: record every /retrieve result a replica gets, or replay them.

The store is `forage eval`'s (services/common/retrieval_store.py): one SQLite file keyed by
(index identity, retriever settings, top-k, query), so a store recorded in training replays an
evaluation's searches and the other way round, and several replicas may write one file.

- `record`: each batch of queries goes to the retriever through the usual client (timeouts,
  retries, bad queries), then every answer, refusals included, is written to the store. An
  outage (RetrieverError) records nothing and fails the batch as without the cache. An answer
  whose passages differ from the one the store holds under the same key ends that trajectory
  alone with finish_reason error naming both; the recorded result stays.
- `replay`: every answer comes from the store; the retriever is never called. A query the store
  lacks gets a `QueryFailed`, which ends that trajectory alone with finish_reason error and the
  missing query in its `error` (services/rollout/agent.py).
- `cache`: read-through. A query the store holds is answered from it; a batch's misses go to
  the retriever in one call, each distinct query once, and are written, evicting the least
  recently used rows past `max_bytes` (only this mode evicts). A live answer that differs
  from a stored one is served as it is with one warning (a key that misses a setting), and
  the stored one stays. Replicas and later runs share the file; other indexes' rows may
  live in it too (the key tells them apart). Hits, misses, retriever queries, evictions and
  the rows' bytes go to /metrics and to the log every LOG_EVERY_S.

Key: a recording writes under the identity and settings the running retriever reports on
/healthz (its search overrides and query precision, waiting up to `wait_s` for it); when the
config names the index directory (`rollout.retrieval_cache.index`, default
`retriever.index_dir`), the retriever must report that directory's identity (a retriever older
than that field: the same type and passage count). A replay needs no retriever when the
directory is named: its identity comes from the manifest, and the settings are the recorded
ones that agree with the config's search overrides and `retriever.query_dtype` (`auto`: as the
recording server resolved it). A store that holds another index's results (or, for replay, no
recording of this index and settings) stops the replica at startup with one line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from services.common.config import ConfigError
from services.common.retrieval_store import (
    QueryFailed,
    ReadThrough,
    Recording,
    Replay,
    Result,
    Store,
    StoreError,
    check_index,
    fetch_health,
    index_identity,
    read_index_manifest,
    replay_settings,
    served_identity,
    served_key,
)
from services.rollout import metrics

log = logging.getLogger("forage.rollout.retrieval_cache")

KEY = "rollout.retrieval_cache"
LOG_EVERY_S = 60.0  # cache mode: how often the replica logs its hit rate and bytes


def _size(count: int | None) -> str:
    """Bytes for a log line: `12.3 KiB`, `1.0 GiB` (`?` when not known yet)."""
    if count is None:
        return "?"
    value, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


class RetrievalCacheError(ConfigError):
    """The cache cannot start (no index named, another index's store, a retriever serving
    another index): one line, exit code 2."""


class CachedRetriever:
    """A RetrieverClient stand-in for the agent loop: `retrieve(queries)` and `close()`."""

    def __init__(self, backend: Any, store: Store, client: Any | None, mode: str) -> None:
        self.backend, self.store, self.client, self.mode = backend, store, client, mode
        # Per query of the last batch: answered from the store without the retriever (the
        # agent loop reads it on its one retrieval thread, right after `retrieve`).
        self.last_hits: list[bool] = []
        self.hits = self.misses = self.asked = self.evictions = self.conflicts = 0
        self.bytes: int | None = None
        self._logged = time.monotonic()

    @property
    def retrieval_tag(self) -> str:
        """The key the search turns record (retrieval_store.retrieval_tag)."""
        return self.backend.retrieval_tag

    @property
    def answers_from_cache(self) -> bool:
        """Whether every answer comes from the store without asking the retriever (replay; a
        recording asks it every time; cache mode says it per query in `last_hits`): the
        search turns' cache hits (retrieval health)."""
        return self.mode == "replay"

    def retrieve(self, queries: Sequence[str]) -> list[Result | QueryFailed]:
        results = self.backend.retrieve(list(queries))
        self.last_hits = ([True] * len(results) if self.mode == "replay" else
                          list(self.backend.last.hits) if self.mode == "cache" else
                          [False] * len(results))
        if self.mode == "cache":
            self._count(self.backend.last)
        return results

    def _count(self, batch: Any) -> None:
        """A cache batch's counts: this replica's totals, /metrics, and a periodic log line;
        a conflict is warned about once (its full message), then only counted."""
        hits = sum(batch.hits)
        self.hits += hits
        self.misses += len(batch.hits) - hits
        self.asked += batch.asked
        self.evictions += batch.evicted
        metrics.RETRIEVAL_CACHE_QUERIES.labels("hit").inc(hits)
        metrics.RETRIEVAL_CACHE_QUERIES.labels("miss").inc(len(batch.hits) - hits)
        metrics.RETRIEVAL_CACHE_ASKED.inc(batch.asked)
        metrics.RETRIEVAL_CACHE_EVICTIONS.inc(batch.evicted)
        if batch.bytes is not None:
            self.bytes = batch.bytes
            metrics.RETRIEVAL_CACHE_BYTES.set(batch.bytes)
        for conflict in batch.conflicts:
            self.conflicts += 1
            metrics.RETRIEVAL_CACHE_CONFLICTS.inc()
            if self.conflicts == 1:
                log.warning("retrieval cache: %s; serving the live answer (further "
                            "conflicts are only counted: forage_rollout_retrieval_cache_"
                            "conflicts)", conflict.message(self.store.path,
                                                           self.backend.index_id,
                                                           self.backend.settings,
                                                           self.backend.topk))
        if time.monotonic() - self._logged >= LOG_EVERY_S:
            self.log_counts()

    def log_counts(self) -> None:
        """One line: this replica's hits, misses, retriever queries, evictions, conflicts
        and the store's rows' bytes against the bound."""
        self._logged = time.monotonic()
        looked = self.hits + self.misses
        bound = self.backend.max_bytes
        log.info("retrieval cache: %d hits, %d misses (hit rate %.1f%%), %d queries to the "
                 "retriever (%.1f%% of %d spared), %d evicted, %d conflicts, %s of %s",
                 self.hits, self.misses, 100.0 * self.hits / max(looked, 1), self.asked,
                 100.0 * (1 - self.asked / max(looked, 1)) if looked else 0.0, looked,
                 self.evictions, self.conflicts, _size(self.bytes),
                 _size(bound) if bound else "unbounded")

    def close(self) -> None:
        if self.mode == "cache" and self.hits + self.misses:
            self.log_counts()
        if self.client is not None:
            self.client.close()
        self.store.close()


def _manifest(cache: Any, retriever: Any) -> tuple[str, dict[str, Any]] | None:
    """(directory, manifest) of the index named by the config, or None when none is."""
    index_dir = cache.index or retriever.index_dir
    if not index_dir:
        return None
    try:
        return index_dir, read_index_manifest(index_dir)
    except StoreError as exc:
        raise RetrievalCacheError(f"{KEY}.index: {exc}") from None


def _replay_key(store: Store, cache: Any, retriever: Any) -> tuple[str, dict[str, Any]]:
    """(identity, settings) a replay reads: the directory's identity (else the running
    retriever's), and the settings recorded for it that agree with the config's search
    overrides and query precision (`auto`: as the recording server resolved it)."""
    named = _manifest(cache, retriever)
    if named is None:
        identity, served = _served_identity(cache, retriever)
        return identity, replay_settings(store, identity, served.get("search_params"),
                                         served.get("query_dtype"))
    identity = index_identity(named[1])
    dtype = None if retriever.query_dtype == "auto" else retriever.query_dtype
    return identity, replay_settings(store, identity, retriever.search_overrides, dtype)


def _record_key(cache: Any, retriever: Any) -> tuple[str, dict[str, Any]]:
    """(identity, settings) a recording writes under: what the running retriever reports it
    serves (its own overrides and query precision), after checking it serves the directory
    the config names, if any."""
    named = _manifest(cache, retriever)
    if named is None:
        return _served_identity(cache, retriever)
    index_dir, manifest = named
    try:
        health = fetch_health(retriever.url, cache.wait_s)
    except StoreError as exc:
        raise RetrievalCacheError(f"{KEY}: {exc}; the index it serves must be checked before "
                                  "recording") from None
    try:
        return served_key(health, manifest, index_dir, retriever.url)
    except StoreError as exc:
        raise RetrievalCacheError(f"{KEY}: {exc}") from None


def _served_identity(cache: Any, retriever: Any) -> tuple[str, dict[str, Any]]:
    """The identity and settings the running retriever reports, for a replica without the
    index directory; a retriever that does not answer (or reports none) is a startup error
    naming both ways out."""
    try:
        health = fetch_health(retriever.url, cache.wait_s)
        identity, settings = served_identity(health, retriever.url)
    except StoreError as exc:
        raise RetrievalCacheError(
            f"{KEY}.mode {cache.mode} keys results by the index's identity, which comes from "
            f"the retriever's /healthz or the index directory: {exc}; start the retriever, or "
            f"set {KEY}.index (or retriever.index_dir) to the index directory it serves (only "
            "its manifest.json is read)") from None
    log.info("retrieval cache: index identity %s from %s", identity, retriever.url)
    return identity, settings


def open_cache(config: Any, client: Any | None) -> CachedRetriever | None:
    """The replica's retriever with `rollout.retrieval_cache` applied (None when off).
    `client` is the replica's RetrieverClient (closed here on replay: it is never called)."""
    cache = config.rollout.retrieval_cache
    if cache.mode == "off":
        return None
    topk = config.retriever.topk
    named = _manifest(cache, config.retriever)
    try:
        store = Store(cache.path, create=cache.mode in ("record", "cache"),
                      missing_hint=f"record one with {KEY}.mode: record")
    except StoreError as exc:
        raise RetrievalCacheError(f"{KEY}.path: {exc}") from None
    try:
        if cache.mode in ("record", "cache"):
            if named is not None and cache.mode == "record":
                # another index's store: said before the retriever is asked (a cache keeps
                # several indexes' rows apart by key)
                check_index(store, index_identity(named[1]), "record")
            identity, settings = _record_key(cache, config.retriever)
            assert client is not None
            if cache.mode == "record":
                check_index(store, identity, "record")
                # A conflicting answer fails its trajectory alone; the recorded result stays.
                backend: Any = Recording(client, store, identity, settings, topk,
                                         fail_conflicts=True)
            else:
                store.enable_cache()
                backend = ReadThrough(client, store, identity, settings, topk, cache.max_bytes)
                # a bound lowered since the file was written applies at once
                _, evicted, bytes_now = store.cache_put(identity, backend.settings, topk, [], 0,
                                                        cache.max_bytes)
                metrics.RETRIEVAL_CACHE_BYTES.set(bytes_now)
                metrics.RETRIEVAL_CACHE_EVICTIONS.inc(evicted)
                log.info("retrieval cache: %s holds %s of rows (bound %s; %d evicted now)",
                         cache.path, _size(bytes_now),
                         _size(cache.max_bytes) if cache.max_bytes else "none", evicted)
        else:
            if client is not None:
                client.close()
                client = None
            identity, settings = _replay_key(store, cache, config.retriever)
            backend = Replay(store, identity, settings, topk, fail_missing=True,
                             hint=f"record it with {KEY}.mode: record (same data, model and "
                                  "retriever settings)")
    except (StoreError, RetrievalCacheError) as exc:
        store.close()
        raise RetrievalCacheError(str(exc)) from None
    log.info("retrieval cache: %s %s (index %s, top-k %d)", cache.mode, cache.path, identity,
             topk)
    cached = CachedRetriever(backend, store, client, cache.mode)
    if cache.mode == "cache":
        cached.evictions, cached.bytes = evicted, bytes_now
    return cached
