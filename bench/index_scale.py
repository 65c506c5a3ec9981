"""Index kinds at scale: build time, bytes, serving memory, queries/s and recall vs flat.

    .venv/bin/python bench/index_scale.py [--n 1000000] [--quick] [--dim 384]
        [--kinds flat,hnsw,ivf,ivf-sq8,ivf-sqfp16,ivf-pq,hnsw-sq8] [--threads 1]
        [--kinds "flat;IVF*,SQ4;PCAR384,IVF*,SQ8"] [--budget-gb 8]
        [--kinds "flat;IVF*,PQ96+refine"] [--k-factor 10]

`--kinds` also takes FAISS factory strings, separated by ';'; `IVF*` in one stands for the
nlist build-index picks for the rows (so the projection uses wiki-18's nlist).

No encoder: the vectors are synthetic, with the statistics that matter for an index — many
clusters, low intrinsic dimension inside a cluster, unit norm. Generator (seed `--seed`, 0):
`--centres` (2000) centres c_j ~ N(0, I_d) normalised; for each cluster a basis B_j ∈ R^{d×16}
with entries N(0, 1/d); a vector of cluster j (j uniform) is
    x = normalise(c_j + 0.5 · B_j z / 4 + 0.15 · e / √d),   z ~ N(0, I_16), e ~ N(0, I_d).
Held-out queries (`--queries`, 1000) come from the same mixture, drawn after the corpus.

Each kind is built with Forage's own code and defaults (services/retriever/indexes.py: the
sizes `build-index` would choose for N rows) and written to disk. Then:
- bytes on disk of index.faiss;
- memory of a serving process: a child Python that imports faiss, reads the file (and, for
  kinds that can be memory-mapped, another that maps it), searches 8 queries and reports its
  RSS (VmRSS, which counts mapped file pages it touched, shared with other processes) and the
  private memory the index added (RssAnon after − before: what each extra replica costs),
  and the read_index time (the file is in the page cache: it was just written); --json
  also records `checksum_s`, the time of the start-up checksum check's read of the file;
- queries/s at 1 and at 32 queries per search call, FAISS on `--threads` threads (1: what one
  server worker gets on a busy box), searching the index directly;
- recall@1 and recall@10 against the flat index's top-10 on the held-out queries.

Projection to wiki-18 (21M × 768), exact from the codes FAISS would write: per vector, the
code size of the kind at d=768 (FAISS reports it) + 8 bytes of id for IVF kinds, or + the
HNSW graph's bytes per vector measured on this build (4 bytes per neighbour slot, plus 12 for
its offset and level); fixed, the IVF centroids (nlist × 768 × 4 with nlist as build-index
picks for 21M rows) and codebooks (PQ: 256 × d' × 4; SQ: 2 × d' × 4, d' the width after a
PCA reduction), plus a PCA (d' × d + d × d floats) or OPQ (d × d) matrix. The `rule/disk`
column applies the same rule at this N and d and divides it by the file's bytes.

A kind ending in `+refine` is the kind built with `build-index --refine`: searched for
k-factor × 10 candidates, re-ranked by exact inner products from the float32 vectors
memory-mapped from a `.npy` file on disk (services/retriever/indexes.py, `rerank_exact`, as
the server does). Its projected bytes are what it holds in memory (the compressed index);
the re-ranking vectors stay on disk: 21M × 768 × 4 bytes = 64.6 GB for wiki-18, reported
apart (`refine_disk_bytes` in --json).

Last line: the kind with the least projected bytes among those with recall@10 ≥ 0.95; with
`--budget-gb B`, also the kind with the best recall@10 (≥ 0.95) projected within B × 10^9 bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.retriever.indexes import (  # noqa: E402
    DEFAULT_K_FACTOR,
    _nlist,
    build_dense,
    build_factory,
    default_params,
    factory_for,
    mmap_flag,
    open_refine,
    rerank_exact,
)
from services.retriever.manifest import file_checksum  # noqa: E402

KINDS = ("flat", "hnsw", "ivf", "ivf-sq8", "ivf-sqfp16", "ivf-pq", "hnsw-sq8")
WIKI_ROWS, WIKI_DIM = 21_015_324, 768
LOCAL_DIM = 16

CHILD = r"""
import json, sys, time
import faiss
import numpy as np
def rss(key="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
base = rss("RssAnon")
started = time.perf_counter()
index = faiss.read_index(sys.argv[1], int(sys.argv[2]))
seconds = time.perf_counter() - started
index.search(np.ones((8, index.d), dtype="float32"), 10)
print(json.dumps({"rss": rss(), "private": rss("RssAnon") - base, "load_s": seconds}))
"""


def generate(n: int, queries: int, dim: int, centres: int, seed: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """(corpus n × dim, queries × dim), float32, unit norm; the module docstring's mixture."""
    rng = np.random.default_rng(seed)
    centre = rng.standard_normal((centres, dim)).astype(np.float32)
    centre /= np.linalg.norm(centre, axis=1, keepdims=True)
    basis = (rng.standard_normal((centres, dim, LOCAL_DIM)) / math.sqrt(dim)).astype(np.float32)
    total = n + queries
    out = np.empty((total, dim), dtype=np.float32)
    chunk = 65536
    for start in range(0, total, chunk):
        size = min(chunk, total - start)
        cluster = rng.integers(0, centres, size)
        z = rng.standard_normal((size, LOCAL_DIM)).astype(np.float32)
        local = np.einsum("ndk,nk->nd", basis[cluster], z) / math.sqrt(LOCAL_DIM)
        noise = rng.standard_normal((size, dim)).astype(np.float32) / math.sqrt(dim)
        x = centre[cluster] + 0.5 * local + 0.15 * noise
        out[start : start + size] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out[:n], out[n:]


def build(kind: str, vectors: np.ndarray):
    """Forage's own build path and defaults for `kind` over these rows."""
    rows, dim = vectors.shape
    if kind in ("flat", "hnsw", "ivf"):
        params = default_params(kind, rows)
        return build_dense(kind, vectors, params), params
    params = default_params(sized(kind, rows), rows, dim)
    return build_factory(str(params["factory"]), vectors, params), params


REFINE = "+refine"


class Refined:
    """A built index searched as a `--refine` build serves it: k_factor × k candidates from
    the compressed index, re-ranked exactly from `vectors` (a memmap of the corpus)."""

    def __init__(self, index, vectors: np.ndarray, k_factor: int) -> None:
        self.index, self.vectors, self.k_factor = index, vectors, k_factor

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        _, rows = self.index.search(queries, min(k * self.k_factor, self.index.ntotal))
        return rerank_exact(self.vectors, queries, rows, k)


def serving_memory(path: Path, flag: int) -> dict[str, float]:
    """RSS and load time of a fresh process that reads the index (with `flag`) and searches."""
    result = subprocess.run([sys.executable, "-c", CHILD, str(path), str(flag)],
                            capture_output=True, text=True, check=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(result.stdout.strip().splitlines()[-1])


def queries_per_second(index, queries: np.ndarray, batch: int, budget_s: float = 3.0) -> float:
    done, started = 0, time.perf_counter()
    while True:
        for start in range(0, len(queries), batch):
            index.search(queries[start : start + batch], 10)
            done += len(queries[start : start + batch])
            if time.perf_counter() - started > budget_s:
                return done / (time.perf_counter() - started)


def recall(found: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    at1 = float(np.mean(found[:, 0] == truth[:, 0]))
    at10 = float(np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found, truth, strict=True)]))
    return at1, at10


def graph_bytes_per_vector(index) -> float:
    """HNSW neighbour slots × 4 bytes + offset (8) + level (4), per vector; 0 for other kinds."""
    import faiss

    inner = faiss.downcast_index(index)
    if not hasattr(inner, "hnsw"):
        return 0.0
    return inner.hnsw.neighbors.size() * 4 / inner.ntotal + 12


def sized(kind: str, rows: int) -> str:
    """A factory string with `IVF*` given the nlist build-index picks for `rows` (so the
    projection to 21M rows uses wiki-18's nlist, not this run's)."""
    return kind.replace("IVF*", f"IVF{_nlist(rows)}")


def factory_of(kind: str, rows: int, dim: int) -> str:
    """The factory string `build-index --index kind` means for rows × dim."""
    named = {"flat": "Flat", "hnsw": "HNSW32,Flat", "ivf": f"IVF{_nlist(rows)},Flat"}
    return named.get(kind) or factory_for(sized(kind, rows), rows, dim)


def rule_bytes(factory: str, rows: int, dim: int, graph_per_vector: float) -> int:
    """Bytes of an index of `factory` over rows × dim by the docstring's rule."""
    import faiss

    index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    try:
        ivf = faiss.extract_index_ivf(index)
    except RuntimeError:
        ivf = None
    if ivf is not None:
        inner_dim = ivf.d  # after a PCA reduction, the centroids and codes are that wide
        # A rotation in front: OPQ stores d × d floats; PCA its d_out × d matrix and the full
        # d × d eigenvector matrix.
        transform = {"OPQ": dim * dim * 4, "PCA": (dim + inner_dim) * dim * 4}.get(
            factory[:3], 0)
        fixed = ivf.nlist * inner_dim * 4 + transform
        if "PQ" in factory:
            fixed += 256 * inner_dim * 4
        elif "SQ" in factory:
            fixed += 2 * inner_dim * 4
        return int(rows * (ivf.code_size + 8) + fixed)
    inner = faiss.downcast_index(index)
    storage = faiss.downcast_index(inner.storage) if hasattr(inner, "storage") else inner
    code = storage.code_size
    fixed = 2 * dim * 4 if "SQ8" in factory else 0
    return int(rows * (code + graph_per_vector) + fixed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="corpus vectors (1M)")
    parser.add_argument("--quick", action="store_true", help="N = 50,000")
    parser.add_argument("--dim", type=int, default=384, help="dimension (384: MiniLM)")
    parser.add_argument("--centres", type=int, default=2000, help="mixture centres (2000)")
    parser.add_argument("--queries", type=int, default=1000, help="held-out queries (1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="FAISS threads for search (1)")
    parser.add_argument("--build-threads", type=int, default=1,
                        help="FAISS threads for building (1: on a shared box more OpenMP "
                        "threads than free cores spin, and PQ training ran 50× slower)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="comma-separated kinds; separate with ';' when a kind is a FAISS "
                        "factory string (\"flat;IVF*,SQ4;PCAR384,IVF*,SQ8\"), where IVF* is "
                        "the nlist build-index picks for the rows")
    parser.add_argument("--budget-gb", type=float, default=None,
                        help="also name the kind with the best recall@10 (>= 0.95) whose "
                        "projected 21M x 768 bytes are within this many GB (10^9 bytes)")
    parser.add_argument("--k-factor", type=int, default=DEFAULT_K_FACTOR,
                        help=f"candidates per result of +refine kinds ({DEFAULT_K_FACTOR})")
    parser.add_argument("--qps-seconds", type=float, default=3.0,
                        help="seconds each queries/s measurement runs (3)")
    parser.add_argument("--json", type=Path, default=None, help="also write rows here")
    args = parser.parse_args()
    n = 50_000 if args.quick else args.n
    separator = ";" if ";" in args.kinds else ","
    kinds = [k.strip() for k in args.kinds.split(separator) if k.strip()]
    if kinds[0] != "flat":
        kinds = ["flat", *[k for k in kinds if k != "flat"]]  # the ground truth comes first

    import faiss

    started = time.perf_counter()
    corpus, queries = generate(n, args.queries, args.dim, args.centres, args.seed)
    print(f"# N={n} d={args.dim} centres={args.centres} queries={args.queries} "
          f"seed={args.seed}; generated in {time.perf_counter() - started:.1f}s; "
          f"search threads {args.threads}; cpus {os.cpu_count()}; faiss {faiss.__version__}",
          flush=True)
    header = ("| kind | factory | build s | MB on disk | RSS MB (private) | load s "
              "| mmap: RSS MB (private) | mmap load s | q/s @1 | q/s @32 | recall@1 "
              "| recall@10 | rule/disk | projected 21M×768 GB |")
    print(header)
    print("|---" * 14 + "|")
    rows_out: list[dict] = []
    truth = None
    with tempfile.TemporaryDirectory(prefix="index-scale-") as tmp:
        refine_vectors = None
        for kind in kinds:
            faiss.omp_set_num_threads(args.build_threads)
            refined, kind_name = kind.endswith(REFINE), kind
            kind = kind.removesuffix(REFINE)
            t0 = time.perf_counter()
            index, params = build(kind, corpus)
            build_s = time.perf_counter() - t0
            searched = index
            if refined:
                if refine_vectors is None:  # the build's embeddings file, kept on disk
                    np.save(Path(tmp) / "refine.npy", corpus)
                    refine_vectors = open_refine(Path(tmp) / "refine.npy", n, args.dim)
                searched = Refined(index, refine_vectors, args.k_factor)
            path = Path(tmp) / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', kind)}.faiss"
            faiss.write_index(index, str(path))
            disk = path.stat().st_size
            t0 = time.perf_counter()
            file_checksum(path)  # what a server's start-up check reads (page cache: warm)
            checksum_s = time.perf_counter() - t0
            plain = serving_memory(path, 0)
            try:
                mapped = serving_memory(path, mmap_flag(kind, params.get("factory")))
            except (ValueError, subprocess.CalledProcessError):  # a kind FAISS cannot map
                mapped = None
            faiss.omp_set_num_threads(args.threads)
            found = searched.search(queries, 10)[1]
            if truth is None:
                truth = found
            r1, r10 = recall(found, truth)
            qps1 = queries_per_second(searched, queries[:300], 1, args.qps_seconds)
            qps32 = queries_per_second(searched, queries, 32, args.qps_seconds)
            graph = graph_bytes_per_vector(index)
            factory = factory_of(kind, n, args.dim)
            rule_here = rule_bytes(factory, n, args.dim, graph)
            projected = rule_bytes(factory_of(kind, WIKI_ROWS, WIKI_DIM), WIKI_ROWS, WIKI_DIM,
                                   graph)
            if refined:
                factory += f" + refine ×{args.k_factor}"
            row = {
                "kind": kind_name, "factory": params.get("factory", kind), "build_s": build_s,
                "disk_bytes": disk, "rss": plain["rss"], "private": plain["private"],
                "load_s": plain["load_s"], "mmap_rss": mapped["rss"] if mapped else None,
                "mmap_private": mapped["private"] if mapped else None,
                "mmap_load_s": mapped["load_s"] if mapped else None,
                "qps1": qps1, "qps32": qps32, "recall1": r1, "recall10": r10,
                "rule_over_disk": rule_here / disk, "projected_bytes": projected,
                "refine_disk_bytes": WIKI_ROWS * WIKI_DIM * 4 if refined else 0,
                "checksum_s": checksum_s,
            }
            if refined:  # the same codes without the re-ranking, for comparison
                row["recall1_codes"], row["recall10_codes"] = recall(
                    index.search(queries, 10)[1], truth)
            row["factory"] = factory
            rows_out.append(row)
            mmap_cells = (f"{mapped['rss'] / 1e6:.0f} ({mapped['private'] / 1e6:.0f}) "
                          f"| {mapped['load_s']:.3f}" if mapped else "– | –")
            print(f"| {kind_name} | {factory} | {build_s:.1f} | {disk / 1e6:.1f} "
                  f"| {plain['rss'] / 1e6:.0f} ({plain['private'] / 1e6:.0f}) "
                  f"| {plain['load_s']:.3f} | {mmap_cells} ", end="")
            print(f"| {qps1:.0f} | {qps32:.0f} | {r1:.3f} | {r10:.3f} "
                  f"| {rule_here / disk:.3f} | {projected / 1e9:.1f} |", flush=True)

            del index, searched
    for row in rows_out:
        if "recall10_codes" in row:
            print(f"{row['kind']}: the codes alone (no re-ranking) give recall@1 "
                  f"{row['recall1_codes']:.3f}, recall@10 {row['recall10_codes']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows_out, indent=2) + "\n")
    good = [r for r in rows_out if r["recall10"] >= 0.95]
    if not good:
        print("best: no kind reached recall@10 >= 0.95")
        return 1
    best = min(good, key=lambda r: r["projected_bytes"])
    print(f"best: {best['kind']} ({best['factory']}) recall@10 {best['recall10']:.3f}, "
          f"projected {best['projected_bytes'] / 1e9:.1f} GB for 21M x 768")
    if args.budget_gb is not None:
        fits = [r for r in good if r["projected_bytes"] <= args.budget_gb * 1e9]
        if not fits:
            print(f"within {args.budget_gb:g} GB: no kind with recall@10 >= 0.95")
            return 1
        top = max(fits, key=lambda r: r["recall10"])
        print(f"within {args.budget_gb:g} GB: {top['kind']} ({top['factory']}) recall@10 "
              f"{top['recall10']:.3f}, projected {top['projected_bytes'] / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
