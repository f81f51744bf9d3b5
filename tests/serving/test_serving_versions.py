"""Version following: corrupted, half-written or inconsistent versions are refused and
logged while the last good version keeps serving; a good full version recovers."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
from serving_helpers import SCHEMA

from terarec.data.readers import batch_from_records
from terarec.export import ModelExporter
from terarec.export.format import LATEST, MANIFEST, shard_name
from terarec.serving.engine import ServingEngine

TOL = 1e-5


@pytest.fixture
def export(live_run, tmp_path):
    """A private copy of the live run's export (versions 1-3)."""
    path = tmp_path / "export"
    shutil.copytree(live_run.export, path)
    return path


@pytest.fixture
def batch(live_run):
    return batch_from_records(live_run.records, SCHEMA)


def _write_delta(export, trainer, shift: float = 0.5):
    """A delta moving some rows: its scores differ from version 3's."""
    arrays = trainer.store.to_arrays()
    keys, values = arrays["keys"][::3], arrays["values"][::3] + shift
    return ModelExporter(export).write_delta(dense=trainer.model.state_dict(), keys=keys,
                                             values=values, deleted=arrays["keys"][1::50],
                                             pass_id=trainer.pass_id)


def _flip_byte(path, offset_from_end: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def _served(export, live_run, batch) -> ServingEngine:
    engine = ServingEngine(export)
    assert engine.refresh()
    assert engine.current.version == 3
    np.testing.assert_allclose(engine.score_batch(batch), live_run.cli_scores[3], atol=TOL)
    return engine


def test_a_good_delta_is_applied(export, live_run, batch):
    engine = _served(export, live_run, batch)
    _write_delta(export, live_run.trainer)
    assert engine.refresh()
    assert engine.current.version == 4
    assert np.abs(engine.score_batch(batch) - live_run.cli_scores[3]).max() > 1e-3


def test_corrupted_delta_is_refused_and_logged(export, live_run, batch, caplog):
    engine = _served(export, live_run, batch)
    _write_delta(export, live_run.trainer)
    _flip_byte(export / "v000004" / shard_name(0))
    with caplog.at_level(logging.ERROR, logger="terarec.serving.engine"):
        assert not engine.refresh()
    assert engine.current.version == 3
    assert "checksum mismatch" in engine.refused["v000004"]
    assert any("refusing version v000004" in r.getMessage() for r in caplog.records)
    np.testing.assert_allclose(engine.score_batch(batch), live_run.cli_scores[3], atol=TOL)
    # Later deltas build on the refused one: refused too, without reading their files.
    _write_delta(export, live_run.trainer)
    assert not engine.refresh()
    assert "refused version v000004" in engine.refused["v000005"]
    assert engine.metrics.registry.get_sample_value("terarec_versions_refused_total") == 2
    # A new full version is a fresh start.
    trainer = live_run.trainer
    arrays = trainer.store.to_arrays()
    ModelExporter(export).write_full(schema=SCHEMA, model_config=trainer.config.model,
                                     dense=trainer.model.state_dict(), keys=arrays["keys"],
                                     values=arrays["values"], pass_id=trainer.pass_id)
    assert engine.refresh()
    assert engine.current.version == 6
    np.testing.assert_allclose(engine.score_batch(batch), live_run.cli_scores[3], atol=TOL)


@pytest.mark.parametrize("damage", ["truncated manifest", "manifest of another version",
                                    "missing dense file", "corrupted dense file",
                                    "row width changed", "deleted-key count wrong"])
def test_damaged_delta_is_refused(export, live_run, batch, damage):
    engine = _served(export, live_run, batch)
    _write_delta(export, live_run.trainer)
    folder = export / "v000004"
    manifest = json.loads((folder / MANIFEST).read_text())
    if damage == "truncated manifest":
        (folder / MANIFEST).write_text((folder / MANIFEST).read_text()[:200])
    elif damage == "manifest of another version":
        manifest["name"] = "v000003"
    elif damage == "missing dense file":  # refused once it has been missing too long
        (folder / "dense.safetensors").unlink()
        engine.incomplete_timeout_s = 0
    elif damage == "corrupted dense file":
        _flip_byte(folder / "dense.safetensors")
    elif damage == "row width changed":
        manifest["row_dim"] += 1
    elif damage == "deleted-key count wrong":
        manifest["sparse"]["deleted"] += 1
    if damage in ("manifest of another version", "row width changed",
                  "deleted-key count wrong"):
        (folder / MANIFEST).write_text(json.dumps(manifest))
    assert not engine.refresh()
    assert engine.current.version == 3
    assert "v000004" in engine.refused
    np.testing.assert_allclose(engine.score_batch(batch), live_run.cli_scores[3], atol=TOL)


def test_half_written_version_is_invisible(export, live_run, batch):
    engine = _served(export, live_run, batch)
    _write_delta(export, live_run.trainer)
    # A writer that died before the manifest: files present, no manifest, LATEST moved
    # on by hand to make the case as bad as it gets.
    (export / "v000004" / MANIFEST).unlink()
    (export / LATEST).write_text("v000004")
    assert not engine.refresh()
    assert engine.current.version == 3
    assert engine.refused == {}
    # The next export never reuses the half-written folder's name.
    result = _write_delta(export, live_run.trainer)
    assert result.name == "v000005"
    assert engine.refresh()
    assert engine.current.version == 5
    assert engine.current.manifest.deltas == ["v000002", "v000003", "v000005"]


def test_startup_on_a_corrupted_latest_serves_the_good_prefix(export, live_run, batch):
    _write_delta(export, live_run.trainer)
    _flip_byte(export / "v000004" / shard_name(0))
    engine = ServingEngine(export)
    assert engine.refresh()
    assert engine.current.version == 3
    assert "v000004" in engine.refused
    np.testing.assert_allclose(engine.score_batch(batch), live_run.cli_scores[3], atol=TOL)


def test_corrupted_full_version_serves_nothing_rather_than_garbage(export, live_run):
    _flip_byte(export / "v000001" / shard_name(0))
    engine = ServingEngine(export)
    assert not engine.refresh()
    assert engine.current is None
    assert "checksum mismatch" in engine.refused["v000001"]


def _full_copy(export, name: str, edit) -> None:
    """Version ``name``: version 1 again with its first shard's (keys, values) passed
    through ``edit``, under a manifest consistent with the edited files (sizes and
    checksums match), named by LATEST."""
    from terarec.export.format import memmap_tensors, rows_bytes, sha256_bytes

    folder = export / name
    shutil.copytree(export / "v000001", folder)
    shard = folder / shard_name(0)
    tensors = memmap_tensors(shard)
    keys, values = edit(np.array(tensors["keys"]), np.array(tensors["values"]))
    del tensors
    data = rows_bytes(keys, values)
    shard.write_bytes(data)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest.update(name=name, version=int(name[1:]), base=name, created=1e10)
    manifest["files"][shard_name(0)] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    (export / LATEST).write_text(name)


def _nan_rows(keys, values):
    return keys, np.full_like(values, np.nan)


def _unsorted_keys(keys, values):
    keys = keys.copy()
    keys[1], keys[2] = keys[2], keys[1]  # first and last key as the manifest says
    return keys, values


@pytest.mark.parametrize("edit,reason", [(_nan_rows, "holds a non-finite value"),
                                         (_unsorted_keys, "keys are not sorted")])
def test_a_poisoned_full_version_is_refused(export, live_run, batch, caplog, edit, reason):
    """A full version whose rows were all NaN (or whose keys were not sorted) under a
    consistent manifest was swapped in: every request then failed (or scored wrong
    rows) and the last good version was abandoned."""
    engine = _served(export, live_run, batch)
    _full_copy(export, "v000004", edit)
    with caplog.at_level(logging.ERROR, logger="terarec.serving.engine"):
        assert not engine.refresh()
    assert engine.current.version == 3
    assert reason in engine.refused["v000004"]
    assert any("refusing version v000004" in r.getMessage() for r in caplog.records)
    np.testing.assert_allclose(engine.score_batch(batch), live_run.cli_scores[3], atol=TOL)
