"""Train -> export full + deltas -> serve: every version scores as `terarec predict` does,
and swaps under load lose no request and never mix two versions in one answer."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from serving_helpers import SCHEMA, ServerThread, split_context

import terarec
from terarec.data.readers import batch_from_records
from terarec.loopback import free_port
from terarec.serving.app import create_app
from terarec.serving.engine import ServingEngine

TOL = 1e-5


def test_run_exported_a_full_version_then_deltas(live_run):
    kinds = [e.kind for e in live_run.exported]
    assert kinds == ["full", "delta", "delta"]
    # Keys unseen for a pass are evicted, so the deltas must carry deletions too.
    assert all(e.deleted > 0 for e in live_run.exported[1:])
    assert live_run.ready_before_first_version == 503


def test_every_version_matches_offline_predict(live_run):
    assert sorted(live_run.server_scores) == [1, 2, 3]
    for version, served in live_run.server_scores.items():
        np.testing.assert_allclose(served, live_run.cli_scores[version], atol=TOL)
        np.testing.assert_allclose(live_run.kserve_scores[version],
                                   live_run.cli_scores[version], atol=TOL)
        np.testing.assert_allclose(served, live_run.trainer_scores[version], atol=TOL)
    # The versions differ, so agreeing with each of them is not agreeing by accident.
    assert np.abs(live_run.cli_scores[3] - live_run.cli_scores[1]).max() > 1e-3


def test_swaps_under_load_lose_nothing_and_never_mix_versions(live_run):
    assert len(live_run.under_load) > 0
    statuses = [s for s, _, _ in live_run.under_load]
    assert statuses.count(200) == len(statuses)
    seen = sorted({v for _, v, _ in live_run.under_load})
    assert seen[0] >= 1 and seen[-1] == 3
    for _, version, scores in live_run.under_load:
        np.testing.assert_allclose(scores, live_run.trainer_scores[version], atol=TOL)


def test_metrics_report_version_cache_and_latency(live_run):
    lines = {line.split(" ")[0]: float(line.split(" ")[1])
             for line in live_run.metrics_text.splitlines()
             if line and not line.startswith("#")}
    assert lines["terarec_model_version"] == 3
    assert lines["terarec_version_swaps_total"] == 3
    assert 0.0 < lines["terarec_cache_hit_rate"] <= 1.0
    assert lines['terarec_request_latency_seconds_count{route="predict"}'] >= 3
    assert lines["terarec_delta_lag_seconds"] >= 0.0


def test_restart_comes_up_on_the_latest_version(live_run):
    engine = ServingEngine(live_run.export)
    assert engine.refresh()
    assert engine.current.version == 3
    with ServerThread(create_app(engine)) as server:
        version, scores = server.predict({}, live_run.records)
    assert version == 3
    np.testing.assert_allclose(scores, live_run.cli_scores[3], atol=TOL)


def test_context_is_merged_into_every_candidate(live_run):
    engine = ServingEngine(live_run.export)
    engine.refresh()
    context, candidates, merged = split_context(live_run.records[:20], ("I1", "C1", "C2"))
    with ServerThread(create_app(engine)) as server:
        _, with_context = server.predict(context, candidates)
        _, flat = server.predict({}, merged)
    np.testing.assert_allclose(with_context, flat, atol=1e-7)
    expected = live_run.trainer.predict_batches([batch_from_records(merged, SCHEMA)])
    np.testing.assert_allclose(with_context, expected, atol=TOL)


def test_serve_command_answers_and_stops_cleanly(live_run):
    port = free_port()
    src = Path(terarec.__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src),
                                                        os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "terarec", "serve", str(live_run.export), "--port", str(port),
         "--threads", "1", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("POST", "/predict", json.dumps({"candidates": live_run.records}))
                response = conn.getresponse()
                body = json.loads(response.read())
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
        assert response.status == 200 and body["version"] == 3
        np.testing.assert_allclose(body["scores"], live_run.cli_scores[3], atol=TOL)
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 0, output
