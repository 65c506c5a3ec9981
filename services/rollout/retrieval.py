"""Client of the retriever's Search-R1 `/retrieve` (DESIGN.md 3.1) with timeout and retries.

Search-R1's client has neither; a retriever restart then hangs or kills a whole training step.
Here a failed call is retried with exponential backoff and, if it keeps failing, raises
`RetrieverError` so the agent loop can end the affected trajectories with finish_reason=error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx

from services.rollout import metrics

log = logging.getLogger("forage.rollout.retrieval")


class RetrieverError(RuntimeError):
    """The retriever stayed unreachable or answered garbage after all retries."""


class RetrieverClient:
    def __init__(
        self,
        url: str,
        topk: int = 3,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.25,
        max_backoff_s: float = 8.0,
    ) -> None:
        self.url = url
        self.topk = topk
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._client = httpx.Client(timeout=timeout_s)

    def retrieve(self, queries: Sequence[str]) -> list[list[dict[str, Any]]]:
        """One POST for all queries; per-query lists of `{"document", "score"}` items."""
        body = {"queries": list(queries), "topk": self.topk, "return_scores": True}
        last_error = "no attempt"
        started = time.perf_counter()
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))
            try:
                response = self._client.post(self.url, json=body)
                if response.status_code >= 500:
                    raise RetrieverError(f"HTTP {response.status_code}: {response.text[:200]}")
                if response.status_code >= 400:  # our request is wrong: retrying will not help
                    metrics.RETRIEVER_ERRORS.inc()
                    raise RetrieverError(f"HTTP {response.status_code}: {response.text[:200]}")
                result = response.json()["result"]
                if not isinstance(result, list) or len(result) != len(queries):
                    raise RetrieverError("response 'result' does not match the queries")
                metrics.RETRIEVER_LATENCY.observe(time.perf_counter() - started)
                return result
            except RetrieverError as exc:
                if "HTTP 4" in str(exc):
                    raise
                last_error = str(exc)
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            metrics.RETRIEVER_ERRORS.inc()
            log.warning("retrieve attempt %d/%d failed: %s", attempt + 1, self.retries + 1,
                        last_error)
        raise RetrieverError(
            f"retriever at {self.url} failed after {self.retries + 1} attempts: {last_error}"
        )

    def close(self) -> None:
        self._client.close()
