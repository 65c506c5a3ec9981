"""Retriever settings: where the index is, how it is served (DESIGN.md 3.1)."""

from __future__ import annotations

from pydantic import Field

from services.common.config.base import Section


class RetrieverSection(Section):
    # Client side: where rollout replicas send /retrieve.
    url: str = "http://127.0.0.1:8000/retrieve"
    topk: int = Field(default=3, ge=1)
    timeout_s: float = Field(default=30.0, gt=0)
    retries: int = Field(default=3, ge=0)
    # Server side.
    index_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    device: str = "cpu"
    max_batch: int = Field(default=64, ge=1)
    # Extra wait for a micro-batch to fill when the queue runs dry. 0 by default: requests that
    # arrive while a batch is running already share the next one, and a fixed wait only added
    # its full length to single-query latency on CPU (bench/retriever.md). Raise it on a GPU.
    max_wait_ms: float = Field(default=0.0, ge=0)
    max_queries_per_request: int = Field(default=512, ge=1)
    max_topk: int = Field(default=100, ge=1)
    max_query_chars: int = Field(default=2048, ge=1)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1)
