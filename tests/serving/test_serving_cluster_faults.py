"""Faults of a real Redis Cluster while a sparse-tier server answers requests: a master
killed (kill -9), a node stalled (DEBUG SLEEP), the whole cluster lost and re-published."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import redis
import torch
from serving_helpers import ServerThread

from terarec.cli.main import main as cli_main
from terarec.serving.app import create_app
from terarec.serving.cluster import ClusterEngine

pytestmark = pytest.mark.slow


@pytest.fixture
def chain(cluster_chain):
    return cluster_chain


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _publish(cluster, chain, ns: str) -> None:
    assert cli_main(["publish", str(chain.export), "--to", cluster.url, "--namespace", ns,
                     "--gc-grace-seconds", "0"]) == 0


def _engine(chain, cluster, ns: str, **kwargs) -> ClusterEngine:
    engine = ClusterEngine(chain.export, cluster.url, ns=ns, cache_rows=0, hot_rows=0,
                           **kwargs)
    engine.refresh()
    assert engine.current is not None
    return engine


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def _stall(port: int, seconds: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: redis.Redis(port=port, socket_timeout=10)
                              .execute_command("DEBUG", "SLEEP", str(seconds)))
    thread.start()
    time.sleep(0.1)  # the node is asleep from here, also on a loaded machine
    return thread


def test_stalled_master_is_hedged_to_its_replica(chain, fresh_redis_cluster):
    cluster = fresh_redis_cluster
    _publish(cluster, chain, "stall")
    expected = chain.trainer_scores[4]
    hedged = _engine(chain, cluster, "stall", deadline_s=2.0, hedge_floor_s=0.005)
    strict = _engine(chain, cluster, "stall", deadline_s=0.05, hedge=False, strict=True)
    lenient = _engine(chain, cluster, "stall", deadline_s=0.05, hedge=False)
    try:
        np.testing.assert_allclose(hedged.score_records(chain.records)[0], expected,
                                   atol=1e-5)
        master = cluster.master_ports()[0]
        for _ in range(3):  # hedged: every answer right, well before the stall ends
            sleeper = _stall(master, 0.6)
            t0 = time.monotonic()
            np.testing.assert_allclose(hedged.score_records(chain.records)[0], expected,
                                       atol=1e-5)
            assert time.monotonic() - t0 < 0.3
            sleeper.join()
        assert hedged.tier_metrics.hedges_won._value.get() >= 3
        assert hedged.tier_metrics.read_failures._value.get() == 0
        with ServerThread(create_app(strict, poll_interval_s=60)) as server:
            sleeper = _stall(master, 0.4)
            status, body = server.request("POST", "/predict", {"candidates": chain.records})
            sleeper.join()
            assert status == 503 and "sparse tier" in body["error"]
            metrics = server.request("GET", "/metrics")[1]
            assert _metric(metrics, "terarec_sparse_read_failures_total") > 0
        sleeper = _stall(master, 0.4)
        scores = lenient.score_records(chain.records)[0]  # the stalled rows score as zero
        sleeper.join()
        assert lenient.tier_metrics.read_failures._value.get() > 0
        assert np.isfinite(scores).all() and not np.allclose(scores, expected, atol=1e-5)
        np.testing.assert_allclose(lenient.score_records(chain.records)[0], expected,
                                   atol=1e-5)
    finally:
        for engine in (hedged, strict, lenient):
            engine.close()


def test_master_killed_under_load_fails_no_request(chain, fresh_redis_cluster):
    cluster = fresh_redis_cluster
    _publish(cluster, chain, "kill")
    expected = chain.trainer_scores[4]
    engine = _engine(chain, cluster, "kill", deadline_s=1.0)
    results: list[tuple[int, np.ndarray | None]] = []
    stop = threading.Event()
    try:
        with ServerThread(create_app(engine, poll_interval_s=0.2)) as server:
            def load() -> None:
                while not stop.is_set():
                    status, body = server.request("POST", "/predict",
                                                  {"candidates": chain.records})
                    results.append((status, np.asarray(body["scores"])
                                    if status == 200 else None))

            clients = [threading.Thread(target=load) for _ in range(2)]
            for c in clients:
                c.start()
            time.sleep(0.5)
            before = len(results)
            victim = cluster.master_ports()[0]
            cluster.kill(victim)
            deadline = time.monotonic() + 30
            while (engine.tier_metrics.failovers._value.get() < 1
                   and time.monotonic() < deadline):
                time.sleep(0.1)
            time.sleep(0.5)
            stop.set()
            for c in clients:
                c.join(timeout=30)
            metrics = server.request("GET", "/metrics")[1]
        assert engine.tier_metrics.failovers._value.get() >= 1
        assert victim not in {s.master[1] for s in engine.tier.topology.shards}
        assert len(results) > before + 5
        assert all(status == 200 for status, _ in results), [s for s, _ in results]
        for _, scores in results:
            np.testing.assert_allclose(scores, expected, atol=1e-5)
        assert _metric(metrics, "terarec_sparse_read_failures_total") == 0
        assert _metric(metrics, "terarec_sparse_failovers_total") >= 1
    finally:
        stop.set()
        engine.close()


def test_cluster_restarted_and_republished(chain, fresh_redis_cluster):
    """Every node lost at once: the server keeps answering (zero rows while the rows are
    gone), and scores its version exactly again once it is published anew."""
    cluster = fresh_redis_cluster
    cluster.restart()
    _publish(cluster, chain, "restart")
    expected = chain.trainer_scores[4]
    engine = _engine(chain, cluster, "restart", deadline_s=0.5)
    try:
        np.testing.assert_allclose(engine.score_records(chain.records)[0], expected,
                                   atol=1e-5)
        cluster.restart()
        scores = engine.score_records(chain.records)[0]
        assert np.isfinite(scores).all()
        _publish(cluster, chain, "restart")
        deadline = time.monotonic() + 10
        while True:
            scores = engine.score_records(chain.records)[0]
            if np.allclose(scores, expected, atol=1e-5) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        np.testing.assert_allclose(scores, expected, atol=1e-5)
        engine.refresh()
        assert engine.current.name == "v000004"
    finally:
        engine.close()
