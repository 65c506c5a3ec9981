"""`forage up --config FILE`: every service of one run as local processes on loopback.

Order: Redis (REDIS_URL / the config's, else an embedded server shared by all children — each
child would otherwise start its own), the retriever (when `retriever.index_dir` is set; waited
for until /healthz answers), the learner (it publishes the first weights), the scorer and
`--rollouts` rollout replicas. The run ends when the learner exits 0 (total_steps reached); the
rest are then stopped. A child that crashes is restarted (the learner with `--resume`). Ctrl-C
or SIGTERM stops the learner first (it checkpoints), then the others; nothing is left running.

Every child reads the same resolved config, `RUN_DIR/config.yaml`: ports that were 0 ("any")
are fixed to free ones and the Redis URL is filled in, so all services agree on addresses. The
ports come from one PortAllocator (services/common/ports.py): no two keys get the same port, and
each stays held by the launcher until just before the child that listens there starts.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from services.common.config import SECRETS_VARIABLE, RunConfig
from services.common.ports import PortAllocator
from services.common.redact import redact, secret_leaves
from services.common.threads import child_environ
from services.launch.supervisor import ServiceFailed, ServiceSpec, Supervisor, forage_argv

log = logging.getLogger("forage.launch")

# Credentials and TLS of a Redis the user runs; an embedded one needs none of them.
REDIS_AUTH_KEYS = ("username", "passfile", "tls_ca_file", "tls_cert_file", "tls_key_file")
REDIS_AUTH_VARIABLES = ("REDIS_USERNAME", "REDIS_PASSWORD_FILE", "REDIS_TLS_CA_FILE")


def resolve_config(cfg: RunConfig, redis_url: str, rollouts: int,
                   allocator: PortAllocator | None = None) -> tuple[RunConfig, list[int]]:
    """The config every child reads: Redis URL filled in, "any" ports fixed; also one metrics
    port per rollout replica (each replica gets its own via --set). The ports come from
    `allocator`, which keeps holding them (the caller releases each before its child starts);
    without one, they are still distinct but released on return."""
    if allocator is None:
        with PortAllocator() as own:
            return resolve_config(cfg, redis_url, rollouts, own)
    raw: dict[str, Any] = cfg.model_dump(mode="json")
    raw["redis"]["url"] = redis_url
    retriever = raw["retriever"]
    if retriever.get("index_dir"):
        if not retriever["port"]:
            retriever["port"] = allocator.take()
        host = "127.0.0.1" if retriever["host"] in ("0.0.0.0", "") else retriever["host"]
        retriever["url"] = f"http://{host}:{retriever['port']}/retrieve"
    learner = raw["learner"]
    for key in ("weight_sync_port", "metrics_port"):
        if not learner[key]:
            learner[key] = allocator.take()
    scorer = raw["scorer"]
    for key in ("port", "metrics_port"):
        if not scorer[key]:
            scorer[key] = allocator.take()
    ports = [allocator.take() for _ in range(rollouts)]
    return RunConfig.model_validate(raw), ports


def listen_ports(cfg: RunConfig, rollout_ports: list[int]) -> dict[str, list[int]]:
    """The ports each child of `service_specs` listens on, by name."""
    found = {"retriever": [cfg.retriever.port],
             "learner": [cfg.learner.weight_sync_port, cfg.learner.metrics_port],
             "scorer": [cfg.scorer.port, cfg.scorer.metrics_port]}
    found.update({f"rollout-{index}": [port] for index, port in enumerate(rollout_ports)})
    return found


def children_share(rollouts: int, retriever: bool = True) -> int:
    """How many CPU-heavy processes share the cores: the retriever when this run starts one
    (a run without `retriever.index_dir`, e.g. a single-turn task, has none), the learner, the
    scorer and the replicas."""
    return (1 if retriever else 0) + 2 + rollouts


def write_config(cfg: RunConfig, path: Path) -> Path:
    """Write the config every child reads, its secrets as `***` (tokens, passwords, header
    values, a URL's password: services/common/redact.py); children get the real values from
    `secrets_environ` in their environment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(redact(cfg.model_dump(mode="json")), sort_keys=False))
    return path


def secrets_environ(cfg: RunConfig) -> dict[str, str]:
    """The environment a child needs to read `write_config`'s file with the real secrets:
    FORAGE_CONFIG_SECRETS, the hidden values by path (none when nothing was hidden)."""
    leaves = secret_leaves(cfg.model_dump(mode="json"))
    return {SECRETS_VARIABLE: json.dumps([[list(path), value] for path, value in leaves])
            } if leaves else {}


def service_specs(cfg: RunConfig, config_path: Path, rollout_ports: list[int]) -> list[ServiceSpec]:
    """What to run, in start order."""
    conf = ["--config", str(config_path)]
    specs: list[ServiceSpec] = []
    if cfg.retriever.index_dir:
        host = "127.0.0.1" if cfg.retriever.host in ("0.0.0.0", "") else cfg.retriever.host
        specs.append(ServiceSpec("retriever", forage_argv("retriever", "serve", *conf),
                                 health_url=f"http://{host}:{cfg.retriever.port}/healthz",
                                 health_name="retriever"))
    specs.append(ServiceSpec(
        "learner", forage_argv("learner", "train", *conf),
        health_url=f"http://127.0.0.1:{cfg.learner.metrics_port}/healthz", health_name="learner",
        restart_args=["--resume"], stop_timeout_s=120.0,
    ))
    specs.append(ServiceSpec(
        "scorer", forage_argv("scorer", "serve", *conf),
        health_url=f"http://127.0.0.1:{cfg.scorer.metrics_port}/healthz", health_name="scorer",
    ))
    for index, port in enumerate(rollout_ports):
        name = f"rollout-{index}"
        specs.append(ServiceSpec(
            name, forage_argv("rollout", "serve", *conf, "--set", f"rollout.name={name}",
                              "--set", f"rollout.metrics_port={port}"),
            health_url=f"http://127.0.0.1:{port}/healthz", health_name=name,
        ))
    return specs


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop()


def run_up(
    cfg: RunConfig,
    *,
    rollouts: int = 1,
    on_tick: Callable[[Supervisor], None] | None = None,
    on_start: Callable[[Supervisor], None] | None = None,
) -> int:
    """Run every service until the learner finishes; returns the learner's exit code (130 on
    Ctrl-C). `on_tick` runs about twice a second (progress printing, fault drills)."""
    from services.common.redis_server import DEFAULT_URL, ensure_redis
    from services.common.streams import auth_options

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    redis_server = ensure_redis(cfg.redis.url, allow_embedded=cfg.redis.embedded,
                                options=auth_options(cfg.redis, cfg.redis.url or DEFAULT_URL))
    if redis_server.embedded:
        log.info("started an embedded Redis at %s for this run", redis_server.url)
        # It has no users and no TLS: the children connect to it without credentials.
        cfg = cfg.model_copy(update={"redis": cfg.redis.model_copy(update=dict.fromkeys(
            REDIS_AUTH_KEYS))})
    allocator = PortAllocator()
    resolved, ports = resolve_config(cfg, redis_server.url, rollouts, allocator)
    config_path = write_config(resolved, run_dir / "config.yaml")
    # Several CPU-bound services share the cores: one OpenMP pool each of the default size
    # oversubscribes them badly (measured ~5x slower steps on 2 cores), so each child gets
    # cores / (3 + rollouts) threads unless the user set a count (services/common/threads.py);
    # 2 + rollouts when no retriever runs.
    env = child_environ(os.environ, share=children_share(rollouts,
                                                         retriever=bool(cfg.retriever.index_dir)))
    env["REDIS_URL"] = redis_server.url
    if redis_server.embedded:
        for variable in REDIS_AUTH_VARIABLES:
            env.pop(variable, None)
    env.pop(SECRETS_VARIABLE, None)  # config.yaml has its secrets redacted: they go here
    env.update(secrets_environ(resolved))
    supervisor = Supervisor(run_dir, env=env)
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    # Ctrl-C too, explicitly: a process started in the background by a non-interactive shell
    # (nohup, CI runners) inherits SIGINT as ignored, and Python then never raises
    # KeyboardInterrupt, so `forage up` would not stop on Ctrl-C/SIGINT at all.
    previous_int = signal.signal(signal.SIGINT, _raise_stop)
    code = 1
    try:
        specs = service_specs(resolved, config_path, ports)
        held = listen_ports(resolved, ports)
        # Every child starts at once: none needs another up to start (a replica waits for the
        # learner's first weights itself, weight_wait_s; the learner issues the prompts), and
        # their start-ups (imports, model loads, the learner's op build) overlap instead of
        # adding up. Health is then awaited in start order, so a child that cannot start is
        # named first when several fail.
        for spec in specs:
            allocator.release(*held.get(spec.name, []))  # its ports, unbound just for it
            supervisor.start(spec)
        for spec in specs:
            supervisor.wait_healthy(spec.name, timeout_s=300)
        log.info("all services up: %s", ", ".join(s.name for s in specs))
        if on_start is not None:
            on_start(supervisor)
        while True:
            finished = supervisor.check()
            if "learner" in finished:
                code = finished["learner"]
                log.info("learner finished with code %d", code)
                break
            if on_tick is not None:
                on_tick(supervisor)
            time.sleep(0.5)
    except (KeyboardInterrupt, _Stop):
        log.info("stopping every service")
        code = 130
    except ServiceFailed as exc:
        log.error("%s", exc)
        code = 1
    finally:
        allocator.close()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        supervisor.stop_all(first=["learner"])
        if redis_server.embedded:
            redis_server.stop()
    return code
