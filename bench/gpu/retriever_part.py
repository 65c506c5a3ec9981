"""Part 4: the retriever's two costs on CUDA against CPU: the query encoder (all-MiniLM-L6-v2
through Forage's Encoder, float16 on CUDA and the `auto` dtype on CPU, as the server picks) and
FAISS search (a Flat inner-product index of random unit vectors, 200k x 384: search time depends
on the index's size, not on what the vectors mean). Queries per second for each, and for the
two together (encode a batch, then search it), in batches of 64 as the server's micro-batches.

faiss runs on the CPU on both sides unless the installed faiss has GPU support: the wheel that
does (faiss-gpu-cu12) needs CUDA 12 libraries and is larger than what the GPU machine takes.

    python bench/gpu/retriever_part.py --out DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PartReport, part_main, say, synchronize  # noqa: E402
from encoder_standin import real_package_present  # noqa: E402

BATCH = 64
SUBJECTS = ["the river Avon", "Marie Curie", "the Eiffel Tower", "the film Heat", "Lake Baikal",
            "the company Nokia", "Ada Lovelace", "the city of Porto", "the opera Tosca"]
ASKS = ["Where was {} born?", "Who founded {}?", "In which country is {}?",
        "When was {} first described, and by whom?", "What is {} best known for?"]


def questions(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [ASKS[rng.integers(len(ASKS))].format(SUBJECTS[rng.integers(len(SUBJECTS))])
            + f" ({i})" for i in range(count)]


def random_index(rows: int, dim: int, seed: int = 0):
    import faiss

    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((rows, dim), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = faiss.IndexFlatIP(dim)
    index.add(vectors)
    return index


def time_batches(fn, items, batch: int) -> float:
    synchronize()
    start = time.perf_counter()
    for i in range(0, len(items), batch):
        fn(items[i : i + batch])
    synchronize()
    return time.perf_counter() - start


def measure(args: argparse.Namespace, report: PartReport) -> None:
    import faiss
    import torch

    from services.retriever.encoder import Encoder, resolve_query_dtype

    count, rows = (256, 2000) if args.dry_run else (2048, 200_000)
    texts = questions(count)
    gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    report.set(encoder_weights="real" if real_package_present() else
               "random (stand-in: bench/gpu/encoder_standin.py)",
               faiss=faiss.__version__, faiss_gpus=gpus, queries=count, index_rows=rows,
               batch=BATCH, torch_threads=torch.get_num_threads(),
               faiss_threads=faiss.omp_get_max_threads())
    if gpus == 0:
        report.note("faiss has no GPU support here: search runs on the CPU for both "
                    "devices (faiss-gpu-cu12 needs CUDA 12 libraries and does not fit the "
                    "carried wheels)")
    devices = ["cuda", "cpu"] if torch.cuda.is_available() else ["cpu"]
    index = None
    for device in devices:
        dtype = resolve_query_dtype("auto", device)
        encoder = Encoder(None, device=device, batch_size=BATCH, dtype=dtype)
        encoder.encode_queries(texts[: 8 * BATCH])  # warm-up: kernels for each shape
        encode_s = time_batches(encoder.encode_queries, texts, BATCH)
        result = {"encoder_device": device, "encoder_dtype": dtype,
                  "encode_qps": round(count / encode_s, 1)}
        report.add(result)  # kept if the part is stopped before the rest
        if index is None:
            started = time.perf_counter()
            index = random_index(rows, encoder.dim)
            report.set(index_build_s=round(time.perf_counter() - started, 2))
            vectors = encoder.encode_queries(texts)
            index.search(vectors[:BATCH], 3)  # warm-up
            search_s = time_batches(lambda v, ix=index: ix.search(v, 3), vectors, BATCH)
            report.set(search_qps=round(count / search_s, 1), search_device="cpu"
                       if gpus == 0 else "faiss default")

        def both(batch: list[str], encoder: Encoder = encoder, ix=index) -> None:
            ix.search(encoder.encode_queries(batch), 3)

        both_s = time_batches(both, texts, BATCH)
        result["encode_and_search_qps"] = round(count / both_s, 1)
        report.save()
        say(f"retriever: {result}")
        del encoder
    by_device = {r["encoder_device"]: r for r in report.data["results"]}
    if "cuda" in by_device:
        report.set(encode_speedup_cuda_over_cpu=round(
            by_device["cuda"]["encode_qps"] / by_device["cpu"]["encode_qps"], 2))


def main(argv: list[str] | None = None) -> int:
    return part_main("retriever", __doc__, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
