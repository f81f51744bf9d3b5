"""``terarec publish`` to a cluster with a slot range down ended in a traceback
(``ClusterDownError``): it is one line saying what failed, and nothing is announced."""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis

from terarec.cli.main import main
from terarec.config import ModelConfig
from terarec.export import ModelExporter
from terarec.models import build_model
from terarec.types import FeatureSchema


@pytest.fixture
def export(tmp_path):
    schema = FeatureSchema.criteo()
    config = ModelConfig(name="lr")
    model = build_model(schema, config)
    keys = np.arange(1, 20001, dtype=np.int64) * 7919 * 1_000_003  # spread over the slots
    values = np.random.default_rng(0).normal(size=(len(keys), model.row_dim))
    ModelExporter(tmp_path / "export").write_full(
        schema=schema, model_config=config, dense=model.state_dict(), keys=np.sort(keys),
        values=values.astype(np.float32), pass_id=1)
    return tmp_path / "export"


def test_publish_to_a_cluster_with_a_slot_range_down_fails_in_one_line(export, tmp_path,
                                                                      capsys):
    from terarec.sparsetier.local import LocalCluster, redis_binaries

    if redis_binaries() is None:
        pytest.skip("redis-server / redis-cli not installed")
    with LocalCluster(tmp_path / "cluster", masters=3, replicas=0).start() as cluster:
        cluster.kill(cluster.master_ports()[-1])
        alive = cluster.live_ports()[0]
        deadline = time.monotonic() + 60
        while redis.Redis(port=alive).cluster("info")["cluster_state"] != "fail":
            assert time.monotonic() < deadline, "the cluster never noticed"
            time.sleep(0.2)
        assert main(["publish", str(export), "--to", f"redis://127.0.0.1:{alive}",
                     "--namespace", "down"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert "the cluster failed a request" in err[0] and "not announced" in err[0]
