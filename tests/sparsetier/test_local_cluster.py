"""The loopback Redis Cluster the tests start: a chosen port taken by another process
before a node binds it makes ``start`` choose again, and a node is never mistaken for
the process that holds its port."""

from __future__ import annotations

import socket

import pytest

from terarec.sparsetier import local
from terarec.sparsetier.local import LocalCluster, redis_binaries

pytestmark = pytest.mark.skipif(redis_binaries() is None,
                                reason="redis-server / redis-cli not installed")


def test_a_port_taken_before_the_node_binds_is_chosen_again(tmp_path, monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        real = local.free_ports
        calls: list[list[int]] = []

        def first_one_taken(n: int, offsets: tuple[int, ...]) -> list[int]:
            ports = real(n, offsets)
            if not calls:
                ports[0] = taken
            calls.append(ports)
            return ports

        monkeypatch.setattr(local, "free_ports", first_one_taken)
        cluster = LocalCluster(tmp_path / "c", masters=3, replicas=0)
        try:
            cluster.start()
            assert len(calls) == 2 and taken not in cluster.ports
            assert len(cluster.master_ports()) == 3
        finally:
            cluster.stop()


def test_a_node_whose_port_is_held_is_reported_not_waited_for(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        cluster = LocalCluster(tmp_path / "c", masters=3, replicas=0,
                               ports=[held.getsockname()[1]])
        cluster._launch(cluster.ports[0])
        try:
            with pytest.raises(local._PortTaken, match="exited at start"):
                cluster._wait_ping(cluster.ports[0])
        finally:
            cluster.stop()
