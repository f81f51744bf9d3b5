"""Free loopback ports for local clusters, test servers and launchers.

A port found by binding port 0 comes from the kernel's ephemeral range, from which every
``bind(0)`` and outgoing connection also draws: between choosing it and a server binding
it, another process (a gloo rank's connection, another test's server) can take it. Ports
below that range are only ever taken on purpose, so they are chosen there.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import time
from pathlib import Path

_LOWEST = 10_000
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_free(port: int) -> bool:
    """Whether ``port`` can be bound on loopback now."""
    return _bindable(port)


def free_ports(n: int, offsets: tuple[int, ...] = (0,)) -> list[int]:
    """``n`` distinct loopback ports, each with ``port + offset`` free for every offset
    (a Redis Cluster node's bus port is its port + 10000), all below the ephemeral range."""
    high = _ephemeral_low() - max(offsets)
    if high - _LOWEST < 100 * n:
        raise RuntimeError(f"too few ports below the ephemeral range ({high - _LOWEST}) "
                           f"for {n} with offsets {offsets}")
    ports: list[int] = []
    for _ in range(1000 * n):
        port = _LOWEST + secrets.randbelow(high - _LOWEST)
        if port not in ports and all(_bindable(port + o) for o in offsets):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free loopback ports found")


def free_port() -> int:
    """One free loopback port below the ephemeral range."""
    return free_ports(1)[0]


def wait_ready(port: int, *, proc: subprocess.Popen | None = None,
               timeout_s: float = 120.0) -> None:
    """Wait until a server on loopback ``port`` answers ``/v2/health/ready`` with 200;
    a RuntimeError when ``proc`` (the server's process) exits first or time runs out."""
    import http.client

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/v2/health/ready")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with {proc.returncode}")
        time.sleep(0.2)
    raise RuntimeError(f"the server on port {port} did not become ready in {timeout_s:g} s")
