"""Client of the retriever's Search-R1 `/retrieve` (docs/architecture.md) with timeout and retries.

Search-R1's client has neither; a retriever restart then hangs or kills a whole training step.
Here a failed call is retried with exponential backoff and, if it keeps failing, raises
`RetrieverError` so the agent loop can end the affected trajectories with finish_reason=error.

One bad query never fails the others (docs/rollout.md, "Bad queries"). Each query is checked
here first (length, valid Unicode); one that fails gets a `QueryRejected` instead of passages,
and is not sent. If the server still refuses a request for its content (400 / 413 / 422), the
request is split in halves and each half retried, down to single queries, so only the queries
the server refuses get a `QueryRejected` and the rest are answered. Only an outage (no
connection, 5xx / 408 / 429 after every retry, garbage replies) or a refusal that is not about
the queries (404, 401, a bad `topk`) raises `RetrieverError`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx

from services.common.redact import redact_text, redact_url

# A query not answered: shared with the recorded-results store (services/common).
from services.common.retrieval_store import (
    QueryFailed,
    QueryRejected,
    healthz_url,
    retrieval_tag,
)
from services.rollout import metrics

__all__ = ["QueryFailed", "QueryRejected", "RetrieverClient", "RetrieverError"]

log = logging.getLogger("forage.rollout.retrieval")

Docs = list[dict[str, Any]]
# A refusal about the request's content: split the request and retry the halves.
CONTENT_STATUSES = (400, 413, 422)
# Worth retrying as is: the server is overloaded or restarting.
TRANSIENT_STATUSES = (408, 429)
# Details of Forage's retriever that name a request-wide field, not a query.
REQUEST_FIELDS = ("topk", "return_scores")
# How long the index identity read from /healthz is trusted; a failed call forgets it at once
# (a restarted retriever may serve another index or settings).
TAG_MAX_AGE_S = 60.0


class RetrieverError(RuntimeError):
    """The retriever stayed unreachable, answered garbage, or refused every request."""


class RetrieverClient:
    def __init__(
        self,
        url: str,
        topk: int = 3,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.25,
        max_backoff_s: float = 8.0,
        max_query_chars: int = 2048,
    ) -> None:
        self.url = url
        self.topk = topk
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_query_chars = max_query_chars
        self._client = httpx.Client(timeout=timeout_s)
        self._tag: str | None = None
        self._tag_at: float | None = None  # monotonic time of the last answer from /healthz

    @property
    def retrieval_tag(self) -> str | None:
        """`<index identity>@<settings>` of what the retriever serves, from its /healthz
        (services/common/retrieval_store.py), for the search turns to record; None when it
        reports none (an older retriever) or cannot be asked now. Re-read every
        TAG_MAX_AGE_S and after any failed call."""
        now = time.monotonic()
        if self._tag_at is not None and now - self._tag_at < TAG_MAX_AGE_S:
            return self._tag
        try:
            response = self._client.get(healthz_url(self.url), timeout=5.0)
            body = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None  # asked again next time
        if response.status_code == 503:  # loading: asked again next time
            return None
        identity = body.get("index_id") if isinstance(body, dict) else None
        settings = body.get("search_settings") if isinstance(body, dict) else None
        self._tag = (retrieval_tag(identity, settings, self.topk)
                     if isinstance(identity, str) and identity and isinstance(settings, dict)
                     else None)
        self._tag_at = now
        return self._tag

    def check_query(self, query: str) -> str | None:
        """Why the query cannot be sent, or None. The empty query is sent: Search-R1 retrieves
        for it (its agent sends "" for `<search> </search>`)."""
        if not isinstance(query, str):
            return f"the query is a {type(query).__name__}, not text"
        if len(query) > self.max_query_chars:
            return f"the query is longer than {self.max_query_chars} characters ({len(query)})"
        try:
            query.encode("utf-8")
        except UnicodeEncodeError:
            return "the query is not valid Unicode"
        return None

    def retrieve(self, queries: Sequence[str]) -> list[Docs | QueryRejected]:
        """Per query, in order: a list of `{"document", "score"}` items, or `QueryRejected`.

        Raises RetrieverError only when the retriever cannot answer at all (see the module)."""
        started = time.perf_counter()
        out: list[Docs | QueryRejected | None] = [None] * len(queries)
        positions = []
        for position, query in enumerate(queries):
            problem = self.check_query(query)
            if problem is None:
                positions.append(position)
            else:
                out[position] = QueryRejected(problem)
        if positions:
            self._answer(list(queries), positions, out)
        rejected = sum(isinstance(item, QueryRejected) for item in out)
        if rejected:
            metrics.REJECTED_QUERIES.inc(rejected)
        metrics.RETRIEVER_LATENCY.observe(time.perf_counter() - started)
        return [item for item in out if item is not None]

    def _answer(self, queries: list[str], positions: list[int],
                out: list[Docs | QueryRejected | None]) -> None:
        """Fill `out` at `positions`, halving the request while the server refuses it."""
        status, body = self._post([queries[p] for p in positions])
        if status == 200:
            for position, docs in zip(positions, body, strict=True):
                out[position] = docs
            return
        if len(positions) == 1:
            log.warning("retriever refused query %r: HTTP %d: %s", queries[positions[0]][:80],
                        status, body)
            out[positions[0]] = QueryRejected(f"the retriever refused the query ({body})")
            return
        middle = len(positions) // 2
        self._answer(queries, positions[:middle], out)
        self._answer(queries, positions[middle:], out)

    def _post(self, queries: list[str]) -> tuple[int, Any]:
        """(200, per-query results) or (4xx, detail) for a refusal about the queries;
        retries everything else and raises RetrieverError when retries run out."""
        body = {"queries": queries, "topk": self.topk, "return_scores": True}
        last_error = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))
            try:
                response = self._client.post(self.url, json=body)
                status = response.status_code
                if status in CONTENT_STATUSES:
                    detail = _detail(response)
                    if detail.startswith(REQUEST_FIELDS):
                        raise RetrieverError(f"retriever at {redact_url(self.url)} refused "
                                             f"the request: HTTP {status}: {detail}")
                    return status, detail
                if 400 <= status < 500 and status not in TRANSIENT_STATUSES:
                    # Not about the queries (wrong URL, auth): no query can be answered.
                    raise RetrieverError(f"retriever at {redact_url(self.url)} refused the "
                                         f"request: HTTP {status}: {response.text[:200]}")
                if status != 200:
                    raise _Retry(f"HTTP {status}: {response.text[:200]}")
                result = response.json()["result"]
                if not isinstance(result, list) or len(result) != len(queries):
                    raise _Retry("response 'result' does not match the queries")
                return 200, result
            except _Retry as exc:
                last_error = str(exc)
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                last_error = f"{type(exc).__name__}: {redact_text(str(exc))}"
            metrics.RETRIEVER_ERRORS.inc()
            self._tag_at = None  # it may come back serving something else
            log.warning("retrieve attempt %d/%d failed: %s", attempt + 1, self.retries + 1,
                        last_error)
        raise RetrieverError(
            f"retriever at {redact_url(self.url)} failed after {self.retries + 1} attempts: "
            f"{last_error}"
        )

    def close(self) -> None:
        self._client.close()


class _Retry(Exception):
    """An attempt failed in a way another attempt may not."""


def _detail(response: httpx.Response) -> str:
    """The server's one-line reason (Forage's and FastAPI's `detail`), else the body's start."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, str):
        return detail[:300]
    text = str(detail) if detail is not None else response.text
    return f"HTTP {response.status_code}: {text[:300]}"
