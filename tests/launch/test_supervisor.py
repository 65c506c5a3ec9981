"""`forage up` waits for each child's /healthz: a port that answers in another protocol, or as
another service, is a one-line error naming the port and the service, not a crash."""

from __future__ import annotations

import socket
import sys
import threading
import time
from concurrent import futures

import pytest

from services.launch.supervisor import ServiceFailed, ServiceSpec, Supervisor
from tests.suite_rules import import_or_skip

# What an HTTP/2 server (gRPC) sends first on any connection: an empty SETTINGS frame.
HTTP2_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _sleeper(name: str, port: int, health_name: str | None = None) -> ServiceSpec:
    """A child that stays up and never listens, so whatever answers on `port` is not it."""
    return ServiceSpec(name, [sys.executable, "-c", "import time; time.sleep(60)"],
                       health_url=f"http://127.0.0.1:{port}/healthz", health_name=health_name,
                       restart=False, stop_timeout_s=5.0)


def _wait_fails(supervisor: Supervisor, spec: ServiceSpec) -> str:
    supervisor.start(spec)
    started = time.monotonic()
    with pytest.raises(ServiceFailed) as caught:
        supervisor.wait_healthy(spec.name, timeout_s=20)
    assert time.monotonic() - started < 10  # at once, not after the health timeout
    assert supervisor.children[spec.name].process.poll() is None  # the child itself is fine
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.fixture()
def supervisor(tmp_path):
    sup = Supervisor(tmp_path / "run")
    yield sup
    sup.stop_all()


def test_a_grpc_server_on_the_port_is_a_one_line_error(supervisor):
    grpc = import_or_skip("grpc", "grpcio, a dependency of forage (make install)")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        message = _wait_fails(supervisor, _sleeper("scorer", port, "scorer"))
    finally:
        server.stop(None)
    assert f"port {port}" in message and "scorer" in message, message
    assert "not HTTP" in message, message


def test_http2_bytes_on_the_port_are_a_one_line_error(supervisor):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def answer() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:  # read the request, as gRPC reads the client's preface
                    conn.recv(65536)
                    conn.sendall(HTTP2_SETTINGS)

        threading.Thread(target=answer, daemon=True).start()
        message = _wait_fails(supervisor, _sleeper("rollout-0", port, "rollout-0"))
        listener.shutdown(socket.SHUT_RDWR)
    assert f"port {port}" in message and "rollout-0" in message, message
    assert "not HTTP" in message, message


def test_another_services_healthz_is_a_one_line_error(supervisor):
    from prometheus_client import CollectorRegistry

    from services.common.metrics import MetricsServer

    other = MetricsServer(service="learner", registry=CollectorRegistry()).start()
    try:
        message = _wait_fails(supervisor, _sleeper("scorer", other.port, "scorer"))
    finally:
        other.stop()
    assert f"port {other.port}" in message, message
    assert "scorer" in message and "learner" in message, message


def test_the_service_itself_is_healthy(supervisor):
    from prometheus_client import CollectorRegistry

    from services.common.metrics import MetricsServer

    own = MetricsServer(service="scorer", registry=CollectorRegistry()).start()
    try:
        supervisor.start(_sleeper("scorer", own.port, "scorer"))
        supervisor.wait_healthy("scorer", timeout_s=20)
    finally:
        own.stop()
