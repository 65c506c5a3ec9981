"""IVF-PQ with exact re-ranking (`build-index --index ivf-pq --refine`): recall@10 against exact
search as nlist and nprobe vary, and the re-ranking's page reads from a cold cache.

    .venv/bin/python bench/ivf_nprobe.py synthetic [--n 1000000] [--dim 768]
        [--nlist 873,4000] [--nprobe 1,2,4,8,16,32,64,128,256] [--k-factor 10] [--reads 16]
    .venv/bin/python bench/ivf_nprobe.py text [--passages 60000] [--max-length 128]
        [--encode-minutes 20] [--cache /tmp/forage-text-vectors] [--nlist ...] [--nprobe ...]

Why: the build's rule puts nlist ≈ 4·√N lists (services/retriever/indexes.py) and the shipped
nprobe is 32 at every size, so the share of the corpus a search scans falls as N grows: wiki-18
(21,015,324 rows) gets nlist 18,336 and scans 32/18,336 = 0.17% of it, where a 1M build scans
32/4000 = 0.8%. A 21M build does not fit this bench, so it measures the two ways of carrying
wiki-18's setting down to N rows, and reports both:
- same share probed: nlist as the rule gives for N; nprobe p here stands for
  p × 18,336 / nlist at wiki-18 (pessimistic where lists are smaller than wiki-18's: a query's
  neighbours spread over more lists);
- same list size: nlist = N / 1,146 (wiki-18's 21M / 18,336 vectors per list) and the same
  nprobe (the same number of vectors scanned per probe).

`synthetic`: bench/index_scale.py's mixture (2000 near-orthogonal centres, 16-d local
structure), `--dim` 768 as e5-base. `text`: real English text found on this machine, not
Wikipedia: ~100-word passages of the standard library's docstrings, man pages and
/usr/share/doc files, deduplicated, up to `--passages` of them in a seeded order; queries are
Debian package descriptions (`apt-cache dumpavail`). They are encoded by the packaged encoder
(all-MiniLM-L6-v2, 384-d; the first `--max-length` tokens of each text) for at most
`--encode-minutes`, so this is MiniLM on software text, not e5 on wiki-18. Vectors are cached in `--cache` (.npy) so a sweep can rerun.

Each nlist is built with Forage's own code (`default_params`/`build_factory` for ivf-pq with
that nlist: PQ64, 8 bits), searched with nprobe as a per-request
SearchParameters for k_factor × 10 candidates, re-ranked by `rerank_exact` from a memory-mapped
float32 .npy, as the server does. The truth is an exact inner-product search (faiss.knn).

Cold-cache reads (`--reads Q`, at the largest nlist and nprobe 32 unless `--reads-nprobe`):
before each of Q queries the vector file's pages are dropped (fsync + posix_fadvise
DONTNEED), the query is re-ranked alone, and the file's pages then resident (mincore) and this
process's read_bytes (/proc/self/io) are counted; once with the kernel's default read-around
for mapped files (it reads up to the device's read_ahead_kb around each missing page), once
with madvise(MADV_RANDOM) (the missing page only). Pages and bytes are counted, not timed.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import gzip
import json
import mmap
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from services.retriever.indexes import (  # noqa: E402
    DEFAULT_K_FACTOR,
    _nlist,
    build_factory,
    default_params,
    open_refine,
    rerank_exact,
    search_parameters,
)

WIKI_ROWS = 21_015_324
WIKI_NLIST = _nlist(WIKI_ROWS)  # 18,336
SHIPPED_NPROBE = 32
PAGE = 4096
PASSAGE_WORDS = 100


# ---- real text -------------------------------------------------------------------------------

def _docstrings(root: Path):
    for path in sorted(root.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(errors="ignore"))
        except (SyntaxError, ValueError, OSError, RecursionError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc


def _man_pages():
    for path in sorted(Path("/usr/share/man").glob("man*/*.gz")):
        try:
            raw = gzip.open(path, "rt", errors="ignore").read()
        except (OSError, EOFError):
            continue
        lines = [re.sub(r"\\f[BIRP]|\\-|\\[(][a-z]{2}|\\&|\\e", "", line)
                 for line in raw.splitlines() if not line.startswith((".", "'"))]
        yield " ".join(lines)


def _doc_files():
    for path in sorted(Path("/usr/share/doc").rglob("*")):
        if path.suffix in (".txt", ".md", ".rst") or path.name.startswith(("README", "NEWS")):
            try:
                yield path.read_text(errors="ignore")
            except OSError:
                continue
        elif path.name.startswith("changelog") and path.suffix == ".gz":
            try:
                yield gzip.open(path, "rt", errors="ignore").read()
            except (OSError, EOFError):
                continue


def text_sources() -> list[Path]:
    """The standard library's sources (site-packages are left out: parsing them all takes
    minutes and adds more of the same)."""
    root = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    return [root] if root.is_dir() else []


def passages(limit: int, seed: int = 0) -> list[str]:
    """`limit` distinct ~100-word passages of English text found on this machine (module
    docstring), drawn with `seed` from all of them, in a seeded random order."""
    seen: set[str] = set()
    out: list[str] = []

    def chunks(text: str):
        words = [w for w in text.split() if len(w) < 40]
        for start in range(0, len(words) - PASSAGE_WORDS // 2, PASSAGE_WORDS):
            yield " ".join(words[start : start + PASSAGE_WORDS])

    streams = [_docstrings(root) for root in text_sources()] + [_man_pages(), _doc_files()]
    for stream in streams:
        for text in stream:
            for chunk in chunks(text):
                letters = sum(c.isalpha() for c in chunk)
                key = chunk.lower()
                if letters < 0.6 * len(chunk) or key in seen:  # code, tables, repeats
                    continue
                seen.add(key)
                out.append(chunk)
    rng = np.random.default_rng(seed)
    return [out[i] for i in rng.permutation(len(out))[:limit]]


def package_descriptions(count: int, seed: int = 0) -> list[str]:
    """`count` distinct Debian package short descriptions, the queries of `text`."""
    dump = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, text=True,
                          check=True).stdout
    found = sorted({line[len("Description: "):].strip() for line in dump.splitlines()
                    if line.startswith("Description: ")})
    rng = np.random.default_rng(seed)
    return [found[i] for i in np.sort(rng.choice(len(found), size=min(count, len(found)),
                                                 replace=False))]


def text_vectors(count: int, queries: int, cache: Path, minutes: float, max_length: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(passage vectors, query vectors), encoded by the packaged encoder on this process's
    threads, `max_length` tokens per text; encoding stops after `minutes` (at a 1024-passage
    boundary) with the passages done so far. Texts and vectors are cached in `cache`, and a
    rerun carries on from the vectors already there."""
    import time

    from services.retriever.encoder import Encoder

    cache.mkdir(parents=True, exist_ok=True)
    text_file, query_file = cache / "passages.json", cache / "queries.npy"
    if not text_file.exists():
        text_file.write_text(json.dumps({"passages": passages(count),
                                         "queries": package_descriptions(queries)}))
    texts = json.loads(text_file.read_text())
    encoder = Encoder(max_length=max_length)
    if not query_file.exists():
        np.save(query_file, encoder.encode_queries(texts["queries"]))
    parts = sorted(cache.glob("part-*.npy"))
    done = sum(len(np.load(p, mmap_mode="r")) for p in parts)
    started = time.monotonic()
    while done < min(count, len(texts["passages"])) and time.monotonic() - started < 60 * minutes:
        chunk = texts["passages"][done : done + 1024]
        np.save(cache / f"part-{done:08d}.npy", encoder.encode_passages(chunk))
        done += len(chunk)
        print(f"# encoded {done} passages in {time.monotonic() - started:.0f} s", flush=True)
    corpus = np.concatenate([np.load(p) for p in sorted(cache.glob("part-*.npy"))])
    return corpus[:count], np.load(query_file)


# ---- sweep -----------------------------------------------------------------------------------

def recall_at_10(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found, truth, strict=True)]))


def candidates(index, queries: np.ndarray, nprobe: int, depth: int) -> np.ndarray:
    params, _keep = search_parameters(index, nprobe=nprobe)
    return index.search(queries, depth, params=params)[1]


def sweep(corpus: np.ndarray, queries: np.ndarray, refine: np.ndarray, nlists: list[int],
          nprobes: list[int], k_factor: int) -> tuple[list[dict], dict[int, object]]:
    import faiss

    truth = faiss.knn(queries, corpus, 10, metric=faiss.METRIC_INNER_PRODUCT)[1]
    rows, dim = corpus.shape
    out, built = [], {}
    for nlist in nlists:
        params = default_params("ivf-pq", rows, dim, {"nlist": nlist})
        index = build_factory(str(params["factory"]), corpus, params)
        built[nlist] = index
        for nprobe in [p for p in nprobes if p <= nlist]:
            found = candidates(index, queries, nprobe, 10 * k_factor)
            refined = rerank_exact(refine, queries, found, 10)[1]
            row = {"N": rows, "dim": dim, "nlist": nlist, "per_list": rows / nlist,
                   "nprobe": nprobe, "share": nprobe / nlist,
                   "wiki_nprobe_same_share": nprobe * WIKI_NLIST / nlist,
                   "recall10_refine": recall_at_10(refined, truth),
                   "recall10_codes": recall_at_10(found[:, :10], truth),
                   "factory": params["factory"], "k_factor": k_factor}
            out.append(row)
            print(f"| {rows} | {dim} | {nlist} | {rows / nlist:.0f} | {nprobe} "
                  f"| {100 * nprobe / nlist:.3f}% | {nprobe * WIKI_NLIST / nlist:.0f} "
                  f"| {row['recall10_codes']:.3f} | {row['recall10_refine']:.3f} |", flush=True)
    return out, built


# ---- cold-cache reads ------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_pages(path: Path) -> int:
    """Pages of `path` in the page cache now (mincore over a fresh read-only mapping)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        pages = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(address, size, vec) != 0:
            raise OSError(ctypes.get_errno(), f"mincore {path}")
        _libc.munmap(address, size)
        return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1))
    finally:
        os.close(fd)


def drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def rows_pages(rows: np.ndarray, offset: int, row_bytes: int) -> int:
    """Distinct 4 KiB pages that rows (a .npy's data at `offset`) lie on."""
    first = (offset + rows * row_bytes) // PAGE
    last = (offset + rows * row_bytes + row_bytes - 1) // PAGE
    return len(set(np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last,
                                                                        strict=True)]).tolist()))


def cold_reads(path: Path, index, queries: np.ndarray, nprobe: int, k_factor: int,
               count: int) -> list[dict]:
    """Per query from a cold cache: its candidates, the 4 KiB pages they lie on, and the file
    pages / bytes read while re-ranking it alone after the file's pages were dropped (module
    docstring); averaged over `count` queries, each started cold."""
    out = []
    found = candidates(index, queries[:count], nprobe, 10 * k_factor)
    row_bytes = queries.shape[1] * 4
    for advice in ("default", "random"):
        pages = moved = before = 0
        for position in range(count):
            drop_pages(path)
            before += resident_pages(path)
            start_pages, start_bytes = resident_pages(path), read_bytes()
            matrix = np.load(path, mmap_mode="r")
            offset = matrix.offset
            if advice == "random":
                matrix._mmap.madvise(mmap.MADV_RANDOM)
            rerank_exact(matrix, queries[position : position + 1],
                         found[position : position + 1], 10)
            del matrix
            pages += resident_pages(path) - start_pages
            moved += read_bytes() - start_bytes
        touched = [rows_pages(np.unique(f[f >= 0]), offset, row_bytes) for f in found]
        row = {"advice": advice, "queries": count, "nprobe": nprobe, "k_factor": k_factor,
               "candidates_per_query": float(np.mean([len(np.unique(f[f >= 0]))
                                                      for f in found])),
               "pages_touched_per_query": float(np.mean(touched)),
               "pages_read_per_query": pages / count,
               "read_bytes_per_query": moved / count, "cache_before": before,
               "file_bytes": path.stat().st_size}
        out.append(row)
        print(f"| {advice} | {count} | {row['candidates_per_query']:.1f} "
              f"| {row['pages_touched_per_query']:.1f} | {row['pages_read_per_query']:.1f} "
              f"| {row['read_bytes_per_query'] / 1024:.0f} | {before} |", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data", choices=("synthetic", "text"))
    parser.add_argument("--n", type=int, default=1_000_000, help="synthetic vectors (1M)")
    parser.add_argument("--dim", type=int, default=768, help="synthetic dimension (768)")
    parser.add_argument("--centres", type=int, default=2000, help="synthetic centres (2000)")
    parser.add_argument("--passages", type=int, default=60_000, help="text passages (60,000)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/forage-text-vectors"),
                        help="where text vectors are cached")
    parser.add_argument("--encode-minutes", type=float, default=20,
                        help="stop encoding text after this many minutes (20)")
    parser.add_argument("--max-length", type=int, default=128,
                        help="encoder tokens per text (128: a 100-word passage)")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--nlist", default=None,
                        help="comma-separated nlists (default: N / 1146, and the rule's for N)")
    parser.add_argument("--nprobe", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--k-factor", type=int, default=DEFAULT_K_FACTOR)
    parser.add_argument("--reads", type=int, default=16,
                        help="queries for the cold-cache read count, each from a cold cache "
                        "(0: skip)")
    parser.add_argument("--reads-nprobe", type=int, default=SHIPPED_NPROBE)
    parser.add_argument("--threads", type=int, default=1, help="FAISS threads (1)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import faiss

    faiss.omp_set_num_threads(args.threads)
    if args.data == "synthetic":
        from index_scale import generate

        corpus, queries = generate(args.n, args.queries, args.dim, args.centres, 0)
    else:
        import torch

        torch.set_num_threads(args.threads)
        corpus, queries = text_vectors(args.passages, args.queries, args.cache,
                                       args.encode_minutes, args.max_length)
    rows = len(corpus)
    nlists = ([int(x) for x in args.nlist.split(",")] if args.nlist
              else sorted({max(1, round(rows / (WIKI_ROWS / WIKI_NLIST))), _nlist(rows)}))
    nprobes = [int(x) for x in args.nprobe.split(",")]
    print(f"# {args.data}: N={rows} d={corpus.shape[1]} queries={len(queries)} nlist={nlists} "
          f"k_factor={args.k_factor}; wiki-18: nlist {WIKI_NLIST}, nprobe {SHIPPED_NPROBE} "
          f"= {100 * SHIPPED_NPROBE / WIKI_NLIST:.3f}% probed, "
          f"{WIKI_ROWS / WIKI_NLIST:.0f} vectors per list; faiss {faiss.__version__}", flush=True)
    print("| N | d | nlist | vectors/list | nprobe | share probed | wiki-18 nprobe, same share "
          "| recall@10 codes | recall@10 +refine |")
    print("|---" * 9 + "|")
    with tempfile.TemporaryDirectory(prefix="ivf-nprobe-") as tmp:
        path = Path(tmp) / "refine.npy"
        np.save(path, corpus)
        refine = open_refine(path, rows, corpus.shape[1])
        table, built = sweep(corpus, queries, refine, nlists, nprobes, args.k_factor)
        del refine
        reads = []
        if args.reads:
            print("\n| read-around | queries | candidates/query | 4 KiB pages they lie on "
                  "| pages read (mincore) | KiB read (/proc/self/io) | cached before |")
            print("|---" * 7 + "|")
            reads = cold_reads(path, built[max(nlists)], queries, args.reads_nprobe,
                               args.k_factor, args.reads)
    if args.json:
        args.json.write_text(json.dumps({"sweep": table, "reads": reads}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
