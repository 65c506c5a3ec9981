"""Child processes of `forage up` / `forage demo`: start, health-check, restart, stop.

Why a supervisor of our own rather than a process manager: the services must run as separate
processes on loopback exactly as they would on a cluster, and a user's Ctrl-C (or a killed
`forage up`) must never leave orphans holding ports and GPU memory. Each child runs in its own
session (so a terminal's Ctrl-C reaches only the supervisor, which stops the children in order)
and with PR_SET_PDEATHSIG (so if the supervisor itself is SIGKILLed, the kernel stops them).
Every child's stdout/stderr goes to `RUN_DIR/logs/<name>.log`; `RUN_DIR/services.json` holds
the current pid of each, rewritten on every (re)start, for tools and fault drills.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.common.metrics import SERVICE_HEADER as HEALTH_HEADER

log = logging.getLogger("forage.launch")

PR_SET_PDEATHSIG = 1
USAGE_ERROR = 2  # the exit code of every `forage` command for a bad config or argument
# Consecutive replies cut off before any byte (closed or reset) that make a port "not HTTP":
# one could be the child's own server going down, which the next poll sees as its exit.
CUT_OFF_STRIKES = 3


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: Ctrl-C handling still stops children
        pass


def forage_argv(*args: str) -> list[str]:
    """argv running `forage ARGS` with this interpreter (works without the console script)."""
    return [sys.executable, "-m", "services.cli", *args]


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    health_url: str | None = None  # GET answering 200 once the service is ready
    # What the service's /healthz names itself in its X-Forage-Service header (HEALTH_HEADER):
    # an answer naming anything else comes from another process on that port. None: any HTTP
    # answer counts.
    health_name: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    # On an unexpected exit: restart (up to max_restarts), with these extra args (e.g. --resume).
    restart: bool = True
    restart_args: list[str] = field(default_factory=list)
    max_restarts: int = 5
    stop_timeout_s: float = 30.0


@dataclass
class Child:
    spec: ServiceSpec
    process: subprocess.Popen
    started: float
    restarts: int = 0


class ServiceFailed(RuntimeError):
    """A child exited and may not be restarted; the message names it and its log."""


class Supervisor:
    def __init__(self, run_dir: str | os.PathLike[str], env: dict[str, str] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ if env is None else env)
        root = str(Path(__file__).resolve().parents[2])
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, self.env.get("PYTHONPATH", "")) if p)
        self.children: dict[str, Child] = {}
        self.order: list[str] = []  # start order; stopped in reverse
        self.events: list[dict] = []  # starts, exits and restarts, for the run's record

    # ----------------------------------------------------------------- start / stop

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(self, spec: ServiceSpec, extra_args: Sequence[str] = ()) -> Child:
        env = dict(self.env, **spec.env)
        handle = self.log_path(spec.name).open("ab")
        process = subprocess.Popen(
            [*spec.argv, *extra_args], env=env, stdout=handle, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent,
        )
        handle.close()
        previous = self.children.get(spec.name)
        child = Child(spec, process, time.monotonic(), previous.restarts if previous else 0)
        self.children[spec.name] = child
        if spec.name not in self.order:
            self.order.append(spec.name)
        self._record("start", spec.name, pid=process.pid)
        log.info("started %s (pid %d), log %s", spec.name, process.pid, self.log_path(spec.name))
        return child

    def stop(self, name: str, timeout_s: float | None = None) -> int | None:
        """SIGTERM, then SIGKILL after the timeout; returns the exit code."""
        child = self.children.get(name)
        if child is None:
            return None
        process = child.process
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=child.spec.stop_timeout_s if timeout_s is None else timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", name)
                process.kill()
                process.wait()
        self._record("stop", name, code=process.returncode)
        return process.returncode

    def stop_all(self, first: Sequence[str] = ()) -> None:
        """Stop `first` in the order given, then everything else in reverse start order."""
        for name in [*first, *reversed(self.order)]:
            if name in self.children and self.children[name].process.poll() is None:
                self.stop(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to a child (fault drills); `check()` will restart it."""
        os.kill(self.children[name].process.pid, sig)

    # ----------------------------------------------------------------- health

    def wait_healthy(self, name: str, timeout_s: float = 180.0) -> None:
        """Poll the child's health URL until it answers 200 as the child (`health_name`).
        ServiceFailed when the child exits, when the port answers in another protocol or as
        another service (one line naming the port), or after `timeout_s`."""
        child = self.children[name]
        url = child.spec.health_url
        deadline = time.monotonic() + timeout_s
        cut_off = 0
        while time.monotonic() < deadline:
            if child.process.poll() is not None:
                raise ServiceFailed(self._exit_message(name))
            if url is None:
                self._record("healthy", name)
                return
            try:
                if self._probe(child.spec, url):
                    self._record("healthy", name)
                    return
                cut_off = 0
            except (http.client.RemoteDisconnected, ConnectionResetError) as exc:
                cut_off += 1
                if cut_off >= CUT_OFF_STRIKES and child.process.poll() is None:
                    raise ServiceFailed(self._not_ours(
                        name, url, f"not HTTP: the connection was cut off before any reply "
                        f"({type(exc).__name__}, {cut_off} times)")) from None
            except http.client.HTTPException as exc:  # BadStatusLine, LineTooLong, ...
                if child.process.poll() is None:
                    raise ServiceFailed(self._not_ours(
                        name, url, f"not HTTP ({type(exc).__name__}: {_excerpt(exc)}; an "
                        "HTTP/2 or gRPC server answers so)")) from None
            except OSError:  # refused (not listening yet), timed out
                cut_off = 0
            time.sleep(0.25)
        raise ServiceFailed(f"{name} not healthy at {url} after {timeout_s:.0f}s; "
                            f"see {self.log_path(name)}")

    def _probe(self, spec: ServiceSpec, url: str) -> bool:
        """One GET of the health URL: True on 200, False on another status of the service
        itself (503 while loading); ServiceFailed when another service answers."""
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                status, headers = reply.status, reply.headers
        except urllib.error.HTTPError as exc:  # an HTTP answer, just not 2xx
            status, headers = exc.code, exc.headers
            exc.close()
        if spec.health_name is not None:
            answered = headers.get(HEALTH_HEADER) if headers is not None else None
            if answered != spec.health_name:
                who = (f"{answered} answered ({HEALTH_HEADER})" if answered else
                       f"HTTP {status} without {HEALTH_HEADER}, so not a Forage service")
                raise ServiceFailed(self._not_ours(spec.name, url, who))
        return status == 200

    def _not_ours(self, name: str, url: str, what: str) -> str:
        port = urllib.parse.urlsplit(url).port
        return (f"{name}: port {port} is not {name}'s: GET {url} got {what}; another process "
                f"listens there (free the port or set another in the config); "
                f"see {self.log_path(name)}")

    def check(self, on_restart: Callable[[str], None] | None = None) -> dict[str, int]:
        """Restart children that exited unexpectedly; returns {name: code} of those that
        exited and are not restarted (clean exits, or out of restarts → ServiceFailed)."""
        finished: dict[str, int] = {}
        for name, child in list(self.children.items()):
            code = child.process.poll()
            if code is None:
                continue
            if code == 0 or not child.spec.restart:
                finished[name] = code
                continue
            if code == USAGE_ERROR:  # a bad config or argument: restarting cannot help
                raise ServiceFailed(self._exit_message(name) + " (a configuration or usage "
                                    "error: not restarted)")
            if child.restarts >= child.spec.max_restarts:
                raise ServiceFailed(self._exit_message(name) + " (out of restarts)")
            log.warning("%s exited with %d; restarting (%d/%d)", name, code, child.restarts + 1,
                        child.spec.max_restarts)
            self._record("exit", name, code=code)
            child.restarts += 1
            self.start(child.spec, child.spec.restart_args)
            if on_restart is not None:
                on_restart(name)
        return finished

    def _exit_message(self, name: str) -> str:
        child = self.children[name]
        tail = ""
        path = self.log_path(name)
        if path.exists():
            lines = path.read_text(errors="replace").splitlines()[-15:]
            tail = "\n    " + "\n    ".join(lines)
        return f"{name} exited with code {child.process.returncode}; log {path}:{tail}"

    # ----------------------------------------------------------------- record

    def _record(self, event: str, name: str, **fields: object) -> None:
        self.events.append({"event": event, "service": name, "time": time.time(), **fields})
        pids = {n: c.process.pid for n, c in self.children.items() if c.process.poll() is None}
        body = {"pids": pids, "events": self.events}
        tmp = self.run_dir / ".services.json.tmp"
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, self.run_dir / "services.json")


def _excerpt(exc: BaseException, limit: int = 40) -> str:
    """The start of what a non-HTTP peer sent (BadStatusLine's line), as one printable line."""
    line = getattr(exc, "line", None)
    text = line if isinstance(line, str) else str(exc)
    return ascii(text[:limit]) + ("..." if len(text) > limit else "")
