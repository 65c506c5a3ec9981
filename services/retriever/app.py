"""FastAPI app: Search-R1's `POST /retrieve`, plus /healthz, /metrics and OpenAPI /docs.

The request body is parsed and checked here by hand rather than by FastAPI's model binding so
that every bad input gets a 4xx whose message names the field (`queries[3]: ...`), limits come
from the config at run time, and nothing a client sends can reach the encoder and raise a 500.
The pydantic models below still describe the contract in /docs.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, Field, StringConstraints, create_model

from services.common.config.retriever import RetrieverSection
from services.common.http_limits import BodyLimit
from services.common.metrics import SERVICE_HEADER
from services.common.retrieval_store import served_fields
from services.common.threads import (
    process_threads,
    set_worker_threads,
    split_workers,
    thread_report,
)
from services.retriever.batcher import MicroBatcher

log = logging.getLogger("forage.retriever.server")

REQUESTS = Counter("forage_retriever_requests", "/retrieve requests by HTTP status", ["status"])
QUERIES = Counter("forage_retriever_queries", "queries answered by /retrieve")
LATENCY = Histogram(
    "forage_retriever_request_seconds", "/retrieve latency (receive to response)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
BATCH_QUERIES = Histogram(
    "forage_retriever_batch_queries", "queries per encoder+index batch",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
)
BATCH_SECONDS = Histogram(
    "forage_retriever_batch_seconds", "encoder + index + docstore time per batch",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
LOADED = Gauge("forage_retriever_index_loaded", "1 once the index is loaded and serving")
INDEX_DOCS = Gauge("forage_retriever_index_docs", "passages in the loaded index")
WORKER_LIMIT = Gauge("forage_retriever_worker_limit",
                     "micro-batches allowed to run at once now (lowered under CPU contention)")


class RetrieveRequest(BaseModel):
    """Search-R1's request; a null or 0 topk means the server's default."""

    queries: list[str] = Field(description="search queries, answered in order")
    topk: int | None = Field(default=None, description="passages per query; null/0 = default")
    return_scores: bool = Field(default=False, description="wrap each doc with its score")
    nprobe: int | None = Field(default=None, description="IVF lists searched (IVF indexes)")
    efSearch: int | None = Field(default=None, description="HNSW breadth (HNSW indexes)")  # noqa: N815


# Per-request search knobs: the JSON field, the Searcher's name for it, and its bound. The
# bound keeps one request from asking for an exhaustive scan a thousand times over.
SEARCH_FIELDS = (("nprobe", "nprobe"), ("efSearch", "ef_search"))
MAX_SEARCH_KNOB = 65536


def request_model(settings: RetrieverSection) -> type[BaseModel]:
    """RetrieveRequest with this server's limits as JSON-schema constraints (`minItems`,
    `maxItems`, `maxLength`, `maximum`), so /openapi.json says what `parse_request` enforces;
    the limits that span fields (results, characters per request) are in the descriptions."""
    query = Annotated[str, StringConstraints(max_length=settings.max_query_chars)]
    return create_model(
        "RetrieveRequest",
        __doc__=RetrieveRequest.__doc__,
        queries=(list[query], Field(
            min_length=1, max_length=settings.max_queries_per_request,
            description=(
                "search queries, answered in order; an empty string is a query (answered as "
                f"Search-R1 does); at most {settings.max_request_chars} characters in all "
                "(413 beyond)"
            ))),
        topk=(int | None, Field(
            default=None, ge=0, le=settings.max_topk,
            description=(
                "passages per query; null/0 = the server's default; queries × topk at most "
                f"{settings.max_results_per_request} (413 beyond)"
            ))),
        return_scores=(bool, Field(default=False, description="wrap each doc with its score")),
        nprobe=(int | None, Field(
            default=None, ge=1, le=MAX_SEARCH_KNOB,
            description="IVF lists searched for this request (IVF kinds; 422 for others); "
            "null = retriever.nprobe or the build's")),
        efSearch=(int | None, Field(
            default=None, ge=1, le=MAX_SEARCH_KNOB,
            description="HNSW search breadth for this request (HNSW kinds; 422 for others); "
            "null = retriever.ef_search or the build's")),
    )


class Doc(BaseModel, extra="allow"):
    id: str
    contents: str = Field(description='"Title"\\ntext (wiki-18 format)')


class ScoredDoc(BaseModel):
    document: Doc
    score: float


class RetrieveResponse(BaseModel):
    result: list[list[ScoredDoc] | list[Doc]]


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_request(body: bytes, settings: RetrieverSection) -> tuple[list[str], int, bool]:
    """Validated (queries, topk, return_scores) or BadRequest naming the field."""
    queries, topk, return_scores, _ = parse_request_options(body, settings)
    return queries, topk, return_scores


def parse_request_options(body: bytes, settings: RetrieverSection, knobs: frozenset[str] = (
        frozenset({"nprobe", "ef_search"}))) -> tuple[list[str], int, bool, dict[str, int]]:
    """Validated (queries, topk, return_scores, {nprobe/ef_search: value}) or BadRequest
    naming the field. `knobs` are the settings this index has: asking for nprobe on an HNSW
    index is a 422, not a silently ignored field."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(400, f"body: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadRequest(422, "body: must be a JSON object with a 'queries' list")
    if "queries" not in data:
        raise BadRequest(422, "queries: required")
    queries = data["queries"]
    if not isinstance(queries, list):
        raise BadRequest(422, "queries: must be a list of strings")
    if not queries:
        raise BadRequest(422, "queries: must not be empty")
    if len(queries) > settings.max_queries_per_request:
        raise BadRequest(
            413, f"queries: at most {settings.max_queries_per_request} per request "
            f"(got {len(queries)})"
        )
    total_chars = 0
    for position, query in enumerate(queries):
        where = f"queries[{position}]"
        if not isinstance(query, str):
            raise BadRequest(422, f"{where}: must be a string")
        # An empty or blank query is answered, not refused: Search-R1's agent sends "" for
        # `<search> </search>` and its server retrieves for it (dense: the passages nearest
        # the empty query's vector; BM25: no hits). Refusing would fail the whole request.
        if len(query) > settings.max_query_chars:
            raise BadRequest(
                422, f"{where}: longer than {settings.max_query_chars} characters ({len(query)})"
            )
        try:
            query.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(422, f"{where}: not valid Unicode (lone surrogate)") from None
        total_chars += len(query)
    # The encoder's work grows with the text: bounded per request, so that no request can hold
    # the encoder for long (others interleave between its chunks, but it would still end late).
    if total_chars > settings.max_request_chars:
        raise BadRequest(
            413, f"queries: {total_chars} characters in all, at most "
            f"{settings.max_request_chars} per request (send fewer queries per request)"
        )
    topk = data.get("topk")
    if isinstance(topk, float) and topk.is_integer():
        topk = int(topk)  # JSON Schema's (and pydantic's, Search-R1's server) integer: 3.0 is 3
    if topk is None or (isinstance(topk, int) and not isinstance(topk, bool) and topk == 0):
        topk = settings.topk
    elif isinstance(topk, bool) or not isinstance(topk, int):
        raise BadRequest(422, "topk: must be an integer or null")
    elif topk < 0:
        raise BadRequest(422, f"topk: must be positive (got {topk})")
    elif topk > settings.max_topk:
        raise BadRequest(422, f"topk: at most {settings.max_topk} (got {topk})")
    if len(queries) * topk > settings.max_results_per_request:
        raise BadRequest(
            413, f"queries: {len(queries)} queries × topk {topk} = {len(queries) * topk} "
            f"results, at most {settings.max_results_per_request} per request"
        )
    return_scores = data.get("return_scores", False)
    if return_scores is None:
        return_scores = False
    if not isinstance(return_scores, bool):
        raise BadRequest(422, "return_scores: must be true or false")
    options: dict[str, int] = {}
    for field, knob in SEARCH_FIELDS:
        value = data.get(field)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(422, f"{field}: must be an integer or null")
        if not 1 <= value <= MAX_SEARCH_KNOB:
            raise BadRequest(422, f"{field}: must be between 1 and {MAX_SEARCH_KNOB} "
                                  f"(got {value})")
        if knob not in knobs:
            what = "inverted lists (IVF)" if knob == "nprobe" else "HNSW graph"
            raise BadRequest(422, f"{field}: this server's index has no {what}; leave it out")
        options[knob] = value
    return queries, topk, return_scores, options


class ServerState:
    """What the routes share: the searcher once loaded, and the load error if it failed."""

    def __init__(self) -> None:
        self.searcher: Any = None
        self.batcher: MicroBatcher | None = None
        self.error: str | None = None
        self.ready = threading.Event()


def create_app(index_dir: str | Path, settings: RetrieverSection, device: str | None = None,
               on_load_error=None, loader=None) -> FastAPI:
    """The app; the index loads on a background thread so /healthz can say 503 meanwhile.

    `on_load_error(message)` is called if loading fails (the CLI stops the server with it).
    `loader()` replaces Searcher.load (tests of the HTTP layer with a prepared searcher).
    """
    state = ServerState()
    device = device or settings.device
    # The encoder and the index each follow `device` unless placed apart (retriever.py).
    encoder_device = settings.encoder_device or device
    index_device = settings.index_device or device
    from services.retriever.encoder import resolve_query_dtype

    query_dtype = resolve_query_dtype(settings.query_dtype, encoder_device)

    def load() -> None:
        try:
            if loader is not None:
                searcher = loader()
            else:
                from services.retriever.searcher import Searcher

                searcher = Searcher.load(
                    index_dir, device=device, query_dtype=query_dtype, mmap=settings.mmap,
                    search_params=settings.search_overrides,
                    encoder_device=encoder_device, index_device=index_device,
                    index_gpu_mode=settings.index_gpu_mode)
            state.searcher = searcher
            if state.batcher is not None:
                state.batcher.warm_up(lambda: searcher.search_many(["warm up"], [1]))
            INDEX_DOCS.set(len(searcher))
            LOADED.set(1)
            state.ready.set()
            log.info("index %s loaded (%d passages); queries encoded in %s; serving; "
                     "threads %s", index_dir, len(searcher), query_dtype, threads_in_use())
        except Exception as exc:  # noqa: BLE001 (reported, then the server stops)
            state.error = f"{type(exc).__name__}: {exc}"
            log.error("cannot load index %s: %s", index_dir, state.error)
            if on_load_error is not None:
                on_load_error(state.error)

    def on_batch(size: int, seconds: float) -> None:
        BATCH_QUERIES.observe(size)
        BATCH_SECONDS.observe(seconds)

    def run_batch(queries: list[str], keys: list[Any]):
        """`keys` are topks, or (topk, (nprobe, ef_search)) for requests with their own."""
        if all(isinstance(key, int) for key in keys):
            return state.searcher.search_many(queries, keys)
        topks = [key if isinstance(key, int) else key[0] for key in keys]
        options = [(None, None) if isinstance(key, int) else key[1] for key in keys]
        return state.searcher.search_many(queries, topks, options)

    # One worker by default when either half is on a GPU (it runs one batch at a time).
    on_gpu = next((d for d in (encoder_device, index_device) if d.startswith("cuda")), "cpu")
    workers, per_worker = split_workers(process_threads(), settings.workers, on_gpu)

    def threads_in_use() -> dict[str, Any]:
        """The policy's settings and what torch/faiss report on a worker thread."""
        report: dict[str, Any] = {**thread_report(), "workers": workers,
                                  "per_worker": per_worker}
        if state.batcher is not None and state.batcher.worker_info:
            report.update(next(iter(state.batcher.worker_info.values())))
        return report

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        LOADED.set(0)
        state.batcher = MicroBatcher(run_batch, max_batch=settings.max_batch,
                                     max_wait_s=settings.max_wait_ms / 1000.0, on_batch=on_batch,
                                     workers=workers,
                                     init_worker=lambda: set_worker_threads(per_worker))
        batcher = state.batcher
        WORKER_LIMIT.set_function(lambda: batcher.limit)
        state.batcher.start()
        threading.Thread(target=load, name="index-loader", daemon=True).start()
        yield
        await state.batcher.stop()

    app = FastAPI(
        title="Forage retriever",
        description="Search-R1 compatible dense/BM25 retrieval (POST /retrieve).",
        lifespan=lifespan,
    )
    app.state.forage = state
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        """The schema, less the per-request knobs the loaded index does not have: a client
        generated from it (or a fuzzer) then never sends `nprobe` to an HNSW index."""
        schema = default_openapi()
        if not state.ready.is_set():
            return schema
        knobs = getattr(state.searcher, "knobs", frozenset())
        schema = copy.deepcopy(schema)
        body = schema["paths"]["/retrieve"]["post"]["requestBody"]["content"][
            "application/json"]["schema"]
        for field, knob in SEARCH_FIELDS:
            if knob not in knobs:
                body.get("properties", {}).pop(field, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.post(
        "/retrieve",
        response_model=RetrieveResponse,
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": request_model(settings).model_json_schema()}}}},
        responses={400: {"description": "body is not JSON"},
                   413: {"description": "body, query list, results or characters over the "
                                        "limit"},
                   422: {"description": "a field is invalid; the message names it"},
                   503: {"description": "index still loading"}},
    )
    async def retrieve(request: Request):
        started = time.perf_counter()
        status, payload = await _retrieve(request)
        REQUESTS.labels(status=str(status)).inc()
        LATENCY.observe(time.perf_counter() - started)
        return JSONResponse(payload, status_code=status)

    async def _retrieve(request: Request) -> tuple[int, dict[str, Any]]:
        if not state.ready.is_set():
            return 503, {"detail": state.error or "index is loading"}
        try:
            queries, topk, return_scores, options = parse_request_options(
                await request.body(), settings, getattr(state.searcher, "knobs", frozenset()))
        except BadRequest as exc:
            return exc.status, {"detail": exc.message}
        assert state.batcher is not None
        key: Any = topk
        if options:
            key = (topk, (options.get("nprobe"), options.get("ef_search")))
        try:
            results = await state.batcher.submit(queries, key)
        except Exception:  # noqa: BLE001 (a server fault, never a bad input)
            log.exception("retrieval failed")
            return 500, {"detail": "internal error during retrieval"}
        QUERIES.inc(len(queries))
        if return_scores:
            body = [[{"document": doc, "score": score} for doc, score in per_query]
                    for per_query in results]
        else:
            body = [[doc for doc, _ in per_query] for per_query in results]
        return 200, {"result": body}

    served: dict[str, Any] = {}

    def identity() -> dict[str, Any]:
        """`index_id` and `search_settings` of the loaded index, as the retrieval store keys
        results (services/common/retrieval_store.py): computed once, from its manifest."""
        if not served:
            manifest = getattr(state.searcher, "manifest", None)
            # the precision queries are encoded in changes results too (none for BM25)
            dtype = query_dtype if getattr(state.searcher, "encoder", None) is not None else None
            served.update(served_fields(manifest, settings.search_overrides, dtype)
                          if isinstance(manifest, dict) else
                          {"index_id": None, "search_settings": None})
        return served

    @app.get("/healthz")
    async def healthz(response: Response):
        response.headers[SERVICE_HEADER] = "retriever"  # whose port this is (forage up checks)
        if state.ready.is_set():
            return {"status": "ok", "docs": len(state.searcher),
                    "index_type": state.searcher.index_type, **identity(),
                    "threads": threads_in_use(),
                    "query_dtype": query_dtype if state.searcher.encoder is not None else None}
        detail = state.error or "loading"
        return JSONResponse({"status": detail}, status_code=503,
                            headers={SERVICE_HEADER: "retriever"})

    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        # A route, not a mount: a mount answers /metrics with a redirect to /metrics/.
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    return app
