"""``terarec train --follow ... --export-to ... --publish-to redis://``: each version is
published to a real Redis Cluster as it is exported (the first one whole, then deltas),
and a cluster server following the announced versions scores as the local server on the
export."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import local_scores
from serving_helpers import SCHEMA, make_data, raw_records, small_config

from terarec.export.reader import VersionReader
from terarec.export.storage import Storage
from terarec.loopback import free_port
from terarec.serving.cluster import ClusterEngine
from terarec.sparsetier.control import Control
from terarec.sparsetier.layout import Layout
from terarec.sparsetier.publish import PublishingExporter
from terarec.train.trainer import Trainer

pytestmark = pytest.mark.slow
SRC = Path(__file__).resolve().parents[2] / "src"
FILES = 3


def _land(src: Path, folder: Path) -> None:
    tmp = folder / f".{src.name}.tmp"
    shutil.copy(src, tmp)
    tmp.rename(folder / src.name)


def _wait_for(condition, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None or condition(), "the trainer exited early"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_follow_publishes_each_version_as_it_is_exported(redis_cluster, tmp_path):
    staging, folder = tmp_path / "staging", tmp_path / "logs"
    staging.mkdir()
    folder.mkdir()
    hours = [make_data(staging / f"2026-12-01T{h:02d}.tsv", 1200, sample_seed=h)
             for h in range(FILES)]
    export, ns = tmp_path / "export", "follow"
    control = Control(redis_cluster.url, Layout(ns))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), *sys.path])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "terarec", "train", "--follow", str(folder), "--out",
         str(tmp_path / "model"), "--stop-after", str(FILES), "--poll-seconds", "0.2",
         "--pass-rows", "100000", "--batch-size", "300", "--embedding-dim", "4",
         "--epochs", "1", "--threads", "1", "--no-progress", "--export-to", str(export),
         "--publish-to", redis_cluster.url, "--publish-namespace", ns],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for i, hour in enumerate(hours):  # a version announced per landed file
            _land(hour, folder)
            _wait_for(lambda n=i + 1: control.newest() == f"v{n:06d}", proc)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    try:
        reader = VersionReader(Storage(str(export)), tmp_path / "cache")
        newest = reader.latest()
        assert newest == f"v{FILES:06d}" == control.newest()
        assert control.meta("v000001")["kind"] == "full" and control.meta("v000001")["cold"]
        for n in range(2, FILES + 1):  # deltas: only their rows went out
            meta = control.meta(f"v{n:06d}")
            assert meta["kind"] == "delta" and meta["hot"] == "1"
            assert reader.manifest(f"v{n:06d}").data["sparse"]["rows"] > 0
    finally:
        control.close()
    records = raw_records(hours[-1], 40)
    engine = ClusterEngine(export, redis_cluster.url, ns=ns, hot_rows=20, cache_rows=0)
    try:
        assert engine.refresh() and engine.current.name == newest
        assert engine.current.rows.overlay_rows > 0  # delta rows read from the cluster
        np.testing.assert_allclose(engine.score_records(records)[0],
                                   local_scores(export, records), atol=1e-6)
    finally:
        engine.close()


def test_a_publish_that_failed_is_caught_up_by_the_next_export(redis_cluster, tmp_path):
    """The full version's publish fails (no cluster there); the next delta's publish
    sends the full version's rows too, and the chain is announced whole."""
    data = make_data(tmp_path / "train.tsv", 3000)
    trainer = Trainer(SCHEMA, small_config())
    exporter = PublishingExporter(tmp_path / "export", trainer, every_passes=1,
                                  publish_to=f"redis://127.0.0.1:{free_port()}",
                                  namespace="catchup")
    control = Control(redis_cluster.url, Layout("catchup"))

    def on_pass_end(t: Trainer, record: dict) -> None:
        exporter.on_pass_end(t, record)
        exporter.publish_to = redis_cluster.url  # the cluster is back

    try:
        trainer.fit([data], progress=False, on_pass_end=on_pass_end)
        names = [r.name for r in exporter.exported]
        assert names[0] == "v000001" and len(names) == 3
        assert [p.version for p in exporter.published] == names[1:]  # the first failed
        assert exporter.published[0].rows > exporter.exported[1].rows  # v000001's rows too
        assert control.newest() == names[-1]
        assert control.meta("v000001")["cold"] == "1"
    finally:
        control.close()
