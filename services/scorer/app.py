"""`POST /score` for scoring by hand or from another tool, with /healthz and /metrics.

The endpoint is a sync handler, so FastAPI runs it on a thread: math_verify cannot run there
(SIGALRM), which is why it goes through the Scorer's worker-process pool like the stream path.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from services.common.metrics import metrics_app
from services.scorer.scoring import Scorer


class ScoreBody(BaseModel):
    data_source: str
    solution_str: str
    ground_truth: Any = None
    extra_info: dict[str, Any] | None = None


class ScoreReply(BaseModel):
    score: float | None = Field(description="weighted total; null when not a number")
    components: dict[str, float | None]
    timeouts: int = 0


def _finite(value: float) -> float | None:
    return None if math.isnan(value) or math.isinf(value) else value


def create_app(scorer: Scorer) -> FastAPI:
    app = FastAPI(title="forage scorer", description="Reward functions of the scorer service")

    @app.post("/score", response_model=ScoreReply)
    def score(body: ScoreBody) -> ScoreReply:
        try:
            scorer.components(body.data_source)
        except KeyError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None
        result = scorer.score_one(body.data_source, body.solution_str, body.ground_truth,
                                  body.extra_info)
        if result.error:
            raise HTTPException(status_code=422, detail=result.error)
        return ScoreReply(score=_finite(result.score),
                          components={k: _finite(v) for k, v in result.components.items()},
                          timeouts=result.timeouts)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    app.mount("/metrics", metrics_app())
    return app


class HttpServer:
    """uvicorn on a background thread over a socket bound here (so port 0 is resolved)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
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
