"""`POST /score` for scoring by hand or from another tool, with /healthz and /metrics.

The endpoint is a sync handler, so FastAPI runs it on a thread. Every reward it calls runs in
the Scorer's worker-process pool (`isolate_all`): math_verify needs a main thread (SIGALRM),
and no reward a request reaches may hold a server thread without limit — a pool worker that
makes no progress for `scorer.math_timeout_s` is killed and the call scores 0, while a thread
cannot be stopped. Bodies over `scorer.max_body_bytes` are refused with 413 before they are
read whole. The OpenAPI schema lists the data sources this scorer knows (an enum), so a client
generated from it, or a fuzzer, reaches the reward functions; any other name is a 404.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from services.common.config.scorer import ScorerSection
from services.common.http_limits import BodyLimit
from services.common.metrics import metrics_app
from services.scorer.scoring import Scorer


class ScoreBody(BaseModel):
    # An unknown field is an error naming it: a misspelt `groundtruth` would otherwise be
    # dropped and the reward would complain about a missing ground truth instead.
    model_config = ConfigDict(extra="forbid")

    data_source: str = Field(description="names the reward functions (404 for an unknown one)")
    solution_str: str = Field(description="the decoded response")
    ground_truth: Any = Field(default=None, description="in the shape the reward expects")
    extra_info: dict[str, Any] | None = Field(default=None,
                                              description="verl's extra_info, for custom rewards")


class ScoreReply(BaseModel):
    score: float | None = Field(description="weighted total; null when not a number")
    components: dict[str, float | None]
    timeouts: int = 0


def _finite(value: float) -> float | None:
    return None if math.isnan(value) or math.isinf(value) else value


def create_app(scorer: Scorer, settings: ScorerSection | None = None) -> FastAPI:
    """The app over `scorer`; `settings` (the `scorer` config section) gives the body limit."""
    settings = settings or ScorerSection()
    app = FastAPI(title="forage scorer", description="Reward functions of the scorer service")

    @app.post("/score", response_model=ScoreReply, responses={
        404: {"description": "no reward function for this data source; the known ones listed"},
        413: {"description": "body over scorer.max_body_bytes"},
        422: {"description": "an invalid field, or the reward function raised (its message)"},
    })
    def score(body: ScoreBody) -> ScoreReply:
        try:
            scorer.components(body.data_source)
        except KeyError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None
        result = scorer.score_one(body.data_source, body.solution_str, body.ground_truth,
                                  body.extra_info, isolate_all=True)
        if result.error:
            raise HTTPException(status_code=422, detail=result.error)
        return ScoreReply(score=_finite(result.score),
                          components={k: _finite(v) for k, v in result.components.items()},
                          timeouts=result.timeouts)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    app.mount("/metrics", metrics_app())

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, with the known data sources as `data_source`'s enum."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            field = schema["components"]["schemas"]["ScoreBody"]["properties"]["data_source"]
            field["enum"] = scorer.table.known_sources()
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    return app


class HttpServer:
    """uvicorn on a background thread over a socket bound here (so port 0 is resolved)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:  # name the address: the bare error does not (port in use)
            self.sock.close()
            raise OSError(exc.errno, f"cannot listen on {host}:{port} for POST /score "
                                     f"(scorer.host, scorer.port): {exc.strerror}") from None
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def start(self, timeout_s: float = 30.0) -> HttpServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            raise RuntimeError("the /score server did not start")
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
