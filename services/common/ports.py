"""Free loopback ports for services a launcher starts, chosen where no client socket lands.

Asking the kernel for port 0 hands back a port from the ephemeral range, the same range the
kernel draws from for the source port of every outgoing connection. A port picked that way
and given to a child to listen on a few seconds later can meanwhile become the local end of
some other process's Redis or HTTP connection, and the child then fails with "Address already
in use" for as long as that connection lives. Ports below the ephemeral range are never handed
out implicitly, so a free one there stays free until someone binds it on purpose.

A launcher that needs several ports takes them from one `PortAllocator`: it never hands out a
port twice (two random draws can repeat, and a port stays bindable until its child binds it),
and it keeps each port bound, without SO_REUSEADDR and not listening, until `release` just
before the child that listens there starts. While held, the port fails every other process's
bind, including `free_port`'s check in a launcher or test running side by side. Closing a socket
that never listened or connected leaves nothing behind, so the child binds it at once.
"""

from __future__ import annotations

import errno
import random
import socket
from collections.abc import Collection
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000
DEFAULT_EPHEMERAL_LOW = 32768


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux default 32768)."""
    try:
        low = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW
    return low


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", attempts: int = 200,
              exclude: Collection[int] = ()) -> int:
    """A port nothing listens on and not in `exclude`, below the ephemeral range when that
    range leaves room.

    Random rather than sequential, so launchers running side by side rarely pick the same
    port; falls back to the kernel's choice when no port below the range is free.
    """
    high = ephemeral_low()
    if high - LOWEST_PORT >= 1000:
        for _ in range(attempts):
            port = random.randrange(LOWEST_PORT, high)
            if port not in exclude and _bindable(port, host):
                return port
    for _ in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in exclude:
            return port
    raise OSError(errno.EADDRINUSE, f"no free port on {host}")


class PortAllocator:
    """The ports of one launch: each handed out once, and held bound until released (see the
    module docstring). Use as a context manager, or call `close()`, to release what is left."""

    def __init__(self, host: str = "127.0.0.1", attempts: int = 50) -> None:
        self.host = host
        self.attempts = attempts
        self.taken: list[int] = []  # in the order handed out
        self._skip: set[int] = set()  # handed out, or found held by someone else
        self._held: dict[int, socket.socket] = {}

    def take(self) -> int:
        """A free port no earlier `take` returned, held until `release(port)`."""
        for _ in range(self.attempts):
            port = free_port(self.host, exclude=self._skip)
            self._skip.add(port)
            hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                hold.bind((self.host, port))  # no SO_REUSEADDR: others' binds fail meanwhile
            except OSError:  # taken since free_port looked, or a lingering connection's
                hold.close()
                continue
            self._held[port] = hold
            self.taken.append(port)
            return port
        raise OSError(errno.EADDRINUSE, f"no free port to hold on {self.host}")

    def held(self) -> list[int]:
        return list(self._held)

    def release(self, *ports: int) -> None:
        """Unbind `ports` (a port not held here is ignored) so a child can listen there; they
        are still never handed out again."""
        for port in ports:
            hold = self._held.pop(port, None)
            if hold is not None:
                hold.close()

    def close(self) -> None:
        self.release(*self._held)

    def __enter__(self) -> PortAllocator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
