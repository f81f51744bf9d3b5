"""Versions written by N ranks together (in-process gloo ranks): the readers' format is
unchanged, shards hold disjoint increasing key ranges cut across every rank's keys, and
the served rows are exactly the ranks' rows, in full versions and deltas."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from ranks import run_ranks
from test_checkpoint_layout import _batches, _config, _trained

from terarec.distributed.context import DistContext
from terarec.distributed.sharding import deal_batches
from terarec.export import IncrementalExporter, latest_version, read_manifest
from terarec.export.storage import Storage
from terarec.serving.engine import ServingEngine
from terarec.train.trainer import Trainer

SHARD_ROWS = 150


def _publish(ctx: DistContext, model: str, uri: str) -> list[dict]:
    """Each rank: restore its keys, export a full version, train a pass, export a delta;
    returns this rank's rows after each export."""
    trainer = Trainer.from_checkpoint(model, _config(), ctx=ctx)
    exporter = IncrementalExporter(uri, trainer, every_passes=1, shard_rows=SHARD_ROWS)
    seen = []
    exporter.export(trainer)
    seen.append(trainer.store.to_arrays())
    trainer.train_pass(trainer.plan(deal_batches(_batches(11), ctx.rank, ctx.world)))
    exporter.on_pass_end(trainer)
    seen.append(trainer.store.to_arrays())
    return [{"keys": a["keys"], "values": a["values"]} for a in seen]


def _merged(parts: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    keys = np.concatenate([p["keys"] for p in parts])
    order = np.argsort(keys)
    return keys[order], np.concatenate([p["values"] for p in parts])[order]


def test_two_ranks_publish_full_and_delta_versions_of_their_rows(tmp_path: Path):
    _trained(tmp_path / "model")
    uri = tmp_path / "export"
    ranks = run_ranks(_publish, 2, str(tmp_path / "model"), str(uri))
    storage = Storage(str(uri))
    full = read_manifest(storage, "v000001")
    keys, values = _merged([r[0] for r in ranks])
    assert full.kind == "full" and full.data["sparse"]["rows"] == len(keys) > 4 * SHARD_ROWS
    shards = full.shards
    assert len(shards) >= 3  # cut by key range across both ranks' keys
    assert all(a["last_key"] < b["first_key"] for a, b in zip(shards[:-1], shards[1:], strict=True))
    assert sum(s["rows"] for s in shards) == len(keys)
    delta = read_manifest(storage, latest_version(storage))
    assert delta.kind == "delta" and delta.data["parent"] == full.name

    engine = ServingEngine(uri)
    try:
        assert engine.refresh()
        assert engine.served().name == delta.name
        keys, values = _merged([r[1] for r in ranks])
        got, found = engine.served().rows.lookup(keys)
        assert found.all()
        np.testing.assert_array_equal(got, values)
    finally:
        engine.close()
