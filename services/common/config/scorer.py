"""Scorer settings: worker pool, custom rewards (docs/architecture.md)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from services.common.config.base import Section


class RewardSpec(Section):
    # A registered reward name ("qa_em", "countdown", ...) or "module:function".
    function: str
    weight: float = 1.0  # weight of this reward in the sum
    # Keyword options for a built-in function (e.g. qa_em_format's structure_format_score,
    # gsm8k's method); users' module:function rewards keep verl's exact signature.
    options: dict[str, Any] = Field(default_factory=dict)
    # Run it in the worker-process pool with the wall-clock limit (None: built-in default,
    # which is true for math_verify only). For slow or untrusted custom rewards.
    isolated: bool | None = None


class ScorerSection(Section):
    # Reward worker processes (math_verify and other isolated rewards).
    num_workers: int = Field(default=2, ge=1)
    # Outer wall-clock limit per reward call in the pool (isolated rewards, and every reward
    # POST /score runs): past it the worker is killed and replaced and the call scores 0
    # (counted in forage_scorer_timeouts_total).
    math_timeout_s: float = Field(default=5.0, gt=0)
    # data_source -> reward functions with weights; empty means the built-in table.
    rewards: dict[str, list[RewardSpec]] = Field(default_factory=dict)
    host: str = "127.0.0.1"  # bind address of its HTTP servers
    # POST /score, /healthz, /metrics (FastAPI) served next to the stream worker; 0 = any
    # free port (logged); set `http: false` to run the stream worker alone.
    port: int = Field(default=8010, ge=0, le=65535)
    http: bool = True  # serve POST /score (false: the stream worker alone)
    # POST /score refuses larger bodies with 413 before reading them whole (a 32k-token
    # response is ~130 KB of text).
    max_body_bytes: int = Field(default=2 * 1024 * 1024, ge=1)
    # Prometheus /metrics + /healthz of the stream worker (0: any free port, logged).
    metrics_port: int = Field(default=0, ge=0, le=65535)
    # Tokenizer that decodes response ids (None: model.tokenizer_path, else model.path).
    tokenizer_path: str | None = None
    # Rollout messages read per batch and how long one read blocks.
    batch_size: int = Field(default=32, ge=1)
    block_ms: int = Field(default=1000, ge=1)  # how long one read blocks, in ms
    # Consumer name in the `scorer` group (None: scorer-<host>-<pid>).
    name: str | None = None
