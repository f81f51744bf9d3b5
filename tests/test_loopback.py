"""Ports for local servers come from below the kernel's ephemeral range, where no
``bind(0)`` or outgoing connection of another process can take them first."""

from __future__ import annotations

import socket

from terarec import loopback


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    low = loopback._ephemeral_low()
    ports = loopback.free_ports(6, offsets=(0, 10_000))
    assert len(set(ports)) == 6
    for port in ports:
        assert 10_000 <= port < low - 10_000
        for at in (port, port + 10_000):
            with socket.socket() as s:
                s.bind(("127.0.0.1", at))


def test_a_held_port_is_never_returned(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", loopback.free_ports(1, offsets=(0, 1))[0]))
        taken = held.getsockname()[1]
        draws = iter([taken - loopback._LOWEST, taken - loopback._LOWEST + 1])
        monkeypatch.setattr(loopback.secrets, "randbelow", lambda n: next(draws))
        assert loopback.free_ports(1) == [taken + 1]
