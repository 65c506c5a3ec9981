"""Retriever settings: where the index is, how it is served (docs/architecture.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from services.common.config.base import Section


class RetrieverSection(Section):
    # Client side: where rollout replicas send /retrieve.
    url: str = "http://127.0.0.1:8000/retrieve"
    topk: int = Field(default=3, ge=1)  # passages returned per search
    timeout_s: float = Field(default=30.0, gt=0)  # client: time limit of one /retrieve request
    retries: int = Field(default=3, ge=0)  # client: further tries after a failed request
    # Server side.
    index_dir: str | None = None  # the index directory `build-index` wrote; `forage up` serves it
    host: str = "127.0.0.1"  # server: bind address (0.0.0.0 in containers and pods)
    port: int = Field(default=8000, ge=0, le=65535)  # server: HTTP port (0: any free port)
    device: str = "cpu"  # where the encoder and the index run: cpu, cuda or cuda:N
    # Where each half runs; null = follow `device`, so a config that sets only `device` places
    # both as before. encoder_device: cpu, cuda or cuda:N (the query encoder, torch).
    # index_device: cpu, cuda or cuda:N, or cuda:all (= cuda: every visible GPU) for the FAISS
    # index; on several GPUs index_gpu_mode shard splits the vectors between them (each holds
    # 1/n, every query goes to all) and replicate gives each a full copy (queries split between
    # them). A cuda placement needs a CUDA torch / a GPU faiss; without one the server refuses
    # to start (docs/retriever.md, "Placement").
    encoder_device: str | None = None
    index_device: str | None = None  # the FAISS index's device (null: `device`)
    # Several GPUs: shard the vectors between them or replicate the index.
    index_gpu_mode: Literal["shard", "replicate"] = "shard"
    # Query-time accuracy/speed of approximate indexes; null = what the build recorded in the
    # manifest (nprobe 32, efSearch 128). nprobe: IVF lists searched (IVF kinds); ef_search:
    # HNSW search breadth (HNSW kinds). Setting one the index lacks stops the server at start.
    # A request may also send its own `nprobe` / `efSearch` (docs/retriever.md).
    nprobe: int | None = Field(default=None, ge=1)
    ef_search: int | None = Field(default=None, ge=1)  # HNSW search breadth (null: the build's)
    # Candidates per result re-ranked exactly, for an index built with `--refine`; null = the
    # build's (10). Setting it for an index without re-ranking stops the server at start.
    k_factor: int | None = Field(default=None, ge=1)
    # Map the FAISS file instead of reading it (CPU only): a replica starts without reading the
    # codes and replicas on one host share the page cache. IVF kinds map their inverted lists;
    # flat and HNSW kinds their vectors and graph (FAISS 1.15). Queries then read pages
    # from disk until they are cached: keep the index on local SSD.
    mmap: bool = False
    # Precision of the query encoder (passages are always encoded in float32). auto: float16
    # on CUDA (Search-R1's `retrieval_use_fp16`), bfloat16 on a CPU with native bf16 arithmetic
    # (AVX-512 BF16 or AMX), else float32 (services/retriever/encoder.py, docs/retriever.md).
    query_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_batch: int = Field(default=64, ge=1)  # queries encoded and searched in one micro-batch
    # Micro-batches run at once, each on its own thread with threads/workers OpenMP threads;
    # 0 = auto: one per thread up to 8 on CPU, 1 on cuda (services/common/threads.py).
    workers: int = Field(default=0, ge=0)
    # Extra wait for a micro-batch to fill when the queue runs dry. 0 by default: requests that
    # arrive while a batch is running already share the next one, and a fixed wait only added
    # its full length to single-query latency on CPU (bench/README.md, "Retriever: HTTP
    # /retrieve vs in-process search"). Raise it on a GPU.
    max_wait_ms: float = Field(default=0.0, ge=0)
    # Search-R1's trainer sends one POST per turn with every active sample's query: 512 (PPO)
    # or 2560 (GRPO, 5 samples). Larger requests are answered in chunks of `max_batch`
    # queries, so memory stays bounded and other clients' requests interleave between chunks.
    max_queries_per_request: int = Field(default=4096, ge=1)  # most queries one POST may carry
    max_topk: int = Field(default=100, ge=1)  # largest topk a request may ask for
    # queries × topk of one request: bounds the response (4096 queries at topk 16).
    max_results_per_request: int = Field(default=65536, ge=1)
    max_query_chars: int = Field(default=2048, ge=1)  # longest query accepted, in characters
    # Characters of all queries of one request together: bounds its encoder work (the cost
    # grows with the text: 512 queries of 2046 characters took 64 s on CPU). 262144
    # holds Search-R1's 2560-query GRPO turn at 100 characters a query (11 s on one CPU
    # thread); a larger request is refused with 413 and Forage's rollout client splits it.
    # At least max_query_chars, so every legal query can be sent alone.
    max_request_chars: int = Field(default=262144, ge=1)
    # Largest request body accepted (413 above): 4096 queries of up to 2048 characters fit
    # (about 8.4 MB of ASCII JSON).
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1)

    @field_validator("encoder_device", "index_device")
    @classmethod
    def _device_spelling(cls, value: str | None, info) -> str | None:
        if value is None:
            return None
        kind, colon, number = value.partition(":")
        if kind == "cpu" and not colon:
            return value
        if kind == "cuda" and (not colon or number.isdigit()):
            return value
        if info.field_name == "index_device" and value == "cuda:all":
            return value
        if info.field_name == "encoder_device" and value == "cuda:all":
            raise ValueError("the encoder runs on one device: use cpu, cuda or cuda:N "
                             "(cuda:all is for retriever.index_device)")
        allowed = ("cpu, cuda, cuda:N or cuda:all" if info.field_name == "index_device"
                   else "cpu, cuda or cuda:N")
        raise ValueError(f"unknown device {value!r} (use {allowed})")

    @property
    def encoder_placement(self) -> str:
        """The encoder's device: encoder_device, or device when that is unset."""
        return self.encoder_device or self.device

    @property
    def index_placement(self) -> str:
        """The FAISS index's device: index_device, or device when that is unset."""
        return self.index_device or self.device

    @property
    def search_overrides(self) -> dict[str, int | None]:
        """The query-time settings this server puts over the build's (None: the build's):
        what the searcher loads with and what /healthz and the retrieval store key results
        by, so each knob is named in one place."""
        return {"nprobe": self.nprobe, "ef_search": self.ef_search, "k_factor": self.k_factor}

    @model_validator(mode="after")
    def _request_holds_one_query(self) -> RetrieverSection:
        if self.max_request_chars < self.max_query_chars:
            raise ValueError(
                f"max_request_chars ({self.max_request_chars}) must be at least max_query_chars "
                f"({self.max_query_chars}): a query of legal length must fit in a request"
            )
        return self
