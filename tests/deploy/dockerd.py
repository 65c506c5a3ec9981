"""A private Docker engine for deploy tests: its own dockerd, data root, socket and networks.

    with Dockerd() as d:                      # start() on enter, stop() on exit (also on error)
        d.docker("run", "--rm", "python:3.11.9-slim-bookworm", "python", "-V")
        print(d.env["DOCKER_HOST"])           # unix:///tmp/forage-dockerd-XXXX/docker.sock

Also a command line, which starts one engine, runs a command with DOCKER_HOST set, and stops it:

    python tests/deploy/dockerd.py [--keep-root DIR] -- bash deploy/local-base-images.sh

Why each dockerd flag (Docker 20.10 from Debian's docker.io, run as root):
- --storage-driver=vfs: works on any filesystem and inside a VM or a container without overlay
  support; each layer is a full copy, so images cost their full size once per layer, and each
  container its image's full size (created by copying: ~40-60 s for the 2.3 GB forage:cpu on
  this 2-core machine). overlay2 (FORAGE_DOCKERD_STORAGE_DRIVER=overlay2, or storage_driver=)
  needs a data root on ext4/xfs and the overlay module; where it works it is much faster.
- --data-root / --exec-root / -H unix://... / --pidfile / --config-file: everything the engine
  writes lives under one temporary folder (nothing in /var/lib/docker, /run/docker or
  /etc/docker/daemon.json is read or written), so it runs beside a system engine or another
  private one, and removing the folder removes it all. It also starts its own containerd under
  the exec root, with its own namespaces (a system containerd's socket would otherwise be used).
- --bridge=none: no default docker0 bridge (which two engines on one host would share). A
  container with no --network has only loopback, and so has a classic-builder RUN step: builds
  are offline by construction. User-defined bridge networks (`docker network create`, every
  compose project) still get their own br-* bridge, a veth per container and the embedded DNS
  server (127.0.0.11), so containers resolve each other by name.
- --iptables=false --ip-masq=false --ip-forward=false: the engine adds no iptables rule and no
  NAT, and leaves net.ipv4.ip_forward as it is (0 here), so a container can reach the other
  containers on its networks and this host's bridge address, and nothing beyond this host.
  Published ports (`-p 127.0.0.1:8000:8000`) still work: docker-proxy listens on the host.
- --default-address-pool: a 172.x/16 that no route on this host uses yet (another engine's
  bridges included), carved into /24s, one per network. stop() removes the br-* bridges in it
  that a crashed or killed engine left.
- HTTP(S)_PROXY=http://127.0.0.1:9 in dockerd's environment (offline=True): a pull of an image
  that is not here (docker run, compose, a build's FROM) fails at once with "proxyconnect tcp:
  dial tcp 127.0.0.1:9: connect: connection refused" instead of reaching for a registry.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["Dockerd", "DockerdError", "main"]


_PROXY_VARS = {"http_proxy", "https_proxy", "no_proxy", "all_proxy"}


class DockerdError(RuntimeError):
    """The engine did not start, or a docker command failed (message: its stderr)."""


def _default_cli() -> str:
    # Prefer the client shipped with the engine (Debian's /usr/bin/docker, 20.10): it builds
    # with BuildKit (DOCKER_BUILDKIT=1) without the buildx plugin. Override: FORAGE_DOCKER_CLI.
    env = os.environ.get("FORAGE_DOCKER_CLI")
    if env:
        return env
    for candidate in ("/usr/bin/docker",):
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("docker") or "docker"


def _free_pool() -> str:
    """A 172.N.0.0/16 (N in 20..31) that no IPv4 route on this host overlaps."""
    try:
        routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"],
                                capture_output=True, text=True, check=False).stdout
    except FileNotFoundError:
        routes = ""
    for n in range(20, 32):
        if f"172.{n}." not in routes:
            return f"base=172.{n}.0.0/16,size=24"
    raise DockerdError("no free 172.20-31.0.0/16 address pool on this host")


class Dockerd:
    """One private dockerd. Not thread-safe; one start() per object."""

    def __init__(self, root: str | os.PathLike | None = None, *, dockerd: str = "dockerd",
                 cli: str | None = None, storage_driver: str | None = None,
                 address_pool: str | None = None, extra_args: tuple[str, ...] = (),
                 keep_root: bool = False, offline: bool = True) -> None:
        self._own_root = root is None
        # Short paths: unix socket paths (ours, containerd's) must stay under 108 bytes.
        self.root = Path(root or tempfile.mkdtemp(prefix="forage-dockerd-", dir="/tmp"))
        self.data_root = self.root / "data"
        self.exec_root = self.root / "x"
        self.socket = self.root / "docker.sock"
        self.pidfile = self.root / "dockerd.pid"
        self.log_path = self.root / "dockerd.log"
        self.config_dir = self.root / "cli"          # DOCKER_CONFIG: no user config or helpers
        self.dockerd = dockerd
        self.cli = cli or _default_cli()
        self.storage_driver = (storage_driver or os.environ.get("FORAGE_DOCKERD_STORAGE_DRIVER")
                               or "vfs")
        self.address_pool = address_pool
        self.extra_args = tuple(extra_args)
        self.keep_root = keep_root
        self.offline = offline
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None
        self._namespace = f"forage-{os.getpid()}-{self.root.name[-8:]}"

    # ------------------------------------------------------------------ lifecycle
    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("DOCKER_CONTEXT", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH")}
        env["DOCKER_HOST"] = f"unix://{self.socket}"
        env["DOCKER_CONFIG"] = str(self.config_dir)
        return env

    def argv(self) -> list[str]:
        self.address_pool = self.address_pool or _free_pool()
        return [
            self.dockerd,
            f"--host=unix://{self.socket}",
            f"--data-root={self.data_root}",
            f"--exec-root={self.exec_root}",
            f"--pidfile={self.pidfile}",
            f"--config-file={self.root / 'daemon.json'}",
            f"--storage-driver={self.storage_driver}",
            f"--containerd-namespace={self._namespace}",
            f"--containerd-plugins-namespace={self._namespace}-plugins",
            "--bridge=none",
            "--iptables=false",
            "--ip-masq=false",
            "--ip-forward=false",
            f"--default-address-pool={self.address_pool}",
            "--log-level=info",
            *self.extra_args,
        ]

    def start(self, timeout: float = 120.0) -> Dockerd:
        if os.geteuid() != 0:
            raise DockerdError("a private dockerd needs root")
        if shutil.which(self.dockerd) is None:
            raise DockerdError(f"{self.dockerd} not found (apt-get install docker.io)")
        for d in (self.data_root, self.exec_root, self.config_dir):
            d.mkdir(parents=True, exist_ok=True)
        (self.root / "daemon.json").write_text("{}\n")
        (self.config_dir / "config.json").write_text("{}\n")
        # Registry traffic (a pull of a missing image, by docker run, compose or a build) goes
        # to a closed loopback port and fails at once, instead of leaving this host.
        env = {k: v for k, v in os.environ.items() if k.lower() not in _PROXY_VARS}
        if self.offline:
            env.update({k: "http://127.0.0.1:9" for k in ("HTTP_PROXY", "HTTPS_PROXY",
                                                            "http_proxy", "https_proxy")})
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env=env)
        try:
            deadline = t0 + timeout
            while True:
                if self.proc.poll() is not None:
                    raise DockerdError(f"dockerd exited with {self.proc.returncode}:\n"
                                       + self.log_tail())
                if self._ping():
                    break
                if time.monotonic() > deadline:
                    raise DockerdError(f"dockerd did not answer within {timeout:.0f}s:\n"
                                       + self.log_tail())
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _ping(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(2)
                s.connect(str(self.socket))
                s.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
                head = s.recv(64)
                return head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0]
        except OSError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no dockerd log)"

    def docker(self, *args: str, check: bool = True, capture: bool = True,
               timeout: float | None = None, input: str | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run the docker CLI against this engine; raises DockerdError on failure if check."""
        full_env = self.env
        if env:
            full_env.update(env)
        res = subprocess.run([self.cli, *args], env=full_env, text=True, input=input,
                             capture_output=capture, timeout=timeout, check=False)
        if check and res.returncode != 0:
            err = (res.stderr or "").strip() if capture else "(see output above)"
            raise DockerdError(f"docker {' '.join(args)} exited {res.returncode}: {err}")
        return res

    def disk_usage(self) -> int:
        """Bytes used under the data root (du -sb)."""
        out = subprocess.run(["du", "-sb", str(self.data_root)], capture_output=True,
                             text=True, check=False).stdout.split()
        return int(out[0]) if out else 0

    def _bridges(self) -> list[str]:
        """Host bridge names of this engine's bridge networks (br-<first 12 of the id>)."""
        try:
            out = self.docker("network", "ls", "--no-trunc", "--filter", "driver=bridge",
                              "--format", "{{.ID}}", timeout=30).stdout.split()
        except (DockerdError, subprocess.TimeoutExpired):
            return []
        return [f"br-{nid[:12]}" for nid in out]

    def _pool_bridges(self) -> list[str]:
        if not self.address_pool:
            return []
        prefix = ".".join(self.address_pool.split("base=")[1].split(".")[:2]) + "."
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                             check=False).stdout
        return [f[1] for f in (line.split() for line in out.splitlines())
                if len(f) > 3 and f[1].startswith("br-") and f[3].startswith(prefix)]

    def stop(self, timeout: float = 60.0) -> None:
        """Remove containers and networks, stop dockerd (SIGTERM, then SIGKILL), end leftover
        containerd/shim processes of this engine, unmount and remove the root folder."""
        bridges: list[str] = []
        if self.proc is not None and self.proc.poll() is None:
            try:
                ids = self.docker("ps", "-aq", timeout=30, check=False).stdout.split()
                if ids:
                    self.docker("rm", "-f", "-v", *ids, timeout=120, check=False)
                bridges = self._bridges()
                self.docker("network", "prune", "-f", timeout=60, check=False)
            except subprocess.TimeoutExpired:
                pass
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._kill_leftovers()
        # Normally gone with `network prune`; left after a crash or a kill: this engine's
        # bridges are the br-* holding an address of its pool (chosen unused at start).
        bridges += self._pool_bridges()
        for br in sorted(set(bridges)):
            if Path("/sys/class/net", br).exists():
                subprocess.run(["ip", "link", "delete", br], check=False,
                               capture_output=True)
        self._unmount_all()
        if self.keep_root or not self.root.exists():
            return
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
        else:  # a folder the caller named: only what this engine put there
            for p in (self.data_root, self.exec_root, self.config_dir):
                shutil.rmtree(p, ignore_errors=True)
            for p in (self.socket, self.pidfile, self.log_path, self.root / "daemon.json"):
                p.unlink(missing_ok=True)

    def _kill_leftovers(self) -> None:
        """After an unclean stop: the processes of this engine's containers (by their cgroups,
        named by the container ids in our data root), then containerd and the shims started
        for this engine (their argv names our exec root or containerd namespace)."""
        ids = [p.name for p in (self.data_root / "containers").glob("*") if p.is_dir()]
        for cid in ids:
            for procs in Path("/sys/fs/cgroup").glob(f"**/docker/{cid}/cgroup.procs"):
                try:
                    pids = procs.read_text().split()
                except OSError:
                    continue
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
        me = str(self.exec_root)
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit():
                continue
            try:
                argv = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if me in argv or f"-namespace {self._namespace}" in argv:
                try:
                    os.kill(int(pid_dir.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _unmount_all(self) -> None:
        root = str(self.root) + "/"
        try:
            mounts = [line.split()[4] for line in
                      Path("/proc/self/mountinfo").read_text().splitlines()]
        except OSError:
            return
        for mnt in sorted((m for m in mounts if m.startswith(root)), key=len, reverse=True):
            subprocess.run(["umount", "-l", mnt], check=False, capture_output=True)

    def __enter__(self) -> Dockerd:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", help="folder for the engine (default: a new /tmp/forage-dockerd-*)")
    p.add_argument("--keep-root", action="store_true", help="leave the folder (images) behind")
    p.add_argument("--storage-driver", help="vfs (default; FORAGE_DOCKERD_STORAGE_DRIVER) or "
                   "overlay2 (where the data root's filesystem supports it: ext4, xfs)")
    p.add_argument("--timings", help="write start/run/stop seconds and disk use here (JSON)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ... (DOCKER_HOST set)")
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("no command")
    d = Dockerd(a.root, keep_root=a.keep_root, storage_driver=a.storage_driver)
    timings: dict[str, float] = {}
    rc = 1
    try:
        d.start()
        timings["start_s"] = round(d.start_seconds or 0.0, 2)
        print(f"dockerd up in {timings['start_s']}s at {d.env['DOCKER_HOST']}", file=sys.stderr)
        t0 = time.monotonic()
        rc = subprocess.run(cmd, env=d.env, check=False).returncode
        timings["run_s"] = round(time.monotonic() - t0, 2)
        timings["data_root_bytes"] = d.disk_usage()
    finally:
        t0 = time.monotonic()
        d.stop()
        timings["stop_s"] = round(time.monotonic() - t0, 2)
        if a.timings:
            Path(a.timings).write_text(json.dumps(timings, indent=1) + "\n")
        print(f"timings: {json.dumps(timings)}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
