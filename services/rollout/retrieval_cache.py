"""`rollout.retrieval_cache`: record every /retrieve result a replica gets, or replay them.

The store is `forage eval`'s (services/common/retrieval_store.py): one SQLite file keyed by
(index identity, retriever settings, top-k, query), so a store recorded in training replays an
evaluation's searches and the other way round, and several replicas may write one file.

- `record`: each batch of queries goes to the retriever through the usual client (timeouts,
  retries, bad queries), then every answer, refusals included, is written to the store. An
  outage (RetrieverError) records nothing and fails the batch as without the cache.
- `replay`: every answer comes from the store; the retriever is never called. A query the store
  lacks gets a `QueryFailed`, which ends that trajectory alone with finish_reason error and the
  missing query in its `error` (services/rollout/agent.py).

Index identity: read from the index directory's manifest when the replica can read it
(`rollout.retrieval_cache.index`, default `retriever.index_dir`: the directory the retriever
serves); recording then checks that the retriever's /healthz reports the same identity (a
retriever older than that field: the same type and passage count). Without a directory, the
identity and search settings are the ones the running retriever reports on /healthz (waiting
up to `wait_s` for it), so a replica on another node than the index needs no copy of it. A
store that holds another index's results (or, for replay, none of this index and settings)
stops the replica at startup with one line.
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
    check_served,
    fetch_health,
    index_identity,
    read_index_manifest,
    search_settings,
    served_identity,
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

    def retrieve(self, queries: Sequence[str]) -> list[Result | QueryFailed]:
        return self.backend.retrieve(list(queries))

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.store.close()


def _identity(cache: Any, retriever: Any
              ) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    """(identity, search settings, the directory's manifest or None when the identity came
    from the running retriever's /healthz)."""
    index_dir = cache.index or retriever.index_dir
    if not index_dir:
        return (*_served_identity(cache, retriever), None)
    try:
        manifest = read_index_manifest(index_dir)
    except StoreError as exc:
        raise RetrievalCacheError(f"{KEY}.index: {exc}") from None
    settings = search_settings(manifest, retriever.search_overrides)
    return index_identity(manifest), settings, manifest


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


def check_serves(url: str, manifest: dict[str, Any], index_dir: str, wait_s: float) -> None:
    """Wait (up to `wait_s`) for the retriever's /healthz, then check it serves the index of
    `index_dir` (its identity; for an older retriever its type and passage count): recording
    one index's results under another's identity would poison the store."""
    try:
        health = fetch_health(url, wait_s)
    except StoreError as exc:
        raise RetrievalCacheError(f"{KEY}: {exc}; the index it serves must be checked before "
                                  "recording") from None
    try:
        check_served(health, manifest, index_dir, url)
    except StoreError as exc:
        raise RetrievalCacheError(f"{KEY}: {exc}") from None


def open_cache(config: Any, client: Any | None) -> CachedRetriever | None:
    """The replica's retriever with `rollout.retrieval_cache` applied (None when off).
    `client` is the replica's RetrieverClient (closed here on replay: it is never called)."""
    cache = config.rollout.retrieval_cache
    if cache.mode == "off":
        return None
    identity, settings, manifest = _identity(cache, config.retriever)
    topk = config.retriever.topk
    try:
        store = Store(cache.path, create=cache.mode == "record",
                      missing_hint=f"record one with {KEY}.mode: record")
    except StoreError as exc:
        raise RetrievalCacheError(f"{KEY}.path: {exc}") from None
    try:
        check_index(store, identity, settings, cache.mode)
        if cache.mode == "record":
            assert client is not None
            if manifest is not None:  # (else the identity is what the retriever reported)
                check_serves(config.retriever.url, manifest, cache.index or
                             config.retriever.index_dir, cache.wait_s)
            backend: Any = Recording(client, store, identity, settings, topk)
        else:
            if client is not None:
                client.close()
                client = None
            backend = Replay(store, identity, settings, topk, fail_missing=True,
                             hint=f"record it with {KEY}.mode: record (same data, model and "
                                  "retriever settings)")
    except (StoreError, RetrievalCacheError) as exc:
        store.close()
        raise RetrievalCacheError(str(exc)) from None
    log.info("retrieval cache: %s %s (index %s, top-k %d)", cache.mode, cache.path, identity,
             topk)
    return CachedRetriever(backend, store, client, cache.mode)
