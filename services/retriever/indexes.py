"""Index structures: FAISS Flat / HNSW / IVF over normalised vectors, and BM25 (bm25s).

Each builder reads vectors from the build's on-disk embedding matrix in chunks, so adding to
an index never needs a second full copy in Python memory. Search returns (scores, row ids)
with -1 rows removed by the caller (FAISS pads with -1 when fewer than k results exist).

GPU: `faiss-cpu` and `faiss-gpu-cu12` both install the `faiss` module, and with both installed
the CPU one can win; so the `cpu` and `gpu` extras each bring exactly one (pyproject.toml), and
an index asked for on `cuda` is never quietly served from CPU: `faiss_gpu_problem` says why a
device cannot be used, and the server refuses to start (services/retriever/searcher.py).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

DENSE_TYPES = ("flat", "hnsw", "ivf")
INDEX_TYPES = (*DENSE_TYPES, "bm25")
FAISS_FILE = "index.faiss"
BM25_DIR = "bm25"
ADD_CHUNK = 65536


def default_params(index_type: str, rows: int) -> dict[str, int]:
    """Build/search knobs recorded in the manifest (the server may override search ones).

    IVF: nlist ≈ 4·√n but at least 39 training points per list (FAISS's own warning limit);
    nprobe 32 lists. HNSW: M=32, efConstruction=200, efSearch=128 (recall ≈ 0.99 for
    MiniLM-size vectors at the corpus sizes a CPU box serves).
    """
    if index_type == "hnsw":
        return {"hnsw_m": 32, "ef_construction": 200, "ef_search": 128}
    if index_type == "ivf":
        nlist = max(1, min(int(4 * math.sqrt(max(rows, 1))), rows // 39))
        return {"nlist": nlist, "nprobe": min(nlist, 32)}
    return {}


class DeviceError(ValueError):
    """A device the index or encoder cannot run on; the message says what is missing."""


def import_faiss():
    try:
        import faiss
    except ImportError:
        raise DeviceError("faiss is not installed: install the cpu extra (faiss-cpu) or, on a "
                          "GPU node, the gpu extra (faiss-gpu-cu12)") from None
    return faiss


def faiss_gpu_problem(gpu: int | None = None) -> str | None:
    """Why this faiss cannot put an index on GPU `gpu` (None: on any GPU), or None if it can."""
    faiss = import_faiss()
    version = getattr(faiss, "__version__", "?")
    count = int(faiss.get_num_gpus()) if hasattr(faiss, "get_num_gpus") else 0
    if not hasattr(faiss, "StandardGpuResources"):
        return (f"faiss {version} has no GPU support (the faiss-cpu build is installed; a GPU "
                "node needs the gpu extra, which brings faiss-gpu-cu12 and no faiss-cpu)")
    if count == 0:
        return f"faiss {version} sees no GPU (faiss.get_num_gpus() is 0)"
    if gpu is not None and gpu >= count:
        return f"faiss {version} sees {count} GPU(s), not GPU {gpu}"
    return None


def dense_gpu_problem(index_type: str, gpu: int | None = None) -> str | None:
    """Why an index of `index_type` cannot be served from GPU(s), or None."""
    if index_type == "hnsw":
        return ("faiss has no GPU implementation of HNSW: serve an hnsw index on cpu, or "
                "build a flat or ivf index for a GPU")
    return faiss_gpu_problem(gpu)


def build_dense(index_type: str, vectors: np.ndarray, params: dict[str, int],
                progress: Callable[[int], None] | None = None, seed: int = 0):
    """A FAISS inner-product index over `vectors` (rows × dim, float32, may be a memmap)."""
    faiss = import_faiss()

    rows, dim = vectors.shape
    if index_type == "flat":
        index = faiss.IndexFlatIP(dim)
    elif index_type == "hnsw":
        index = faiss.IndexHNSWFlat(dim, params["hnsw_m"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = params["ef_construction"]
        index.hnsw.efSearch = params["ef_search"]
    elif index_type == "ivf":
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFFlat(quantizer, dim, params["nlist"], faiss.METRIC_INNER_PRODUCT)
        sample_size = min(rows, params["nlist"] * 256)
        rng = np.random.default_rng(seed)
        sample_rows = np.sort(rng.choice(rows, size=sample_size, replace=False))
        index.train(np.ascontiguousarray(vectors[sample_rows], dtype=np.float32))
        index.nprobe = params["nprobe"]
    else:
        raise ValueError(f"unknown dense index type {index_type!r}")
    for start in range(0, rows, ADD_CHUNK):
        chunk = np.ascontiguousarray(vectors[start : start + ADD_CHUNK], dtype=np.float32)
        index.add(chunk)
        if progress is not None:
            progress(len(chunk))
    return index


def apply_search_params(index, index_type: str, params: dict[str, int]) -> None:
    if index_type == "hnsw" and "ef_search" in params:
        index.hnsw.efSearch = int(params["ef_search"])
    elif index_type == "ivf" and "nprobe" in params:
        index.nprobe = int(params["nprobe"])


def parse_device(device: str) -> tuple[str, int | None]:
    """"cpu" -> ("cpu", None), "cuda" -> ("cuda", None: every visible GPU), "cuda:N" -> N."""
    kind, _, number = device.partition(":")
    if kind == "cpu" and not number:
        return "cpu", None
    if kind == "cuda" and (not number or number.isdigit()):
        return "cuda", int(number) if number else None
    raise DeviceError(f"unknown device {device!r} (use cpu, cuda or cuda:N)")


def load_dense(path: Path, index_type: str, params: dict[str, int], device: str = "cpu"):
    """Read the FAISS file; on `cuda`, shard it over every visible GPU (`cuda:N`: GPU N), in
    float16. A faiss without GPU support is a DeviceError, never a CPU fallback."""
    kind, gpu = parse_device(device)
    faiss = import_faiss()
    if kind == "cuda":
        problem = dense_gpu_problem(index_type, gpu)
        if problem:
            raise DeviceError(f"device {device}: {problem}")
    index = faiss.read_index(str(path))
    apply_search_params(index, index_type, params)
    if kind == "cuda":
        options = faiss.GpuMultipleClonerOptions()
        options.useFloat16 = True
        options.shard = True
        index = faiss.index_cpu_to_gpus_list(index, co=options,
                                             gpus=None if gpu is None else [gpu])
    return index


class BM25Index:
    """bm25s over the docstore's `contents`, with its tokenizer vocabulary saved alongside."""

    def __init__(self, retriever, tokenizer) -> None:
        self.retriever = retriever
        self.tokenizer = tokenizer
        # bm25s' tokenizer keeps Python caches that tokenize() may update; the search is
        # pure Python/numpy under the GIL anyway, so the server's workers take turns here.
        self._lock = threading.Lock()

    @classmethod
    def build(cls, texts: Iterable[str], rows: int, show_progress: bool = True) -> BM25Index:
        import bm25s
        from bm25s.tokenization import Tokenizer

        tokenizer = Tokenizer(stopwords="en")
        ids = tokenizer.tokenize(texts, length=rows, return_as="ids", show_progress=show_progress)
        retriever = bm25s.BM25()
        retriever.index(ids, show_progress=show_progress)
        return cls(retriever, tokenizer)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.retriever.save(str(directory), show_progress=False)
        self.tokenizer.save_vocab(str(directory))
        self.tokenizer.save_stopwords(str(directory))

    @classmethod
    def load(cls, directory: Path) -> BM25Index:
        import bm25s
        from bm25s.tokenization import Tokenizer

        retriever = bm25s.BM25.load(str(directory), mmap=True, show_progress=False)
        tokenizer = Tokenizer(stopwords=[])
        tokenizer.load_vocab(str(directory))
        tokenizer.load_stopwords(str(directory))
        return cls(retriever, tokenizer)

    @property
    def size(self) -> int:
        return int(self.retriever.scores["num_docs"])

    def search(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        k = min(k, self.size)
        if not queries or k <= 0:
            return np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int64)
        with self._lock:
            tokens = self.tokenizer.tokenize(
                queries, update_vocab=False, return_as="ids", show_progress=False
            )
            rows, scores = self.retriever.retrieve(tokens, k=k, show_progress=False,
                                                   n_threads=1)
        scores = np.asarray(scores, dtype=np.float32)
        rows = np.asarray(rows, dtype=np.int64)
        # Like Lucene, only passages sharing a term with the query are hits; bm25s pads with
        # arbitrary zero-score rows, which would be noise in the agent's observation.
        rows[scores <= 0] = -1
        return scores, rows
