"""`docker compose up` of the repository's docker-compose.yml with the CPU layout file, in real
containers on this machine.

The private engine and `forage:cpu` come from conftest.py (deploy/Dockerfile built offline on
local stand-ins for the base images; the Redis, exporter and Prometheus images are stand-ins
too, under the names the compose file uses). The compose files run as users run them, with
`docker compose` (Compose v2 as a CLI plugin) and one test-only file, written below, for what
this machine's engine or the test itself needs:
- Docker Engine 20.10 (API 1.41) refuses `healthcheck.start_interval` (Engine 25, API 1.44):
  the key is reset when the engine is older; docs/deploy.md states the minimum.
- Published ports go to free host ports (`127.0.0.1::PORT`) so the test cannot collide with
  anything else listening here; it asks `docker compose port` where they went.
Before `up`, the Redis users and their passwords and the TLS certificates are made with
docs/deploy.md's commands, into folders FORAGE_REDIS_SECRETS and FORAGE_TLS_SECRETS name (as
.env would), not the repository's ./secrets. TLS is on, as shipped: Redis refuses a client
without TLS and, over TLS, one without a user; the weight server answers a caller without TLS
with nothing and refuses one without the token.
Then: every healthcheck passes, nothing restarts, /retrieve answers from outside the
containers, the learner finishes 2 RL steps with the rollout replica on vLLM's CPU build
serving the weights it published, Prometheus has scraped every target, and
`docker compose down` stops the learner at a step boundary with a checkpoint written to the
`forage-checkpoints` volume. Traffic goes only to loopback and to the containers made here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.suite_rules import missing_tool, require_tool

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PROJECT = "forage-compose-test"
ONE_SHOT = {"data", "retriever-index"}
HEALTHCHECKED = {"redis", "retriever", "rollout", "scorer", "learner"}
RUNNING = {"redis-exporter", "prometheus"}
PUBLISHED = {"retriever": 8000, "scorer": 8010, "learner": 9102, "prometheus": 9090}
STEPS = 2
MIN_COMPOSE = (2, 24, 4)  # `!reset` / `!override` in the layout files
# docs/deploy.md ("Try the stack without a GPU"): the users of the CPU layout's namespace
REDIS_ACL = ["redis", "acl", "--config", "configs/search_r1_nq_hotpotqa.yaml",
             "--config", "configs/compose_cpu.yaml", "--out"]
TLS_CERTS = ["tls", "certs", "--out"]
# Run in the scorer's container (it has the CA): the weight server's answer to a caller without
# TLS, then to one with TLS and the CA but no token.
WEIGHT_SYNC_PROBE = """
from services.common.weight_sync.client import WeightSyncClient, WeightSyncError
for ca in (None, "/run/secrets/tls-ca"):
    try:
        with WeightSyncClient("learner:50051", tune_malloc=False, timeout_s=10,
                              tls_ca_file=ca) as client:
            client.get_version()
        print("answered")
    except WeightSyncError as exc:
        print(exc.reason)
"""


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


class Compose:
    """`docker compose -p PROJECT -f docker-compose.yml -f deploy/compose/cpu.yml -f TEST` in
    the repository (its ./configs and ./deploy/prometheus are bind-mounted as users have them)."""

    def __init__(self, engine: Any, test_file: Path, secrets: Path) -> None:
        self.engine = engine
        self.files = [REPO / "docker-compose.yml", REPO / "deploy" / "compose" / "cpu.yml",
                      test_file]
        self.env = dict(os.environ, **engine.env, FORAGE_WEIGHT_SYNC_TOKEN="compose-test-token",
                        FORAGE_REDIS_SECRETS=str(secrets / "redis"),
                        FORAGE_TLS_SECRETS=str(secrets / "tls"))

    def run(self, *args: str, timeout: float = 600, check: bool = True
            ) -> subprocess.CompletedProcess:
        argv = [self.engine.cli, "compose", "-p", PROJECT, "--project-directory", str(REPO)]
        for file in self.files:
            argv += ["-f", str(file)]
        res = subprocess.run([*argv, *args], cwd=REPO, env=self.env, capture_output=True,
                             text=True, timeout=timeout, check=False)
        if check and res.returncode != 0:
            failed = ""
            if args and args[0] == "up":  # what the services that stopped or failed said
                logs = subprocess.run([*argv, "logs", "--no-color", "--tail", "40"], cwd=REPO,
                                      env=self.env, capture_output=True, text=True,
                                      timeout=120, check=False).stdout
                failed = f"\nthe services' last lines:\n{logs[-8000:]}"
            raise AssertionError(f"docker compose {' '.join(args)} exited {res.returncode}:\n"
                                 f"{res.stdout[-3000:]}\n{res.stderr[-5000:]}{failed}")
        return res

    def containers(self) -> dict[str, dict[str, Any]]:
        """service -> `docker inspect` of its (first) container, stopped ones included."""
        ids = self.run("ps", "-a", "-q").stdout.split()
        if not ids:
            return {}
        out = self.engine.docker("inspect", *ids).stdout
        return {c["Config"]["Labels"]["com.docker.compose.service"]: c for c in json.loads(out)}

    def logs(self, service: str, tail: int = 60) -> str:
        return self.run("logs", "--no-color", "--tail", str(tail), service, check=False).stdout

    def host_port(self, service: str, port: int) -> int:
        out = self.run("port", service, str(port)).stdout.strip()
        return int(out.rsplit(":", 1)[1])


def _test_file(tmp_path: Path, engine_api: tuple[int, ...]) -> Path:
    """The test-only compose file: free host ports; start_interval off for engines < 25."""
    services: dict[str, dict[str, Any]] = {}
    for service, port in PUBLISHED.items():
        services.setdefault(service, {})["ports"] = f"!override ['127.0.0.1::{port}']"
    if engine_api < (1, 44):
        for service in HEALTHCHECKED - {"redis"}:
            services.setdefault(service, {})["healthcheck"] = {"start_interval": "!reset null"}
    lines = ["services:"]
    for service, keys in services.items():
        lines.append(f"  {service}:")
        for key, value in keys.items():
            if isinstance(value, dict):
                lines.append(f"    {key}:")
                lines += [f"      {k}: {v}" for k, v in value.items()]
            else:
                lines.append(f"    {key}: {value}")
    path = tmp_path / "compose.test.yml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _state(container: dict[str, Any]) -> str:
    state = container["State"]
    health = (state.get("Health") or {}).get("Status")
    return health or state["Status"]


def _wait_until_up(compose: Compose, deadline: float) -> dict[str, dict[str, Any]]:
    """Poll until the one-shots exited 0 and every service is healthy / running; fail at once
    on a one-shot that failed, a service that exited or restarted, or an unhealthy one."""
    wanted = ONE_SHOT | HEALTHCHECKED | RUNNING
    while True:
        containers = compose.containers()
        for service, c in containers.items():
            state = c["State"]
            if c["RestartCount"]:
                pytest.fail(f"{service} restarted {c['RestartCount']}x:\n{compose.logs(service)}")
            if state["Status"] == "exited" and (service not in ONE_SHOT or state["ExitCode"]):
                pytest.fail(f"{service} exited {state['ExitCode']}:\n{compose.logs(service)}")
            if _state(c) == "unhealthy":
                pytest.fail(f"{service} is unhealthy:\n{compose.logs(service)}")
        done = {s for s, c in containers.items()
                if (s in ONE_SHOT and c["State"]["Status"] == "exited")
                or (s in HEALTHCHECKED and _state(c) == "healthy")
                or (s in RUNNING and c["State"]["Status"] == "running")}
        if done >= wanted:
            return containers
        if time.monotonic() > deadline:
            states = {s: _state(c) for s, c in containers.items()}
            pytest.fail(f"not up in time: {states}\n"
                        + "\n".join(compose.logs(s, 20) for s in sorted(wanted - done)))
        time.sleep(3)


def _http_json(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _prometheus(port: int, path: str, **params: str) -> Any:
    query = urllib.parse.urlencode(params)
    reply = _http_json(f"http://127.0.0.1:{port}/api/v1/{path}" + (f"?{query}" if query else ""))
    assert reply["status"] == "success", reply
    return reply["data"]


@pytest.fixture()
def compose(forage_cpu_image, tmp_path):
    require_tool(forage_cpu_image.cli, "make test installs Debian's docker.io as root")
    engine = forage_cpu_image
    version = engine.docker("compose", "version", "--short", check=False)
    if version.returncode != 0 or _version(version.stdout) < MIN_COMPOSE:
        missing_tool("no docker compose plugin >= 2.24.4 (make test installs it as root)")
    api = engine.docker("version", "--format", "{{.Server.APIVersion}}").stdout
    secrets = tmp_path / "secrets"
    for command, folder in ((REDIS_ACL, "redis"), (TLS_CERTS, "tls")):
        made = subprocess.run([str(Path(sys.executable).with_name("forage")), *command,
                               str(secrets / folder)], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert made.returncode == 0, made.stderr
    project = Compose(engine, _test_file(tmp_path, _version(api)), secrets)
    try:
        yield project
    finally:
        project.run("down", "-v", "--remove-orphans", "--timeout", "10", check=False)


# `up` waits for every healthcheck (up to 900 s) and the steps for up to 600 s more.
@pytest.mark.timeout(1800)
@pytest.mark.allow_slow(reason="docker compose up of the whole CPU stack in containers: the "
                        "learner's op build, vLLM's start in the rollout container and 2 RL "
                        "steps, 200-500 s on 2 cores")
def test_compose_up_cpu_layout_trains_scrapes_and_checkpoints_on_down(compose):
    started = time.monotonic()
    compose.run("up", "-d", "--no-build", "--quiet-pull", timeout=900)
    containers = _wait_until_up(compose, started + 900)
    up_s = time.monotonic() - started
    for service, c in containers.items():
        image = c["Config"]["Image"]
        if service in ONE_SHOT | (HEALTHCHECKED - {"redis"}):
            assert image == "forage:cpu", (service, image)
            assert c["Config"]["User"] == "1000:1000", service

    # The retriever, from outside the containers, on the index the stack built itself.
    retriever = compose.host_port("retriever", 8000)
    reply = _http_json(f"http://127.0.0.1:{retriever}/retrieve",
                       {"queries": ["Where was the inventor born?"], "topk": 1,
                        "return_scores": True})
    hits = reply["result"][0]
    assert len(hits) == 1 and hits[0]["document"]["contents"], reply
    # Redis speaks TLS only, and over TLS lets no one in without a user (the services and the
    # exporter log in as theirs, with the CA).
    plain = compose.run("exec", "-T", "redis", "redis-cli", "ping", check=False)
    said = plain.stdout + plain.stderr
    assert "PONG" not in said and "NOAUTH" not in said, plain
    anonymous = compose.run("exec", "-T", "redis", "redis-cli", "--tls", "--cacert",
                            "/run/secrets/tls-ca", "ping", check=False)
    assert "NOAUTH" in anonymous.stdout + anonymous.stderr, anonymous
    # The weight server speaks TLS only and still wants the token.
    probe = compose.run("exec", "-T", "scorer", "python", "-c", WEIGHT_SYNC_PROBE, check=False)
    answers = probe.stdout.split()
    assert len(answers) == 2 and answers[0] not in ("auth", "answered"), probe
    assert answers[1] == "auth", probe

    # The learner finishes 2 RL steps, seen through Prometheus, which scrapes every target.
    prometheus = compose.host_port("prometheus", 9090)
    deadline = time.monotonic() + 600
    step = 0.0
    while time.monotonic() < deadline:
        result = _prometheus(prometheus, "query", query="forage_learner_step")["result"]
        step = max([float(r["value"][1]) for r in result] or [0.0])
        if step >= STEPS:
            break
        time.sleep(5)
    assert step >= STEPS, compose.logs("learner") + compose.logs("rollout")
    targets = _prometheus(prometheus, "targets")["activeTargets"]
    health = {t["labels"]["job"]: t["health"] for t in targets}
    assert health == {job: "up" for job in ("retriever", "rollout", "scorer", "learner",
                                            "redis")}, targets
    # Each service's own metrics, as scraped (a labelled counter appears with its first event,
    # and the last scrape may predate it: poll).
    # The replica serves a policy version the learner published (vLLM took the weights).
    wanted = {"forage_retriever_index_loaded": 1.0, "redis_up": 1.0,
              "forage_rollout_generated_tokens_total": 1.0, "forage_scorer_items_total": 1.0,
              "forage_rollout_policy_version": 1.0}
    seen: dict[str, float] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(seen.get(m, 0.0) < v for m, v in wanted.items()):
        for metric in wanted:
            result = _prometheus(prometheus, "query", query=f"sum({metric})")["result"]
            seen[metric] = float(result[0]["value"][1]) if result else 0.0
        time.sleep(3)
    assert all(seen[m] >= v for m, v in wanted.items()), seen
    # The layout's rollout engine is vLLM's CPU build, inside forage:cpu, reloading weights.
    rollout_log = compose.run("logs", "--no-color", "rollout", check=False).stdout
    assert "Initializing a V1 LLM engine" in rollout_log, rollout_log[-3000:]
    assert re.search(r"loaded policy version [1-9]", rollout_log), rollout_log[-3000:]

    # `docker compose down`: the learner (torchrun, then the rank) stops at a step boundary and
    # saves into the named volume, which down keeps.
    stopped = time.monotonic()
    compose.run("down", timeout=600)
    down_s = time.monotonic() - stopped
    listing = compose.engine.docker(
        "run", "--rm", "-v", f"{PROJECT}_forage-checkpoints:/checkpoints:ro", "--entrypoint",
        "sh", "forage:cpu", "-c", "cat /checkpoints/latest && ls /checkpoints").stdout.split()
    latest = listing[0]
    assert re.fullmatch(r"step_\d{8}", latest) and int(latest[5:]) >= STEPS, listing
    assert latest in listing[1:], listing
    print(f"compose: up (healthy) {up_s:.0f}s, down {down_s:.0f}s, checkpoint {latest}")
