"""The Redis Cluster sparse tier against a real 3-master / 3-replica cluster: publish,
serve with hot rows local and the rest read from the cluster, the same scores as the
local server and ``terarec predict``; parts, immutability, garbage collection."""

from __future__ import annotations

import json

import numpy as np
import pytest
import redis
import torch
from cluster_helpers import local_scores
from serving_helpers import ServerThread

from terarec.cli.main import main as cli_main
from terarec.serving.app import create_app
from terarec.serving.cluster import ClusterEngine
from terarec.sparsetier.control import Control
from terarec.sparsetier.layout import Layout
from terarec.sparsetier.tier import SparseTier


@pytest.fixture
def chain(cluster_chain):
    return cluster_chain


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def publish(url: str, uri, ns: str, *flags: str, capsys=None) -> int:
    return cli_main(["publish", str(uri), "--to", url, "--namespace", ns,
                     "--gc-grace-seconds", "0", "--json", *flags])


def engine_for(chain, url: str, ns: str, **kwargs) -> ClusterEngine:
    kwargs.setdefault("cache_rows", 0)
    kwargs.setdefault("hot_rows", 40)
    engine = ClusterEngine(chain.export, url, ns=ns, **kwargs)
    engine.refresh()
    return engine


def test_served_scores_equal_predict_and_the_local_server(chain, redis_cluster, tmp_path,
                                                          capsys):
    url = redis_cluster.url
    assert publish(url, chain.export, "equal") == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["version"] == "v000004" and out["announced"] and out["rows"] > 0
    predicted = tmp_path / "predict.txt"
    assert cli_main(["predict", "--model", str(chain.model_dir), "--data",
                     str(chain.rows_file), "--out", str(predicted)]) == 0
    engine = engine_for(chain, url, "equal", cache_rows=100)
    try:
        assert engine.current is not None and engine.current.name == "v000004"
        rows = engine.current.rows
        assert 0 < len(rows.hot_keys) <= 40  # the rest come from the cluster
        app = create_app(engine, poll_interval_s=60)
        with ServerThread(app) as server:
            for _ in range(2):  # cold, then partly from the row cache
                version, scores = server.predict({}, chain.records)
                assert version == 4
                np.testing.assert_allclose(scores, np.loadtxt(predicted), atol=1e-5)
            np.testing.assert_allclose(scores, local_scores(chain.export, chain.records),
                                       atol=1e-6)
            status, body = server.request("POST", "/predict", {"candidates": [{"bogus": 1}]})
            assert status == 422, body  # errors as the local server's
            metrics = server.request("GET", "/metrics")[1]
        assert "terarec_sparse_node_latency_seconds_bucket" in metrics
        assert "terarec_sparse_hot_hits_total" in metrics
        read = [line for line in metrics.splitlines()
                if line.startswith("terarec_sparse_rows_read_total")]
        assert float(read[0].split()[-1]) > 0
    finally:
        engine.close()


def test_deltas_are_served_from_their_own_rows(chain, redis_cluster):
    """v000003 = v000001 + two deltas (upserts and deletions) scores as the trainer did at
    that pass; publishing it after v000001 moves a running server to it."""
    url = redis_cluster.url
    assert publish(url, chain.export / "v000001", "deltas") == 0
    engine = engine_for(chain, url, "deltas")
    try:
        assert engine.current.name == "v000001"
        np.testing.assert_allclose(engine.score_records(chain.records)[0],
                                   chain.trainer_scores[1], atol=1e-5)
        assert publish(url, chain.export / "v000003", "deltas") == 0
        assert engine.refresh()
        assert engine.current.name == "v000003" and engine.current.rows.overlay_rows > 0
        np.testing.assert_allclose(engine.score_records(chain.records)[0],
                                   chain.trainer_scores[3], atol=1e-5)
    finally:
        engine.close()


def test_parts_are_published_separately(chain, redis_cluster, capsys):
    url = redis_cluster.url
    target = chain.export / "v000003"
    assert publish(url, target, "parts", "--part", "hot") == 2
    assert "publish --part cold" in capsys.readouterr().err
    assert publish(url, target, "parts", "--part", "cold") == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["announced"] and out["rows"] > 0
    control = Control(url, Layout("parts"))
    try:
        assert control.newest() is None  # nothing announced before all its rows are in
        assert publish(url, target, "parts", "--part", "hot") == 0
        out = json.loads(capsys.readouterr().out)
        assert out["announced"] and "v000001:cold" not in out["skipped"]
        assert control.newest() == "v000003"
        # again: nothing is written twice
        assert publish(url, target, "parts") == 0
        out = json.loads(capsys.readouterr().out)
        assert out["rows"] == 0 and "v000001:cold" in out["skipped"]
    finally:
        control.close()


def test_published_versions_never_change(chain, redis_cluster, tmp_path, capsys):
    url = redis_cluster.url
    assert publish(url, chain.export / "v000001", "immutable") == 0
    # another export whose v000001 is a different model
    assert cli_main(["export", "--model", str(chain.model_dir), "--out",
                     str(tmp_path / "other")]) == 0
    capsys.readouterr()
    assert publish(url, tmp_path / "other" / "v000001", "immutable") == 2
    assert "never change" in capsys.readouterr().err


def test_versions_no_server_uses_are_collected(chain, redis_cluster):
    url = redis_cluster.url
    ns = "gc"
    layout = Layout(ns)
    tier = SparseTier(url)
    try:
        assert publish(url, chain.export / "v000003", ns) == 0
        engine = engine_for(chain, url, ns)  # registers v000003
        try:
            assert engine.current.name == "v000003"
            assert publish(url, chain.export / "v000004", ns) == 0
            # v000001..3 are the chain a live server serves: kept
            assert tier.scan_prefix(layout.rows("v000001"))
            np.testing.assert_allclose(engine.score_records(chain.records)[0],
                                       chain.trainer_scores[3], atol=1e-5)
        finally:
            engine.close()  # unregisters
        assert publish(url, chain.export / "v000004", ns) == 0
        for name in ("v000001", "v000002", "v000003"):
            assert not tier.scan_prefix(layout.rows(name)), name
        assert tier.scan_prefix(layout.rows("v000004"))
        control = Control(url, layout)
        assert [n for n, _ in control.announced()] == ["v000004"]
        control.close()
    finally:
        tier.close()


@pytest.mark.parametrize("flags", [["--bits", "8"], ["--bits", "2", "--codebook"]])
def test_rows_stay_in_the_versions_codec(chain, redis_cluster, tmp_path, flags):
    export = tmp_path / "export"
    assert cli_main(["export", "--model", str(chain.model_dir), "--out", str(export),
                     "--shard-rows", "500", *flags]) == 0
    ns = "codec" + "".join(flags).replace("-", "")
    assert publish(redis_cluster.url, export, ns) == 0
    # values are stored as the shards hold them: smaller than fp32 rows
    node = redis_cluster.master_ports()[0]
    client = redis.Redis(port=node)
    key = next(client.scan_iter(match=f"{ns}/v000001/*".encode(), count=1000))
    manifest = json.loads((export / "v000001" / "manifest.json").read_text())
    assert len(client.get(key)) < 4 * manifest["row_dim"]
    engine = ClusterEngine(export, redis_cluster.url, ns=ns, cache_rows=0, hot_rows=10)
    try:
        engine.refresh()
        np.testing.assert_allclose(engine.score_records(chain.records)[0],
                                   local_scores(export, chain.records), atol=1e-6)
    finally:
        engine.close()


def test_hot_rows_are_the_most_shown_within_the_budget(chain, redis_cluster):
    from terarec.export.reader import VersionReader
    from terarec.export.storage import Storage

    reader = VersionReader(Storage(chain.export), chain.export.parent / "reader-cache")
    manifest = reader.manifest("v000004")
    keys, shows = reader.shows(manifest)
    assert len(keys) == manifest.data["sparse"]["rows"]  # small model: every key listed
    assert (np.diff(shows) <= 0).all() and shows[0] > shows[-1]
    assert publish(redis_cluster.url, chain.export, "hot") == 0
    row_bytes = 4 * manifest.row_dim + 8
    engine = engine_for(chain, redis_cluster.url, "hot", hot_rows=1000,
                        hot_bytes=25 * row_bytes)
    try:
        rows = engine.current.rows
        np.testing.assert_array_equal(rows.hot_keys, np.sort(keys[:25]))
        # the hot rows are the version's own rows
        local = reader.shards(manifest)
        want = np.concatenate([v for _, v in local])[
            np.searchsorted(np.concatenate([k for k, _ in local]), rows.hot_keys)]
        np.testing.assert_allclose(rows.hot_values, want)
    finally:
        engine.close()


@pytest.mark.parametrize("command", ["serve", "publish"])
def test_tier_urls_that_cannot_work_are_clear_errors(command, tmp_path, capsys):
    from terarec.loopback import free_port

    flag = "--sparse-tier" if command == "serve" else "--to"
    assert cli_main([command, str(tmp_path), flag, "http://127.0.0.1:1"]) == 2
    assert "expected redis://HOST:PORT" in capsys.readouterr().err
    dead = f"redis://127.0.0.1:{free_port()}"
    source = tmp_path
    if command == "publish":  # publish checks its source first: give it a version
        source = tmp_path / "v000001"
        source.mkdir()
        (source / "manifest.json").write_text("{}")
    assert cli_main([command, str(source), flag, dead]) == 2
    assert "no cluster node answered" in capsys.readouterr().err


def test_train_publishes_each_exported_version(redis_cluster, tmp_path):
    from serving_helpers import make_data

    data = make_data(tmp_path / "train.tsv", 1600)
    export = tmp_path / "export"
    assert cli_main(["train", "--train", str(data), "--out", str(tmp_path / "model"),
                     "--pass-rows", "800", "--batch-size", "400", "--embedding-dim", "4",
                     "--threads", "1", "--no-progress", "--export-to", str(export),
                     "--publish-to", redis_cluster.url, "--publish-namespace", "trained",
                     "--valid-split", "0"]) == 0
    control = Control(redis_cluster.url, Layout("trained"))
    try:
        newest = sorted(p.name for p in export.iterdir() if p.name.startswith("v"))[-1]
        assert control.newest() == newest
        assert control.meta(newest)["kind"] == "delta" and control.meta("v000001")["cold"]
    finally:
        control.close()


def test_the_serve_command_reads_the_tier(chain, redis_cluster):
    import http.client
    import os
    import subprocess
    import sys
    import time

    from terarec.loopback import free_port

    assert publish(redis_cluster.url, chain.export, "cli") == 0
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "terarec", "serve", str(chain.export), "--port", str(port),
         "--sparse-tier", redis_cluster.url, "--namespace", "cli", "--hot-rows", "10",
         "--cache-rows", "0", "--strict-sparse", "--hedge-floor-ms", "1", "--threads", "1",
         "--log-level", "warning"], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 60
        body = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("POST", "/predict", json.dumps({"candidates": chain.records}),
                             {"Content-Type": "application/json"})
                response = conn.getresponse()
                if response.status == 200:
                    body = json.loads(response.read())
                    break
            except OSError:
                pass
            time.sleep(0.2)
        assert body is not None, "the server never answered"
        assert body["version"] == 4
        np.testing.assert_allclose(body["scores"], chain.trainer_scores[4], atol=1e-5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_an_unreadable_newest_manifest_publishes_the_version_before_it(chain, redis_cluster,
                                                                      tmp_path, capsys):
    """As a server loads (and a writer builds on) the newest readable version, publish
    sends it; a version named outright whose manifest is unreadable is an error."""
    import shutil

    export = tmp_path / "export"
    shutil.copytree(chain.export, export)
    manifest = export / "v000004" / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])  # truncated
    url = redis_cluster.url
    assert publish(url, export, "unreadable") == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["version"] == "v000003" and out["announced"]
    assert publish(url, export / "v000004", "unreadable") == 2
    err = capsys.readouterr().err
    assert "v000004" in err and "Traceback" not in err
