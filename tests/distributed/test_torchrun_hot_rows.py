"""Hot rows of a version written by 2 torchrun ranks: the full version lists the most-shown
keys of both ranks' rows (as a single-process export does), ``--publish-to`` carries
them into the Redis Cluster, and a cluster server keeps exactly the top of them local."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from test_torchrun import torchrun

from terarec.export.reader import VersionReader
from terarec.export.storage import Storage
from terarec.kernels import shard_of
from terarec.modeldir import load_checkpoint
from terarec.sparsetier.control import Control
from terarec.sparsetier.layout import Layout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from serving_helpers import make_data  # noqa: E402

from terarec.serving.cluster import ClusterEngine  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]
HOT = 40


def test_two_rank_export_lists_and_publishes_the_hot_rows(redis_cluster, tmp_path):
    data = make_data(tmp_path / "train.tsv", 3000)
    model, live = tmp_path / "model", tmp_path / "live"
    torchrun(["--train", str(data), "--out", str(model), "--epochs", "1",
              "--pass-rows", "100000", "--batch-size", "500", "--embedding-dim", "4",
              "--threads", "1", "--no-progress", "--export-to", str(live),
              "--publish-to", redis_cluster.url, "--publish-namespace", "ranks"])
    # one pass: the only version is the full one, of the checkpoint's rows
    chunks = list(load_checkpoint(model).iter_sorted())
    keys = np.concatenate([c.keys for c in chunks])
    shows = np.concatenate([c.show for c in chunks])
    assert len(np.unique(shard_of(keys, 2))) == 2  # both ranks held rows
    expected = keys[np.lexsort((keys, -shows))]
    assert shows.max() > shows.min()  # a ranking that could come out wrong

    reader = VersionReader(Storage(str(live)), tmp_path / "cache")
    manifest = reader.manifest(reader.latest())
    assert manifest.kind == "full"
    listed = reader.shows(manifest)
    assert listed is not None
    np.testing.assert_array_equal(listed[0], expected)
    np.testing.assert_array_equal(listed[1], np.sort(shows)[::-1])

    control = Control(redis_cluster.url, Layout("ranks"))
    try:
        assert control.newest() == manifest.name
        np.testing.assert_array_equal(control.shows_of(manifest.name), expected)
    finally:
        control.close()
    engine = ClusterEngine(live, redis_cluster.url, ns="ranks", hot_rows=HOT)
    try:
        assert engine.refresh()
        rows = engine.current.rows
        np.testing.assert_array_equal(rows.hot_keys, np.sort(expected[:HOT]))
    finally:
        engine.close()
