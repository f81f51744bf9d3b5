"""Fixtures shared across test packages."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def s3_server(monkeypatch) -> Iterator[dict[str, str]]:
    """fsspec storage options for an S3-compatible server (moto) on loopback, started for
    one test; create buckets with ``Storage(uri, options).fs.mkdir``."""
    moto_server = pytest.importorskip("moto.server")
    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield {"endpoint_url": f"http://{host}:{port}"}
    server.stop()


def _start_cluster(root):
    """A 3-master / 3-replica Redis Cluster on free loopback ports (skips without
    redis-server)."""
    from terarec.sparsetier.local import LocalCluster, redis_binaries

    if redis_binaries() is None:
        pytest.skip("redis-server / redis-cli not installed (apt-get install redis-server)")
    return LocalCluster(root, masters=3, replicas=1).start()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """One healthy cluster for the whole session: tests use their own namespaces and must
    not stop nodes (fault tests take ``fresh_redis_cluster``)."""
    cluster = _start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def fresh_redis_cluster(tmp_path_factory):
    """A cluster of the test module's own, which its tests may kill, stall or restart."""
    cluster = _start_cluster(tmp_path_factory.mktemp("redis-cluster-faults"))
    yield cluster
    cluster.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Test files that launch ranks first (``--dist loadfile`` hands out whole files in
    this order): the longest files start early and the short ones fill the end, so the
    two workers finish close together."""
    heavy = {item.path for item in items
             if item.get_closest_marker("dist") or item.get_closest_marker("slow")
             or "distributed" in item.path.parts}
    items.sort(key=lambda item: item.path not in heavy)
