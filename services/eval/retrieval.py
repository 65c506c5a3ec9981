"""Search results for `forage eval`: live, and recorded so an evaluation can be replayed.

A backend answers `retrieve(queries) -> per query: [{"document", "score"}, ...] or
QueryRejected`, the interface of the rollout's RetrieverClient, so the agent loop takes any of
them. Live results come from a retriever process (`--retriever-url`, the same HTTP client
training uses) or from the index loaded in this process (`--index`, the server's own Searcher).

The store, its key and the index identity are services/common/retrieval_store.py, shared with
training's `rollout.retrieval_cache` (the module docstring there says why SQLite and how a
result is keyed); this module adds the live backends and `forage eval`'s wording.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common import retrieval_store as common
from services.common.retrieval_store import (
    Backend,
    QueryRejected,
    Recording,
    Result,
    index_identity,
    search_settings,
    settings_key,
)

__all__ = ["Backend", "Http", "InProcess", "Recording", "Replay", "Result", "RetrievalError",
           "Store", "index_identity", "read_identity", "replay_identity", "served_key",
           "settings_key"]

STORE_FILE = "retrieval.sqlite"
UNKNOWN_INDEX = "unknown"
MAX_QUERY_CHARS = 2048  # the rollout client's default check, applied in-process too


# A user-facing retrieval problem (no index, store mismatch, a query not recorded).
RetrievalError = common.StoreError


def read_identity(index_dir: str | Path, overrides: dict[str, Any] | None = None,
                  query_dtype: str | None = None) -> tuple[str, dict[str, Any]]:
    """(identity, search settings) of an index directory searched in this process, from its
    manifest alone; `overrides` are search settings put over the build's (nprobe, ...), as the
    server's, and `query_dtype` the resolved precision queries are encoded in (kept for an
    index with an encoder only)."""
    from services.retriever.indexes import is_dense
    from services.retriever.manifest import IndexLoadError, read_manifest

    try:
        manifest = read_manifest(index_dir)
    except IndexLoadError as exc:
        raise RetrievalError(str(exc)) from None
    dense = is_dense(str(manifest.get("index_type")))
    return index_identity(manifest), search_settings(manifest, overrides,
                                                     query_dtype if dense else None)


class InProcess:
    """The index loaded in this process: what `forage retriever serve` would answer.

    `device` places the encoder and the index (retriever.device), `index_device` the FAISS
    index apart (retriever.index_device); `query_dtype` is the precision queries are encoded
    in, already resolved (services/retriever/encoder.resolve_query_dtype: `auto` is float16
    on CUDA, as the server's); `search_params` the server's nprobe / ef_search / k_factor."""

    def __init__(self, index_dir: str | Path, topk: int, device: str = "cpu",
                 index_device: str | None = None, query_dtype: str = "float32",
                 search_params: dict[str, int] | None = None,
                 tag: str | None = None) -> None:
        from services.retriever.manifest import IndexLoadError
        from services.retriever.searcher import Searcher

        try:
            self.searcher = Searcher.load(index_dir, device=device, index_device=index_device,
                                          query_dtype=query_dtype, search_params=search_params)
        except IndexLoadError as exc:
            raise RetrievalError(str(exc)) from None
        self.topk = topk
        self.retrieval_tag = tag  # what each search turn records (retrieval_store)

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
    """A retriever process, through the rollout's client (timeouts, retries, bad queries).
    `tag`: the key its results go under (None: the client asks the retriever's /healthz)."""

    def __init__(self, url: str, topk: int, tag: str | None = None) -> None:
        from services.rollout.retrieval import RetrieverClient

        self.client = RetrieverClient(url, topk=topk)
        self._tag = tag

    @property
    def retrieval_tag(self) -> str | None:
        return self._tag if self._tag is not None else self.client.retrieval_tag

    def retrieve(self, queries: Sequence[str]) -> list[Result]:
        return self.client.retrieve(list(queries))


class Store(common.Store):
    """The store (services/common/retrieval_store.py) with `forage eval`'s advice."""

    def __init__(self, path: str | Path, create: bool) -> None:
        super().__init__(path, create, missing_hint="record one with --retrieval record")


class Replay(common.Replay):
    """Answers from the store only; a query it lacks is an error naming the query."""

    def __init__(self, store: Store, index_id: str, settings: dict[str, Any], topk: int) -> None:
        super().__init__(store, index_id, settings, topk,
                         hint="record again with --retrieval record (same model, data, mode "
                              "and settings)")


def served_key(url: str, index_dir: str | None, wait_s: float = 5.0
               ) -> tuple[str, dict[str, Any]]:
    """(identity, search settings) a running retriever reports on /healthz: what results from
    `--retriever-url` are keyed by (its own overrides and query precision). With `index_dir`,
    the retriever must serve that index (the identity its /healthz reports; for an older
    retriever its type and passage count): results of one index are never recorded under
    another's identity."""
    health = common.fetch_health(url, wait_s)
    if index_dir is None:
        return common.served_identity(health, url)
    from services.retriever.manifest import IndexLoadError, read_manifest

    try:
        manifest = read_manifest(index_dir)
    except IndexLoadError as exc:
        raise RetrievalError(str(exc)) from None
    return common.served_key(health, manifest, f"--index {index_dir}", url)


def replay_identity(store: Store, index_dir: str | None,
                    search_params: dict[str, int] | None = None,
                    query_dtype: str | None = None) -> tuple[str, dict[str, Any]]:
    """The identity and settings a replay uses: those of `index_dir` when given (which the
    store must hold), else the store's only index; the settings recorded for it that agree with
    `search_params` (nprobe, ... over the build's) and `query_dtype` when given (None: as
    recorded)."""
    held = store.identities()
    if not held:
        raise RetrievalError(f"{store.path} holds no recording (an empty store)")
    identities = sorted({i for i, _ in held})
    if index_dir is not None:
        identity, _ = read_identity(index_dir)
        if identity not in identities:
            raise RetrievalError(
                f"index {index_dir} is {identity}, but {store.path} was recorded with "
                f"{', '.join(identities)}: a different index gives different "
                "results; replay with the recorded index or record again")
    elif len(identities) > 1:
        raise RetrievalError(f"{store.path} holds results of several indexes "
                             f"({', '.join(identities)}); pass --index DIR to pick one")
    else:
        identity = identities[0]
    return identity, common.replay_settings(store, identity, search_params, query_dtype)
