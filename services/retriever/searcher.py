"""In-process search over a built index: the server's engine, and the data builder's API.

`search_many` is the server's micro-batch entry point: one encoder call for every query in the
batch, then one index search per distinct (topk, nprobe, efSearch) (so each request gets exactly
what it would get alone, even for approximate indexes whose results depend on k).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from services.retriever.docstore import DocStore, DocStoreError
from services.retriever.indexes import (
    BM25_DIR,
    DEFAULT_K_FACTOR,
    FAISS_FILE,
    REFINE_FILE,
    BM25Index,
    apply_search_params,
    is_dense,
    load_dense,
    open_refine,
    rerank_exact,
    search_knobs,
    search_parameters,
)
from services.retriever.manifest import IndexLoadError, check_index_dir

Result = list[tuple[dict[str, Any], float]]
# Per-query search settings: (nprobe, ef_search), None meaning the index's default.
SearchOptions = tuple[int | None, int | None]
NO_OPTIONS: SearchOptions = (None, None)


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


def check_placement(device: str, index_type: str | None = None, *,
                    encoder_device: str | None = None, index_device: str | None = None,
                    key: str = "retriever.device",
                    encoder_key: str = "retriever.encoder_device",
                    index_key: str = "retriever.index_device") -> None:
    """check_device for a split placement: the encoder on `encoder_device` (torch) and the
    dense index on `index_device` (faiss), each defaulting to `device`. With neither set this
    is check_device(device, ...) itself, message for message. Every problem is named, with
    the setting it comes from (`key`, `encoder_key`, `index_key`: how the caller's user sets
    each), in one DeviceError."""
    if encoder_device is None and index_device is None:
        check_device(device, index_type, key=key)
        return
    from services.retriever.encoder import torch_cuda_problem
    from services.retriever.indexes import (
        DeviceError,
        dense_gpu_problem,
        parse_device,
        parse_index_device,
    )

    encoder_key = encoder_key if encoder_device is not None else key
    index_key = index_key if index_device is not None else key
    encoder_device = encoder_device or device
    index_device = index_device or device
    try:
        encoder_kind, encoder_gpu = parse_device(encoder_device)
    except DeviceError as exc:
        raise DeviceError(f"{encoder_key}: {exc}") from None
    try:
        index_kind, index_gpu = parse_index_device(index_device)
    except DeviceError as exc:
        raise DeviceError(f"{index_key}: {exc}") from None
    if index_type == "bm25":
        return
    found = []
    if encoder_kind == "cuda":
        problem = torch_cuda_problem(encoder_gpu)
        if problem:
            found.append(f"{encoder_key} {encoder_device} cannot be used: {problem}")
    if index_kind == "cuda":
        problem = dense_gpu_problem(index_type or "flat", index_gpu)
        if problem:
            found.append(f"{index_key} {index_device} cannot be used: {problem}")
    if found:
        raise DeviceError("; ".join(found) + ". Fix the install (docs/retriever.md, GPU) or "
                          "use cpu.")


class Searcher:
    def __init__(self, manifest: dict[str, Any], docstore: DocStore, index: Any,
                 encoder: Any = None, refine: np.ndarray | None = None,
                 k_factor: int = DEFAULT_K_FACTOR) -> None:
        self.manifest = manifest
        self.index_type: str = manifest["index_type"]
        self.docstore = docstore
        self.index = index
        self.encoder = encoder
        # Exact re-ranking (indexes.py, `rerank_exact`): the build's vectors, memory-mapped,
        # and how many candidates per result the compressed index is asked for.
        self.refine = refine
        self.k_factor = k_factor
        # Which per-search knobs this index has; none on GPU, where FAISS's sharded clones
        # take no SearchParameters (set retriever.nprobe instead).
        self.knobs: frozenset[str] = frozenset()
        if is_dense(self.index_type) and hasattr(index, "is_trained"):
            try:
                self.knobs = search_knobs(index)
            except Exception:  # noqa: BLE001 (a GPU index: no per-request knobs)
                self.knobs = frozenset()

    @classmethod
    def load(cls, index_dir: str | Path, device: str = "cpu", encoder: str | None = None,
             search_params: dict[str, int] | None = None, batch_size: int = 64,
             query_dtype: str = "float32", mmap: bool = False,
             encoder_device: str | None = None, index_device: str | None = None,
             index_gpu_mode: str = "shard") -> Searcher:
        """Load a built index; raises IndexLoadError naming what is missing or corrupt.

        `encoder` overrides the model path recorded at build time (an index copied to another
        machine); `search_params` overrides ef_search / nprobe (an index without that knob is
        an IndexLoadError, so a setting never silently does nothing); `query_dtype` is the
        precision queries are encoded in (the server resolves retriever.query_dtype's `auto`);
        `mmap` maps the FAISS file instead of reading it (indexes.mmap_flag says which kinds).
        `encoder_device` / `index_device` place the encoder and the FAISS index apart (each
        defaults to `device`); `index_gpu_mode` shards or replicates an index over several GPUs.
        """
        encoder_device = encoder_device or device
        index_device = index_device or device
        index_dir = Path(index_dir)
        manifest = check_index_dir(index_dir)
        overrides = {k: v for k, v in (search_params or {}).items() if v is not None}
        params = {**manifest.get("params", {}), **overrides}
        try:
            docstore = DocStore(index_dir)
        except DocStoreError as exc:
            raise IndexLoadError(str(exc)) from None
        index_type = manifest["index_type"]
        model = None
        refine = None
        if is_dense(index_type):
            try:
                index = load_dense(index_dir / FAISS_FILE, index_type, params, index_device,
                                   mmap, gpu_mode=index_gpu_mode)
            except RuntimeError as exc:
                raise IndexLoadError(f"{index_dir / FAISS_FILE} is corrupt: {exc}") from None
            except ValueError as exc:  # a kind that cannot be mapped
                raise IndexLoadError(str(exc)) from None
            if overrides.get("k_factor") is not None and not params.get("refine"):
                raise IndexLoadError(
                    f"retriever.k_factor is set but the {index_type} index was built without "
                    "--refine (no vectors to re-rank with); unset it or rebuild with --refine")
            if params.get("refine"):
                try:
                    refine = open_refine(index_dir / REFINE_FILE, int(manifest["count"]),
                                         int(manifest["dim"]))
                except ValueError as exc:
                    raise IndexLoadError(str(exc)) from None
            if index_device == "cpu" or index_device.startswith("cpu"):
                have = search_knobs(index)
                for knob in overrides:
                    if knob in ("nprobe", "ef_search") and knob not in have:
                        raise IndexLoadError(
                            f"retriever.{knob} is set but the {index_type} index has no "
                            f"{'inverted lists' if knob == 'nprobe' else 'HNSW graph'}; "
                            "unset it")
            from services.retriever.encoder import Encoder, default_encoder_path, encoder_name

            model_path = encoder or manifest["encoder"]
            default = default_encoder_path()
            if not Path(model_path).is_dir() and manifest.get("encoder_name") == encoder_name(
                default
            ):
                model_path = default  # the index was built elsewhere with the default model
            try:
                model = Encoder(model_path, device=encoder_device,
                                query_prefix=manifest.get("query_prefix", ""),
                                passage_prefix=manifest.get("passage_prefix", ""),
                                batch_size=batch_size, dtype=query_dtype,
                                pooling=manifest.get("pooling") or "model",
                                normalize=manifest.get("normalize", True),
                                max_length=manifest.get("query_max_length"))
            except (OSError, ValueError) as exc:
                raise IndexLoadError(f"cannot load encoder {model_path}: {exc}") from None
            if model.dim != manifest.get("dim"):
                raise IndexLoadError(
                    f"encoder {model_path} makes {model.dim}-d vectors, index has "
                    f"{manifest.get('dim')}-d"
                )
            size = index.ntotal
        else:
            if overrides:
                raise IndexLoadError(f"retriever.{next(iter(overrides))} is set but a bm25 "
                                     "index has no such setting; unset it")
            try:
                index = BM25Index.load(index_dir / BM25_DIR)
            except (OSError, ValueError, KeyError) as exc:
                raise IndexLoadError(f"{index_dir / BM25_DIR} is corrupt: {exc}") from None
            size = index.size
        if size != manifest["count"]:
            raise IndexLoadError(
                f"{index_dir}: index holds {size} vectors, manifest says {manifest['count']}"
            )
        return cls(manifest, docstore, index, model, refine,
                   int(params.get("k_factor") or DEFAULT_K_FACTOR))

    def __len__(self) -> int:
        return len(self.docstore)

    def set_search_params(self, params: dict[str, int]) -> None:
        if is_dense(self.index_type):
            apply_search_params(self.index, params)

    def search(self, queries: list[str], topk: int) -> list[Result]:
        """Per query: [(doc, score), ...] best first; doc = {"id", "contents", ...}."""
        return self.search_many(queries, [topk] * len(queries))

    def search_many(self, queries: list[str], topks: list[int],
                    options: list[SearchOptions] | None = None) -> list[Result]:
        """`options[i]` = (nprobe, ef_search) for query i (None: the index's defaults); the
        caller has checked them against `knobs`."""
        if len(queries) != len(topks):
            raise ValueError("one topk per query")
        if options is not None and len(options) != len(queries):
            raise ValueError("one options entry per query")
        if not queries:
            return []
        encoded = self.encode(queries)
        results: list[Result] = [[] for _ in queries]
        keys = list(zip(topks, options or [NO_OPTIONS] * len(queries), strict=True))
        for (k, option), positions in _group_by_k(keys).items():
            if k <= 0:
                continue
            if isinstance(encoded, np.ndarray):
                subset: Any = encoded[positions]
            else:
                subset = [encoded[p] for p in positions]
            scores, rows = self.search_encoded(subset, k, option)
            for position, score_row, id_row in zip(positions, scores, rows, strict=True):
                results[position] = [
                    (self.docstore.get(int(row)), float(score))
                    for row, score in zip(id_row, score_row, strict=True)
                    if row >= 0
                ]
        return results

    def encode(self, queries: list[str]) -> Any:
        """Query vectors (dense) or the queries themselves (BM25 tokenises at search time)."""
        if is_dense(self.index_type):
            return self.encoder.encode_queries(queries)
        return list(queries)

    def search_encoded(self, encoded: Any, k: int, options: SearchOptions | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows), each n × k' with k' ≤ k; rows are -1 where fewer than k exist.

        Per-search nprobe / efSearch go in as FAISS SearchParameters, never set on the index:
        the server's workers search this index object at the same time."""
        k = min(k, len(self))
        fetch = k if self.refine is None else min(k * self.k_factor, len(self))
        if options is None or options == NO_OPTIONS:
            scores, rows = self.index.search(encoded, fetch)
        else:
            params, keep = search_parameters(self.index, *options)
            scores, rows = self.index.search(encoded, fetch, params=params)
            del keep
        if self.refine is not None:
            return rerank_exact(self.refine, encoded, rows, k)
        return scores, rows


def _group_by_k(topks: list[Any]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for position, k in enumerate(topks):
        groups.setdefault(k, []).append(position)
    return groups
