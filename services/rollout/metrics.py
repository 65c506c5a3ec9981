"""Prometheus metrics of the rollout service (docs/architecture.md); names start with forage_rollout_."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

TOKENS = Counter("forage_rollout_generated_tokens", "Policy tokens generated")
TOKENS_PER_S = Gauge("forage_rollout_tokens_per_second", "Generated tokens/s over the last batch")
BATCH_OCCUPANCY = Gauge("forage_rollout_batch_occupancy", "Running requests / max batch size")
TURNS = Counter("forage_rollout_turns", "Generation turns by action", ["action"])
SEARCHES = Counter("forage_rollout_searches", "Search actions executed")
INVALID = Counter("forage_rollout_invalid_actions", "Turns without a valid action")
FINISHED = Counter("forage_rollout_trajectories", "Finished trajectories", ["finish_reason"])
RETRIEVER_LATENCY = Histogram(
    "forage_rollout_retriever_latency_seconds", "Batched /retrieve call latency (with retries)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
RETRIEVER_ERRORS = Counter("forage_rollout_retriever_errors", "Failed /retrieve attempts")
REJECTED_QUERIES = Counter("forage_rollout_rejected_queries",
                           "Search queries refused (by the client's check or the server)")
POLICY_VERSION = Gauge("forage_rollout_policy_version", "Policy version being served")
WEIGHT_SYNC_SECONDS = Histogram(
    "forage_rollout_weight_sync_seconds", "Time to fetch and load new weights",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
WEIGHT_SYNC_FAILURES = Counter("forage_rollout_weight_sync_failures", "Failed weight fetches")
GROUPS = Counter("forage_rollout_groups", "Prompt groups published", ["kind"])
PROBE_COMPLETIONS = Counter("forage_rollout_probe_completions", "Probe completions sampled")
PREFIX_CACHE_RESET_FAILURES = Counter(
    "forage_rollout_prefix_cache_reset_failures",
    "Failed attempts to drop prefix-cache blocks computed with old weights (vLLM)",
)
TOOL_CALLS = Counter(
    "forage_rollout_tool_calls", "Tool calls (rollout.protocol tool_calls) by tool and outcome",
    ["tool", "outcome"],
)
TOOL_RETRIES = Counter(
    "forage_rollout_tool_retries",
    "Further attempts of user and MCP tool calls after a transient failure, by tool",
    ["tool"],
)
TOOL_LATENCY = Histogram(
    "forage_rollout_tool_latency_seconds",
    "Seconds from a tool call's parse to its result (search: queueing + batched /retrieve)",
    ["tool"], buckets=(0.0001, 0.001, 0.005, 0.025, 0.1, 0.5, 1, 2.5, 10, 30),
)
RETRIEVAL_CACHE_QUERIES = Counter(
    "forage_rollout_retrieval_cache_queries",
    "Search queries by rollout.retrieval_cache mode cache: hit (answered from the store) or miss",
    ["result"],
)
RETRIEVAL_CACHE_ASKED = Counter(
    "forage_rollout_retrieval_cache_retriever_queries",
    "Distinct missed queries the cache asked the retriever (a batch asks each once)",
)
RETRIEVAL_CACHE_EVICTIONS = Counter(
    "forage_rollout_retrieval_cache_evictions",
    "Least-recently-used rows this replica evicted to keep the store under max_bytes",
)
RETRIEVAL_CACHE_CONFLICTS = Counter(
    "forage_rollout_retrieval_cache_conflicts",
    "Live answers that differ from the stored one under the same key (the live one served)",
)
RETRIEVAL_CACHE_BYTES = Gauge(
    "forage_rollout_retrieval_cache_bytes",
    "Bytes of the rows in the shared retrieval cache store (all replicas' rows)",
)
