"""The emulated network link: every row exchange waits bytes / bandwidth + latency for
what leaves the rank, so a loopback run shows what a slower link would cost."""

from __future__ import annotations

import time

import pytest
import torch
from ranks import run_ranks

from terarec.distributed import link as link_module
from terarec.distributed.link import GBPS_ENV, LATENCY_ENV, LinkEmulation, link_from_env


def test_delay_is_latency_plus_bytes_over_bandwidth():
    link = LinkEmulation(gbps=10.0, latency_s=50e-6)
    assert link.delay(0) == pytest.approx(50e-6)
    assert link.delay(1_250_000) == pytest.approx(50e-6 + 1e-3)  # 10 Mbit at 10 Gb/s
    assert link.delay(1_250_000, messages=3) == pytest.approx(150e-6 + 1e-3)


def test_link_is_read_from_the_environment_and_bad_values_name_the_variable(monkeypatch):
    monkeypatch.delenv(GBPS_ENV, raising=False)
    assert link_from_env() is None
    monkeypatch.setenv(GBPS_ENV, "100")
    monkeypatch.setenv(LATENCY_ENV, "20")
    link = link_from_env()
    assert link is not None
    assert link.gbps == 100.0 and link.latency_s == pytest.approx(20e-6)
    monkeypatch.setenv(GBPS_ENV, "fast")
    with pytest.raises(ValueError, match=f"{GBPS_ENV} must be a number, got 'fast'"):
        link_from_env()
    monkeypatch.setenv(GBPS_ENV, "0")
    with pytest.raises(ValueError, match=f"{GBPS_ENV} must be > 0"):
        link_from_env()
    monkeypatch.setenv(GBPS_ENV, "1")
    monkeypatch.setenv(LATENCY_ENV, "-1")
    with pytest.raises(ValueError, match=f"{LATENCY_ENV} must be >= 0"):
        link_from_env()


def _timed_exchanges(ctx) -> dict:
    import os

    from terarec.distributed.lookup import exchange

    rows = torch.ones(1000, 250)  # 1000 B a row; 500 rows stay, 500 go to the other rank
    exchange(ctx, rows, [500, 500], [500, 500])  # warm the connection up
    ctx.barrier()
    start = time.perf_counter()
    plain = exchange(ctx, rows, [500, 500], [500, 500])
    loopback = time.perf_counter() - start
    os.environ[GBPS_ENV], os.environ[LATENCY_ENV] = "0.1", "20000"  # 0.1 Gb/s, 20 ms
    ctx.barrier()
    start = time.perf_counter()
    slow = exchange(ctx, rows, [500, 500], [500, 500])
    emulated = time.perf_counter() - start
    return {"loopback": loopback, "emulated": emulated, "same": bool(torch.equal(plain, slow)),
            "paid_bytes": link_module.TALLY.bytes, "paid_calls": link_module.TALLY.calls}


def test_a_row_exchange_waits_its_outgoing_bytes_over_bandwidth_plus_latency(monkeypatch):
    monkeypatch.delenv(GBPS_ENV, raising=False)
    for result in run_ranks(_timed_exchanges, 2):
        expected = 0.02 + 500 * 1000 * 8 / 0.1e9  # 20 ms + 40 ms
        assert result["same"]
        assert result["paid_bytes"] == 500 * 1000 and result["paid_calls"] == 1
        assert result["emulated"] >= expected
        assert result["emulated"] - result["loopback"] < expected + 0.5  # a loaded machine
