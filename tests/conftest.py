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
