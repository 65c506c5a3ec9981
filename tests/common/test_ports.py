"""Ports a launcher hands to its children lie outside the kernel's ephemeral range, where no
outgoing connection can take them between the choice and the child's bind."""

from __future__ import annotations

import socket

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
