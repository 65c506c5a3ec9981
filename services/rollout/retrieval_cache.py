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
from collections.abc import Sequence
from typing import Any

from services.common.config import ConfigError
from services.common.retrieval_store import (
    QueryFailed,
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

log = logging.getLogger("forage.rollout.retrieval_cache")

KEY = "rollout.retrieval_cache"


class RetrievalCacheError(ConfigError):
    """The cache cannot start (no index named, another index's store, a retriever serving
    another index): one line, exit code 2."""


class CachedRetriever:
    """A RetrieverClient stand-in for the agent loop: `retrieve(queries)` and `close()`."""

    def __init__(self, backend: Any, store: Store, client: Any | None, mode: str) -> None:
        self.backend, self.store, self.client, self.mode = backend, store, client, mode

    @property
    def retrieval_tag(self) -> str:
        """The key the search turns record (retrieval_store.retrieval_tag)."""
        return self.backend.retrieval_tag

    @property
    def answers_from_cache(self) -> bool:
        """Whether an answer comes from the store without asking the retriever (replay; a
        recording asks it every time): the search turns' cache hits (retrieval health)."""
        return self.mode == "replay"

    def retrieve(self, queries: Sequence[str]) -> list[Result | QueryFailed]:
        return self.backend.retrieve(list(queries))

    def close(self) -> None:
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
        store = Store(cache.path, create=cache.mode == "record",
                      missing_hint=f"record one with {KEY}.mode: record")
    except StoreError as exc:
        raise RetrievalCacheError(f"{KEY}.path: {exc}") from None
    try:
        if cache.mode == "record":
            if named is not None:  # another index's store: said before the retriever is asked
                check_index(store, index_identity(named[1]), "record")
            identity, settings = _record_key(cache, config.retriever)
            check_index(store, identity, "record")
            assert client is not None
            # A conflicting answer fails its trajectory alone; the recorded result stays.
            backend: Any = Recording(client, store, identity, settings, topk,
                                     fail_conflicts=True)
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
    return CachedRetriever(backend, store, client, cache.mode)
