"""In-process search over a built index: the server's engine, and the data builder's API.

`search_many` is the server's micro-batch entry point: one encoder call for every query in the
batch, then one index search per distinct topk (so each request gets exactly what it would get
alone, even for approximate indexes whose results depend on k).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from services.retriever.docstore import DocStore, DocStoreError
from services.retriever.indexes import (
    BM25_DIR,
    DENSE_TYPES,
    FAISS_FILE,
    BM25Index,
    apply_search_params,
    load_dense,
)
from services.retriever.manifest import IndexLoadError, check_index_dir

Result = list[tuple[dict[str, Any], float]]


def check_device(device: str, index_type: str | None = None, *, index_on_device: bool = True,
                 key: str = "retriever.device") -> None:
    """Raise DeviceError (one line, every problem named) unless `device` can run the encoder
    (torch) and, with `index_on_device`, a dense index of `index_type` (faiss). Called at start,
    before anything is loaded: asking for `cuda` and getting CPU is an error, not a warning.
    A BM25 index uses neither, so only the spelling of the device is checked for it.
    """
    from services.retriever.encoder import torch_cuda_problem
    from services.retriever.indexes import DeviceError, dense_gpu_problem, parse_device

    try:
        kind, gpu = parse_device(device)
    except DeviceError as exc:
        raise DeviceError(f"{key}: {exc}") from None
    if kind == "cpu" or index_type == "bm25":
        return
    problems = [torch_cuda_problem(gpu)]
    if index_on_device:
        problems.append(dense_gpu_problem(index_type or "flat", gpu))
    found = [p for p in problems if p]
    if found:
        raise DeviceError(f"{key} {device} cannot be used: " + "; ".join(found)
                          + ". Fix the install (docs/retriever.md, GPU) or use cpu.")


class Searcher:
    def __init__(self, manifest: dict[str, Any], docstore: DocStore, index: Any,
                 encoder: Any = None) -> None:
        self.manifest = manifest
        self.index_type: str = manifest["index_type"]
        self.docstore = docstore
        self.index = index
        self.encoder = encoder

    @classmethod
    def load(cls, index_dir: str | Path, device: str = "cpu", encoder: str | None = None,
             search_params: dict[str, int] | None = None, batch_size: int = 64,
             query_dtype: str = "float32") -> Searcher:
        """Load a built index; raises IndexLoadError naming what is missing or corrupt.

        `encoder` overrides the model path recorded at build time (an index copied to another
        machine); `search_params` overrides ef_search / nprobe; `query_dtype` is the precision
        queries are encoded in (the server resolves retriever.query_dtype's `auto`).
        """
        index_dir = Path(index_dir)
        manifest = check_index_dir(index_dir)
        params = {**manifest.get("params", {}), **(search_params or {})}
        try:
            docstore = DocStore(index_dir)
        except DocStoreError as exc:
            raise IndexLoadError(str(exc)) from None
        index_type = manifest["index_type"]
        model = None
        if index_type in DENSE_TYPES:
            try:
                index = load_dense(index_dir / FAISS_FILE, index_type, params, device)
            except RuntimeError as exc:
                raise IndexLoadError(f"{index_dir / FAISS_FILE} is corrupt: {exc}") from None
            from services.retriever.encoder import Encoder, default_encoder_path, encoder_name

            model_path = encoder or manifest["encoder"]
            default = default_encoder_path()
            if not Path(model_path).is_dir() and manifest.get("encoder_name") == encoder_name(
                default
            ):
                model_path = default  # the index was built elsewhere with the default model
            try:
                model = Encoder(model_path, device=device,
                                query_prefix=manifest.get("query_prefix", ""),
                                passage_prefix=manifest.get("passage_prefix", ""),
                                batch_size=batch_size, dtype=query_dtype)
            except (OSError, ValueError) as exc:
                raise IndexLoadError(f"cannot load encoder {model_path}: {exc}") from None
            if model.dim != manifest.get("dim"):
                raise IndexLoadError(
                    f"encoder {model_path} makes {model.dim}-d vectors, index has "
                    f"{manifest.get('dim')}-d"
                )
            size = index.ntotal
        else:
            try:
                index = BM25Index.load(index_dir / BM25_DIR)
            except (OSError, ValueError, KeyError) as exc:
                raise IndexLoadError(f"{index_dir / BM25_DIR} is corrupt: {exc}") from None
            size = index.size
        if size != manifest["count"]:
            raise IndexLoadError(
                f"{index_dir}: index holds {size} vectors, manifest says {manifest['count']}"
            )
        return cls(manifest, docstore, index, model)

    def __len__(self) -> int:
        return len(self.docstore)

    def set_search_params(self, params: dict[str, int]) -> None:
        if self.index_type in DENSE_TYPES:
            apply_search_params(self.index, self.index_type, params)

    def search(self, queries: list[str], topk: int) -> list[Result]:
        """Per query: [(doc, score), ...] best first; doc = {"id", "contents", ...}."""
        return self.search_many(queries, [topk] * len(queries))

    def search_many(self, queries: list[str], topks: list[int]) -> list[Result]:
        if len(queries) != len(topks):
            raise ValueError("one topk per query")
        if not queries:
            return []
        encoded = self.encode(queries)
        results: list[Result] = [[] for _ in queries]
        for k, positions in _group_by_k(topks).items():
            if k <= 0:
                continue
            if isinstance(encoded, np.ndarray):
                subset: Any = encoded[positions]
            else:
                subset = [encoded[p] for p in positions]
            scores, rows = self.search_encoded(subset, k)
            for position, score_row, id_row in zip(positions, scores, rows, strict=True):
                results[position] = [
                    (self.docstore.get(int(row)), float(score))
                    for row, score in zip(id_row, score_row, strict=True)
                    if row >= 0
                ]
        return results

    def encode(self, queries: list[str]) -> Any:
        """Query vectors (dense) or the queries themselves (BM25 tokenises at search time)."""
        if self.index_type in DENSE_TYPES:
            return self.encoder.encode_queries(queries)
        return list(queries)

    def search_encoded(self, encoded: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows), each n × k' with k' ≤ k; rows are -1 where fewer than k exist."""
        return self.index.search(encoded, min(k, len(self)))


def _group_by_k(topks: list[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for position, k in enumerate(topks):
        groups.setdefault(k, []).append(position)
    return groups
