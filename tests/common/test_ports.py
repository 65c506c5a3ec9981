"""Ports a launcher hands to its children lie outside the kernel's ephemeral range, where no
outgoing connection can take them between the choice and the child's bind."""

from __future__ import annotations

import socket

import pytest

from services.common import ports


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    low = ports.ephemeral_low()
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST_PORT <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_listening_port_is_never_chosen(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        candidates = iter([taken, taken, 12345])
        monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: next(candidates))
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 40000)
        assert ports.free_port() == 12345


def test_no_room_below_the_range_falls_back_to_the_kernel(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.LOWEST_PORT + 10)
    port = ports.free_port()
    assert port > 0


def test_an_allocator_never_hands_out_a_port_twice(monkeypatch):
    """Two draws can repeat; one launch must still give each key its own port."""
    first = ports.free_port()
    second = ports.free_port(exclude={first})
    candidates = iter([first, first, first, second])
    monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: next(candidates))
    with ports.PortAllocator() as allocator:
        assert allocator.take() == first
        assert allocator.take() == second
        allocator.release(first)
        monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: first)
        # released for its child, but never handed out again: the kernel's choice instead
        assert allocator.take() not in (first, second)


def test_a_held_port_is_refused_elsewhere_until_released():
    """While the launcher holds a port, another launcher's (or test's) free_port check fails
    on it; once released, the child listens there at once."""
    with ports.PortAllocator() as allocator:
        port = allocator.take()
        assert not ports._bindable(port, "127.0.0.1")
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        allocator.release(port)
        with socket.socket() as child:
            child.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            child.bind(("127.0.0.1", port))
            child.listen()
