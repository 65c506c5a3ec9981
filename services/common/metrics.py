"""Prometheus metrics for any service (docs/architecture.md).

FastAPI services mount `metrics_app()` at /metrics; worker processes without an HTTP server
call `start_metrics_server(port)`, which serves /metrics and /healthz on a small thread.
Each service defines its own metrics with `prometheus_client` (Counter, Gauge, Histogram) in
the default registry; this module only exposes them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest


def metrics_app(registry: CollectorRegistry = REGISTRY):
    """An ASGI app serving the registry, to mount on a FastAPI app at /metrics."""
    from prometheus_client import make_asgi_app

    return make_asgi_app(registry=registry)


# The header naming the service on its /healthz answer, so `forage up` can tell its own child
# from another process that holds the port (services/launch/supervisor.py).
SERVICE_HEADER = "X-Forage-Service"


class MetricsServer:
    """/metrics and /healthz on a daemon thread; `port=0` picks a free port (see `.port`).
    `service` names the service in /healthz's X-Forage-Service header ("" leaves it out)."""

    def __init__(
        self,
        port: int = 0,
        host: str = "127.0.0.1",
        healthy: Callable[[], bool] = lambda: True,
        registry: CollectorRegistry = REGISTRY,
        service: str = "",
    ) -> None:
        self._healthy = healthy
        self._registry = registry
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, status, ctype = generate_latest(outer._registry), 200, CONTENT_TYPE_LATEST
                elif path == "/healthz":
                    ok = outer._healthy()
                    body = b"ok\n" if ok else b"not ready\n"
                    status, ctype = (200 if ok else 503), "text/plain"
                else:
                    body, status, ctype = b"not found\n", 404, "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                if service and path == "/healthz":
                    self.send_header(SERVICE_HEADER, service)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # quiet
                return

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:  # name the address: the bare error does not (port in use)
            raise OSError(exc.errno, f"cannot listen on {host}:{port} for /metrics: "
                                     f"{exc.strerror}") from None
        self._server.daemon_threads = True
        self.host = host
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_metrics_server(
    port: int = 0, host: str = "127.0.0.1", healthy: Callable[[], bool] = lambda: True,
    service: str = "",
) -> MetricsServer:
    return MetricsServer(port=port, host=host, healthy=healthy, service=service).start()
