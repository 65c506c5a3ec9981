"""Index structures: FAISS Flat / HNSW / IVF over normalised vectors, and BM25 (bm25s).

Each builder reads vectors from the build's on-disk embedding matrix in chunks, so adding to
an index never needs a second full copy in Python memory. Search returns (scores, row ids)
with -1 rows removed by the caller (FAISS pads with -1 when fewer than k results exist).

GPU: `faiss-cpu` and `faiss-cuda` both install the `faiss` module, and with both installed
the CPU one can win; so the `cpu` and `gpu` extras each bring exactly one (pyproject.toml), and
an index asked for on `cuda` is never quietly served from CPU: `faiss_gpu_problem` says why a
device cannot be used, and the server refuses to start (services/retriever/searcher.py).

Compressed kinds: besides the three named kinds built as before, `--index` takes a FAISS
index-factory string ("IVF4096,PQ64", "OPQ64,IVF4096,PQ64", "HNSW32,SQ8", ...) or a preset
that names one with sizes chosen from the corpus (`PRESETS`). They are all built the same way
(`build_factory`): trained on a seeded sample whose size and seed go into the manifest, then
filled in streamed chunks. Query-time knobs (nprobe, efSearch) are found on the built index
itself (`search_knobs`), so they work for any factory string, and per-request values are
passed as FAISS SearchParameters rather than set on the shared index, because the server's
workers search the same index object concurrently.

Exact re-ranking (`refine`): a compressed kind built with `build-index --refine` keeps the
build's float32 embedding matrix beside the index (`refine.npy`, memory-mapped at serve time,
never read into memory). A search then asks the compressed index for `k_factor` × k
candidates and re-ranks them by their exact inner product (`rerank_exact`), so the scores and
order are the flat index's whenever the true top-k is among the candidates. Memory holds the
compressed codes; the full vectors stay on disk and only the candidates' rows are read.
"""

from __future__ import annotations

import math
import mmap
import re
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

DENSE_TYPES = ("flat", "hnsw", "ivf")
# Named compressed kinds; each stands for a factory string sized from the corpus (`factory_for`).
PRESETS = ("ivf-pq", "ivf-sq8", "ivf-sqfp16", "hnsw-sq8")
NAMED_TYPES = (*DENSE_TYPES, *PRESETS, "bm25")
INDEX_TYPES = (*DENSE_TYPES, "bm25")  # the kinds built by their own code path (before presets)
FAISS_FILE = "index.faiss"
BM25_DIR = "bm25"
ADD_CHUNK = 65536
# Training sample cap: 1 Mi vectors is 3 GiB at 768-d fp32, and k-means gains little beyond.
MAX_TRAIN = 1 << 20
TRAIN_SEED = 0
# Exact re-ranking from the embedding matrix kept on disk (module docstring).
REFINE_FILE = "refine.npy"
DEFAULT_K_FACTOR = 10
# Kinds whose codes are the vectors themselves: re-ranking them with the same vectors changes
# nothing and only costs the disk.
EXACT_KINDS = ("flat", "hnsw", "ivf")


class IndexSpecError(ValueError):
    """An `--index` value that is neither a named kind nor a FAISS factory string FAISS accepts
    for this encoder's dimension; the message is one line and names it."""


def is_dense(index_type: str) -> bool:
    """Every kind but BM25 is a FAISS index over the encoder's vectors."""
    return index_type != "bm25"


def is_factory(index_type: str) -> bool:
    """A preset or a factory string: built by `build_factory` (flat/hnsw/ivf keep their own)."""
    return is_dense(index_type) and index_type not in DENSE_TYPES


def _nlist(rows: int) -> int:
    """≈ 4·√n lists, but at least 39 training points per list (FAISS's own warning limit)."""
    return max(1, min(int(4 * math.sqrt(max(rows, 1))), rows // 39))


def _pq_m(dim: int) -> int:
    """PQ sub-quantizers: the largest divisor of `dim` up to 64 (64 bytes a vector at 8 bits,
    1.3 GB of codes for wiki-18)."""
    return max(m for m in range(1, min(dim, 64) + 1) if dim % m == 0)


def factory_for(index_type: str, rows: int, dim: int, nlist: int | None = None,
                hnsw_m: int | None = None) -> str:
    """The FAISS factory string a preset stands for (a factory string stands for itself).

    PQ codes use 8 bits (256 centroids per sub-quantizer) once the corpus has 30·256 vectors
    to train them, else 4 bits, so that a tiny corpus still builds.
    """
    nlist = nlist or _nlist(rows)
    if index_type == "ivf-pq":
        bits = 8 if rows >= 30 * 256 else 4
        return f"IVF{nlist},PQ{_pq_m(dim)}" + ("" if bits == 8 else f"x{bits}")
    if index_type == "ivf-sq8":
        return f"IVF{nlist},SQ8"
    if index_type == "ivf-sqfp16":
        return f"IVF{nlist},SQfp16"
    if index_type == "hnsw-sq8":
        return f"HNSW{hnsw_m or 32},SQ8"
    return index_type


def _factory_shape(factory: str) -> dict[str, int]:
    """What a factory string says about training: IVF lists, HNSW M, PQ bits (0 if none)."""
    shape = {"nlist": 0, "hnsw_m": 0, "pq_bits": 0}
    if match := re.search(r"IVF(\d+)", factory):
        shape["nlist"] = int(match.group(1))
    if match := re.search(r"HNSW(\d+)", factory):
        shape["hnsw_m"] = int(match.group(1))
    if match := re.search(r"PQ\d+(?:x(\d+))?", factory):
        shape["pq_bits"] = int(match.group(1) or 8)
    return shape


def check_factory(index_type: str, dim: int) -> str:
    """`index_type` if FAISS can make an inner-product index of it for `dim`-d vectors, else
    IndexSpecError (one line: the value, the named kinds, and FAISS's own reason)."""
    if index_type in NAMED_TYPES:
        return index_type
    faiss = import_faiss()
    try:
        faiss.index_factory(dim, index_type, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else "rejected"
        reason = re.sub(r"^Error in .*? at \S+:\d+: ", "", reason)
        raise IndexSpecError(
            f"--index {index_type!r}: not a named index type ({', '.join(NAMED_TYPES)}) nor a "
            f"FAISS index-factory string for {dim}-d vectors ({reason})"
        ) from None
    return index_type


def default_params(index_type: str, rows: int, dim: int | None = None,
                   overrides: dict[str, int | str] | None = None) -> dict[str, int | str]:
    """Build/search knobs recorded in the manifest (the server may override search ones).

    IVF: nlist ≈ 4·√n but at least 39 training points per list (FAISS's own warning limit);
    nprobe 32 lists. HNSW: M=32, efConstruction=200, efSearch=128 (recall ≈ 0.99 for
    MiniLM-size vectors at the corpus sizes a CPU box serves). Factory kinds (`dim` needed)
    also record their factory string and training sample: max(39·nlist, 30·2^bits for PQ,
    10,000), at most MAX_TRAIN and the corpus, drawn with seed TRAIN_SEED. A preset takes
    `overrides`' nlist / hnsw_m into its factory string; a factory string already says them,
    so a different value is a ValueError rather than a knob that silently does nothing.
    """
    overrides = overrides or {}
    if index_type == "hnsw":
        return {"hnsw_m": 32, "ef_construction": 200, "ef_search": 128}
    if index_type == "ivf":
        nlist = _nlist(rows)
        return {"nlist": nlist, "nprobe": min(nlist, 32)}
    if not is_factory(index_type):
        return {}
    if dim is None:
        raise ValueError(f"{index_type}: the vector dimension is needed for its parameters")
    nlist, hnsw_m = overrides.get("nlist"), overrides.get("hnsw_m")
    factory = factory_for(index_type, rows, dim, int(nlist) if nlist else None,
                          int(hnsw_m) if hnsw_m else None)
    shape = _factory_shape(factory)
    for key in ("nlist", "hnsw_m"):
        if overrides.get(key) is not None and int(overrides[key]) != shape[key]:
            raise ValueError(f"--{key.replace('_', '-')} {overrides[key]} does not match the "
                             f"factory string {factory!r}: write the size in the string")
    params: dict[str, int | str] = {"factory": factory}
    if shape["nlist"]:
        params.update(nlist=shape["nlist"], nprobe=min(shape["nlist"], 32))
    if shape["hnsw_m"]:
        params.update(ef_construction=200, ef_search=128)
    need = max(39 * shape["nlist"], 30 * (1 << shape["pq_bits"]) if shape["pq_bits"] else 0,
               10_000)
    params.update(train_size=min(rows, need, MAX_TRAIN), train_seed=TRAIN_SEED)
    return params


def refine_params(index_type: str, refine: bool, k_factor: int | None
                  ) -> dict[str, int | str]:
    """The manifest params of exact re-ranking: {} without `refine`; a ValueError naming the
    problem for a kind that would gain nothing (exact codes, BM25) or a k_factor < 1, or a
    k_factor given without `refine`."""
    if not refine:
        if k_factor is not None:
            raise ValueError("--k-factor is the re-ranking depth of --refine; add --refine or "
                             "drop --k-factor")
        return {}
    if not is_dense(index_type):
        raise ValueError("--refine re-ranks dense vectors; a bm25 index has none")
    if index_type in EXACT_KINDS or re.fullmatch(r"(HNSW\d+(,Flat)?|Flat|IVF\d+,Flat)",
                                                 index_type):
        raise ValueError(f"--refine re-ranks a compressed index's candidates; {index_type} "
                         "already stores the exact vectors")
    factor = DEFAULT_K_FACTOR if k_factor is None else int(k_factor)
    if factor < 1:
        raise ValueError(f"--k-factor {factor}: at least 1 candidate per result is needed")
    return {"refine": "flat", "k_factor": factor}


def rerank_exact(vectors: np.ndarray, queries: np.ndarray, candidates: np.ndarray, k: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows), each n × k, best first: the candidates of each query (rows of
    `vectors`, -1 = none, as FAISS pads) re-scored by their exact inner product with the
    query; -1 / -inf where a query had fewer than k candidates. `vectors` may be a memmap:
    each query reads its candidates' rows in ascending order (near rows share disk pages), and
    equal scores keep the lower row first, as a flat index orders them."""
    count = len(queries)
    scores = np.full((count, k), -np.inf, dtype=np.float32)
    rows = np.full((count, k), -1, dtype=np.int64)
    for position in range(count):
        found = np.unique(candidates[position][candidates[position] >= 0])
        if not len(found):
            continue
        exact = np.asarray(vectors[found], dtype=np.float32) @ np.asarray(
            queries[position], dtype=np.float32)
        best = np.argsort(-exact, kind="stable")[:k]
        scores[position, : len(best)] = exact[best]
        rows[position, : len(best)] = found[best]
    return scores, rows


def open_refine(path: Path, count: int, dim: int) -> np.ndarray:
    """The re-ranking matrix, memory-mapped read-only; a ValueError naming the file when it is
    not a count × dim float32 matrix (a partial copy, another build's file)."""
    try:
        matrix = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot map the re-ranking vectors: {exc}") from None
    if matrix.dtype != np.float32 or matrix.shape != (count, dim):
        raise ValueError(f"{path}: holds a {matrix.dtype} {matrix.shape} matrix, the index needs "
                         f"float32 ({count}, {dim})")
    advise_random_reads(matrix)
    return matrix


def advise_random_reads(matrix: np.ndarray) -> None:
    """Tell the kernel the mapping is read at random (madvise MADV_RANDOM). Re-ranking reads
    k_factor × topk scattered rows a query; by default each fault on a page not in memory also
    reads the device's read-ahead window around it (read_ahead_kb): with 8 MiB of read-ahead a
    cold query read 681 MiB for its 100 rows instead of about 180 pages (bench/ivf_nprobe.py),
    which matters exactly where refine is for, a file larger than memory. No-op where the
    array is not a file mapping or the platform has no madvise."""
    mapped = getattr(matrix, "_mmap", None)  # numpy's memmap keeps its mmap.mmap here
    if mapped is not None and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)


class DeviceError(ValueError):
    """A device the index or encoder cannot run on; the message says what is missing."""


def import_faiss():
    try:
        import faiss
    except ImportError:
        raise DeviceError("faiss is not installed: install the cpu extra (faiss-cpu) or, on a "
                          "GPU node, the gpu extra (faiss-cuda)") from None
    return faiss


def faiss_gpu_problem(gpu: int | None = None) -> str | None:
    """Why this faiss cannot put an index on GPU `gpu` (None: on any GPU), or None if it can."""
    faiss = import_faiss()
    version = getattr(faiss, "__version__", "?")
    count = int(faiss.get_num_gpus()) if hasattr(faiss, "get_num_gpus") else 0
    if not hasattr(faiss, "StandardGpuResources"):
        return (f"faiss {version} has no GPU support (the faiss-cpu build is installed; a GPU "
                "node needs the gpu extra, which brings faiss-cuda and no faiss-cpu)")
    if count == 0:
        return f"faiss {version} sees no GPU (faiss.get_num_gpus() is 0)"
    if gpu is not None and gpu >= count:
        return f"faiss {version} sees {count} GPU(s), not GPU {gpu}"
    return None


def dense_gpu_problem(index_type: str, gpu: int | None = None) -> str | None:
    """Why an index of `index_type` cannot be served from GPU(s), or None."""
    if index_type == "hnsw" or "hnsw" in index_type.lower():
        return (f"faiss has no GPU implementation of HNSW: serve the {index_type} index on cpu, "
                "or build a flat or IVF index for a GPU")
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
    return _add_in_chunks(index, vectors, rows, progress)


def build_factory(factory: str, vectors: np.ndarray, params: dict[str, int | str],
                  progress: Callable[[int], None] | None = None,
                  log: Callable[[str], None] | None = None):
    """A FAISS inner-product index of a factory string over `vectors` (rows × dim, float32,
    may be a memmap): trained on `params["train_size"]` rows drawn with `train_seed` (read
    from the memmap sorted, so the sample costs one pass), then filled ADD_CHUNK rows at a
    time so only one chunk is ever copied into Python memory."""
    faiss = import_faiss()
    rows, dim = vectors.shape
    index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    inner = _innermost(faiss, index)
    if hasattr(inner, "hnsw") and "ef_construction" in params:
        inner.hnsw.efConstruction = int(params["ef_construction"])
    # The factory turns on polysemous training for PQ kinds: a simulated annealing of each
    # codebook's order (≈0.4 s per sub-quantizer whatever the corpus size) that only helps
    # polysemous (Hamming-filtered) search, which Forage never uses.
    for node in (inner, _ivf_or_none(faiss, inner)):
        if node is not None and hasattr(node, "do_polysemous_training"):
            node.do_polysemous_training = False
    if not index.is_trained:
        size = min(rows, int(params.get("train_size", rows)))
        rng = np.random.default_rng(int(params.get("train_seed", TRAIN_SEED)))
        sample_rows = np.sort(rng.choice(rows, size=size, replace=False))
        if log is not None:
            log(f"training {factory} on {size} sampled vectors (seed "
                f"{params.get('train_seed', TRAIN_SEED)})")
        index.train(np.ascontiguousarray(vectors[sample_rows], dtype=np.float32))
    apply_search_params(index, {k: v for k, v in params.items()
                                if k in ("nprobe", "ef_search")})
    return _add_in_chunks(index, vectors, rows, progress)


def _ivf_or_none(faiss, index):
    try:
        return faiss.downcast_index(faiss.extract_index_ivf(index))
    except RuntimeError:
        return None


def _innermost(faiss, index):
    """The index under any pre-transform (OPQ, PCA), downcast to its concrete class."""
    index = faiss.downcast_index(index)
    while isinstance(index, faiss.IndexPreTransform):
        index = faiss.downcast_index(index.index)
    return index


def search_knobs(index) -> frozenset[str]:
    """Which of "nprobe" (inverted lists) and "ef_search" (HNSW graph) this index has; read
    from the index, not the kind's name, so any factory string gets its knobs."""
    faiss = import_faiss()
    knobs = set()
    try:
        faiss.extract_index_ivf(index)
        knobs.add("nprobe")
    except RuntimeError:
        pass
    if hasattr(_innermost(faiss, index), "hnsw"):
        knobs.add("ef_search")
    return frozenset(knobs)


def apply_search_params(index, params: dict[str, int | str]) -> None:
    """Set the index's own default nprobe / efSearch (FAISS ParameterSpace, which reaches
    through pre-transforms); a knob the index lacks is skipped: callers check `search_knobs`."""
    faiss = import_faiss()
    knobs = search_knobs(index)
    space = faiss.ParameterSpace()
    if "nprobe" in knobs and params.get("nprobe") is not None:
        space.set_index_parameter(index, "nprobe", int(params["nprobe"]))
    if "ef_search" in knobs and params.get("ef_search") is not None:
        space.set_index_parameter(index, "efSearch", int(params["ef_search"]))


def search_parameters(index, nprobe: int | None = None, ef_search: int | None = None):
    """FAISS SearchParameters for one search (None: the index's defaults), nested through
    pre-transforms. Returned with the Python objects it points at, which must outlive the
    search (SWIG does not keep nested parameter objects alive)."""
    if nprobe is None and ef_search is None:
        return None, []
    faiss = import_faiss()
    keep: list = []
    wrappers: list = []
    node = faiss.downcast_index(index)
    while isinstance(node, faiss.IndexPreTransform):
        wrappers.append(faiss.SearchParametersPreTransform())
        node = faiss.downcast_index(node.index)
    if hasattr(node, "hnsw"):
        leaf = faiss.SearchParametersHNSW()
        leaf.efSearch = int(ef_search if ef_search is not None else node.hnsw.efSearch)
    else:
        leaf = faiss.SearchParametersIVF()
        leaf.nprobe = int(nprobe if nprobe is not None else faiss.extract_index_ivf(node).nprobe)
        quantizer = faiss.downcast_index(faiss.extract_index_ivf(node).quantizer)
        if ef_search is not None and hasattr(quantizer, "hnsw"):
            inner = faiss.SearchParametersHNSW()
            inner.efSearch = int(ef_search)
            leaf.quantizer_params = inner
            keep.append(inner)
    keep.append(leaf)
    current = leaf
    for wrapper in reversed(wrappers):
        wrapper.index_params = current
        keep.append(wrapper)
        current = wrapper
    return current, keep


def mmap_flag(index_type: str, factory: str | None) -> int:
    """The FAISS read flag that maps this kind's bulk from the file instead of copying it.

    IVF kinds (ivf, ivf-*, any factory string with IVF): IO_FLAG_MMAP maps the inverted lists,
    i.e. every code. flat, hnsw and HNSW factory kinds (hnsw-sq8): IO_FLAG_MMAP_IFC maps the
    file as well: the vectors and, in FAISS 1.15, an HNSW graph's links too (measured: a
    mapped HNSW process adds about 1 MB of private memory; bench/index_scale.py). Raises
    ValueError for a kind with neither (e.g. a bare "PQ64" or "LSH" factory string).
    """
    faiss = import_faiss()
    spec = factory or index_type
    if index_type == "ivf" or "IVF" in spec:
        return faiss.IO_FLAG_MMAP
    if index_type in ("flat", "hnsw") or re.fullmatch(r"(HNSW\d+(,(Flat|SQ\w+))?|Flat)", spec):
        if not hasattr(faiss, "IO_FLAG_MMAP_IFC"):
            raise ValueError(f"retriever.mmap: faiss {faiss.__version__} cannot map a {spec} "
                             "index (IO_FLAG_MMAP_IFC is newer); map an IVF kind, or set "
                             "retriever.mmap to false")
        return faiss.IO_FLAG_MMAP_IFC
    raise ValueError(f"retriever.mmap: index kind {spec!r} cannot be memory-mapped (IVF kinds, "
                     "flat, hnsw and HNSW,Flat/SQ kinds can); set retriever.mmap to false")


def parse_device(device: str) -> tuple[str, int | None]:
    """"cpu" -> ("cpu", None), "cuda" -> ("cuda", None: every visible GPU), "cuda:N" -> N."""
    kind, _, number = device.partition(":")
    if kind == "cpu" and not number:
        return "cpu", None
    if kind == "cuda" and (not number or number.isdigit()):
        return "cuda", int(number) if number else None
    raise DeviceError(f"unknown device {device!r} (use cpu, cuda or cuda:N)")


def parse_index_device(device: str) -> tuple[str, int | None]:
    """parse_device, plus "cuda:all" (the same as "cuda": every visible GPU)."""
    if device == "cuda:all":
        return "cuda", None
    try:
        return parse_device(device)
    except DeviceError:
        raise DeviceError(f"unknown device {device!r} (use cpu, cuda, cuda:N or cuda:all)"
                          ) from None


def load_dense(path: Path, index_type: str, params: dict[str, int | str], device: str = "cpu",
               mmap: bool = False, gpu_mode: str = "shard"):
    """Read the FAISS file; on `cuda` / `cuda:all`, put it on every visible GPU (`cuda:N`: GPU
    N), in float16: `gpu_mode` "shard" splits the vectors between the GPUs, "replicate" gives
    each a full copy (one GPU: the same either way). A faiss without GPU support is a
    DeviceError, never a CPU fallback. `mmap` maps the file instead of reading it (CPU only;
    `mmap_flag` says which kinds): the replica starts without reading the codes, and
    processes on one host share the pages."""
    kind, gpu = parse_index_device(device)
    if gpu_mode not in ("shard", "replicate"):
        raise DeviceError(f"retriever.index_gpu_mode {gpu_mode!r}: use shard or replicate")
    faiss = import_faiss()
    if kind == "cuda":
        problem = dense_gpu_problem(index_type, gpu)
        if problem:
            raise DeviceError(f"device {device}: {problem}")
        if mmap:
            raise DeviceError("retriever.mmap is for cpu: a GPU copies the index into its own "
                              "memory; set retriever.mmap to false")
    flag = mmap_flag(index_type, params.get("factory")) if mmap else 0  # type: ignore[arg-type]
    index = faiss.read_index(str(path), flag)
    apply_search_params(index, params)
    if kind == "cuda":
        index = _to_gpus(faiss, index, gpu, gpu_mode)
    return index


def _to_gpus(faiss, index, gpu: int | None, gpu_mode: str):
    """The CPU index cloned onto GPU `gpu`, or onto all of them (None). Not run in Forage's CI
    (no GPU faiss there); the calls are faiss's documented multi-GPU API."""
    options = faiss.GpuMultipleClonerOptions()
    options.useFloat16 = True
    options.shard = gpu_mode == "shard"
    if gpu is None:
        return faiss.index_cpu_to_all_gpus(index, co=options)
    return faiss.index_cpu_to_gpus_list(index, co=options, gpus=[gpu])


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


def _add_in_chunks(index: Any, vectors: Any, rows: int,
                   progress: Callable[[int], None] | None) -> Any:
    """Add the vectors ADD_CHUNK rows at a time (a float32 copy of one chunk at most), telling
    `progress` after each."""
    for start in range(0, rows, ADD_CHUNK):
        chunk = np.ascontiguousarray(vectors[start : start + ADD_CHUNK], dtype=np.float32)
        index.add(chunk)
        if progress is not None:
            progress(len(chunk))
    return index
