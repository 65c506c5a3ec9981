"""Free loopback ports for services a launcher starts, chosen where no client socket lands.

Asking the kernel for port 0 hands back a port from the ephemeral range, the same range the
kernel draws from for the source port of every outgoing connection. A port picked that way
and given to a child to listen on a few seconds later can meanwhile become the local end of
some other process's Redis or HTTP connection, and the child then fails with "Address already
in use" for as long as that connection lives. Ports below the ephemeral range are never handed
out implicitly, so a free one there stays free until someone binds it on purpose.
"""

from __future__ import annotations

import random
import socket
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


def free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port nothing listens on, below the ephemeral range when that range leaves room.

    Random rather than sequential, so launchers running side by side rarely pick the same
    port; falls back to the kernel's choice when no port below the range is free.
    """
    high = ephemeral_low()
    if high - LOWEST_PORT >= 1000:
        for _ in range(attempts):
            port = random.randrange(LOWEST_PORT, high)
            if _bindable(port, host):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
