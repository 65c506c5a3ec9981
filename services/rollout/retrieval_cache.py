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

Index identity: the retriever's /healthz reports only the index type and the passage count, not
its manifest, so the identity is read from the index directory's manifest
(`rollout.retrieval_cache.index`, default `retriever.index_dir`: the directory the retriever
serves). Recording checks /healthz against that manifest's type and count, as `forage eval
--retriever-url --index` does. A store that holds another index's results (or, for replay, none
of this index and settings) stops the replica at startup with one line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx

from services.common.config import ConfigError
from services.common.retrieval_store import (
    QueryFailed,
    Recording,
    Replay,
    Result,
    Store,
    StoreError,
    check_index,
    index_identity,
    read_index_manifest,
    search_settings,
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


def _identity(cache: Any, retriever: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    index_dir = cache.index or retriever.index_dir
    if not index_dir:
        raise RetrievalCacheError(
            f"{KEY}.mode {cache.mode} keys results by the index's identity: set {KEY}.index "
            "(or retriever.index_dir) to the index directory the retriever serves (only its "
            "manifest.json is read)")
    try:
        manifest = read_index_manifest(index_dir)
    except StoreError as exc:
        raise RetrievalCacheError(f"{KEY}.index: {exc}") from None
    settings = search_settings(manifest, {"nprobe": retriever.nprobe,
                                          "ef_search": retriever.ef_search})
    return index_identity(manifest), settings, manifest


def check_serves(url: str, manifest: dict[str, Any], index_dir: str, wait_s: float) -> None:
    """Wait (up to `wait_s`) for the retriever's /healthz, then check it reports the index's
    type and passage count: a cheap guard against recording one index's results under
    another's identity."""
    health = url.rsplit("/", 1)[0] + "/healthz"
    deadline = time.monotonic() + wait_s
    said: Any = None
    problem = "no answer"
    while True:
        try:
            response = httpx.get(health, timeout=5)
            if response.status_code == 200:
                said = response.json()
                break
            problem = f"HTTP {response.status_code}"
        except (httpx.HTTPError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise RetrievalCacheError(f"{KEY}: {health} did not answer within {wait_s:g}s "
                                      f"({problem}); the index it serves must be checked "
                                      "before recording")
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    if (said.get("docs"), said.get("index_type")) != (manifest.get("count"),
                                                      manifest.get("index_type")):
        raise RetrievalCacheError(
            f"{KEY}: {url} serves a {said.get('index_type')} index of {said.get('docs')} "
            f"passages, but {index_dir} is a {manifest.get('index_type')} index of "
            f"{manifest.get('count')}: not the same index")


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
