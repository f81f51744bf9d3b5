"""Export layout and delta semantics: replaying base + deltas gives back the store."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from terarec.cli.main import main as cli_main
from terarec.config import ModelConfig, StoreConfig, TrainConfig
from terarec.data.synth import generate
from terarec.embedding.types import RowChunk
from terarec.export import (
    ExportError,
    IncrementalExporter,
    ModelExporter,
    Storage,
    latest_version,
    read_manifest,
)
from terarec.export.compressed import RowCodec
from terarec.export.format import CLAIM, DELETED_FILE, LATEST, MANIFEST
from terarec.io import sha256_file
from terarec.modeldir import load_checkpoint, save_checkpoint
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema

SCHEMA = FeatureSchema.criteo()


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("export-data") / "train.tsv"
    generate(path, 2400, model_seed=0, sample_seed=5, vocab_scale=0.01)
    return path


def _trainer(evict_after_passes: int | None = 1) -> Trainer:
    config = TrainConfig(batch_size=200, pass_rows=600, seed=1, threads=1,
                         model=ModelConfig(name="deepfm", embedding_dim=4, deep_mlp=(16,)),
                         store=StoreConfig(evict_after_passes=evict_after_passes))
    return Trainer(SCHEMA, config)


def _replay(uri, name: str) -> dict[int, np.ndarray]:
    """key -> row of version ``name``, rebuilt from its files with plain dicts."""
    storage = Storage(uri)
    manifest = read_manifest(storage, name)
    rows: dict[int, np.ndarray] = {}
    for version in manifest.chain:
        m = read_manifest(storage, version)
        folder = storage.local_path(version)
        if m.kind == "delta":
            for key in load_file(str(folder / DELETED_FILE))["keys"].tolist():
                rows.pop(key, None)
        for shard in m.shards:
            t = load_file(str(folder / shard["file"]))
            rows.update(zip(t["keys"].tolist(), t["values"], strict=True))
    return rows


def _store_rows(trainer: Trainer) -> dict[int, np.ndarray]:
    arrays = trainer.store.to_arrays()
    return dict(zip(arrays["keys"].tolist(), arrays["values"], strict=True))


def test_base_plus_deltas_replays_to_the_store_after_every_pass(data, tmp_path):
    uri = tmp_path / "export"
    trainer = _trainer(evict_after_passes=2)
    exporter = IncrementalExporter(uri, trainer, every_passes=1)
    checked = []

    def on_pass_end(t, record):
        result = exporter.on_pass_end(t, record)
        replayed, live = _replay(uri, result.name), _store_rows(t)
        assert replayed.keys() == live.keys()
        for key, row in live.items():
            np.testing.assert_array_equal(replayed[key], row)
        checked.append(result)

    trainer.fit([data], progress=False, on_pass_end=on_pass_end)
    assert [r.kind for r in checked] == ["full", "delta", "delta", "delta"]
    # Deltas hold the keys trained since the last version, not the whole store (which
    # keeps two passes' keys), and carry the keys evicted since (from the third pass on).
    assert all(0 < r.rows < len(trainer.store) for r in checked[1:])
    assert [r.deleted > 0 for r in checked[1:]] == [False, True, True]
    manifest = read_manifest(Storage(uri), "v000004")
    assert manifest.base == "v000001" and manifest.deltas == ["v000002", "v000003", "v000004"]
    assert manifest.data["parent"] == "v000003" and manifest.pass_id == 4


def test_manifest_lists_every_file_with_its_checksum(data, tmp_path):
    uri = tmp_path / "export"
    trainer = _trainer()
    exporter = IncrementalExporter(uri, trainer, every_passes=2, shard_rows=500)
    trainer.fit([data], progress=False, on_pass_end=exporter.on_pass_end)
    assert [r.name for r in exporter.exported] == ["v000001", "v000002"]
    assert (uri / LATEST).read_text() == "v000002"
    for name in ("v000001", "v000002"):
        manifest = read_manifest(Storage(uri), name)
        on_disk = {p.relative_to(uri / name).as_posix()
                   for p in (uri / name).rglob("*") if p.is_file()} - {MANIFEST, CLAIM}
        assert on_disk == set(manifest.files)
        for rel, info in manifest.files.items():
            assert sha256_file(uri / name / rel) == info["sha256"]
    full = read_manifest(Storage(uri), "v000001")
    assert len(full.shards) > 1 and sum(s["rows"] for s in full.shards) == full.data[
        "sparse"]["rows"]
    lasts = [s["last_key"] for s in full.shards]
    firsts = [s["first_key"] for s in full.shards]
    assert all(last < first for last, first in zip(lasts, firsts[1:], strict=False))
    assert FeatureSchema.from_dict(full.data["schema"]) == SCHEMA


def test_delta_every_minutes_waits_for_the_clock(data, tmp_path):
    clock = [1000.0]
    trainer = _trainer()
    exporter = IncrementalExporter(tmp_path / "export", trainer, every_minutes=20,
                                   clock=lambda: clock[0])

    def on_pass_end(t, record):
        clock[0] += 15 * 60  # each pass takes 15 minutes
        exporter.on_pass_end(t, record)

    trainer.fit([data], progress=False, on_pass_end=on_pass_end)
    # full at pass 1; then 30 min since it at pass 3 -> delta; pass 4 only 15 min after.
    assert [(r.name, r.kind) for r in exporter.exported] == [("v000001", "full"),
                                                            ("v000002", "delta")]
    assert exporter.finish(trainer).kind == "delta"
    assert exporter.finish(trainer) is None


def test_full_versions_on_a_schedule_deltas_between(data, tmp_path):
    clock = [1000.0]
    trainer = _trainer()
    exporter = IncrementalExporter(tmp_path / "export", trainer, every_passes=1,
                                   full_every_hours=0.5, clock=lambda: clock[0])

    def on_pass_end(t, record):
        clock[0] += 15 * 60  # each pass takes 15 minutes
        exporter.on_pass_end(t, record)

    trainer.fit([data], progress=False, on_pass_end=on_pass_end)
    # full at pass 1, deltas, and a full version again once 30 min passed since the last
    assert [r.kind for r in exporter.exported] == ["full", "delta", "full", "delta"]
    assert exporter.on_pass_end(trainer) is None  # nothing trained since the last export


def test_full_version_at_a_daily_time(data, tmp_path):
    from datetime import datetime

    wall = [datetime(2026, 12, 1, 1, 0).timestamp()]  # 01:00, before the 02:30 full
    trainer = _trainer()
    exporter = IncrementalExporter(tmp_path / "export", trainer, every_passes=1,
                                   full_at="02:30", wall_clock=lambda: wall[0])

    def on_pass_end(t, record):
        wall[0] += 45 * 60  # each pass takes 45 minutes: 01:45, 02:30, 03:15, 04:00
        exporter.on_pass_end(t, record)

    trainer.fit([data], progress=False, on_pass_end=on_pass_end)
    # the first export is full; 02:30 passed at the second pass end; not again that day
    assert [r.kind for r in exporter.exported] == ["full", "full", "delta", "delta"]
    with pytest.raises(ValueError, match="expected HH:MM"):
        IncrementalExporter(tmp_path / "other", trainer, full_at="25:00")


def test_a_restarted_runs_first_delta_is_due_at_once(data, tmp_path):
    clock = [1000.0]
    trainer = _trainer()
    uri = tmp_path / "export"
    IncrementalExporter(uri, trainer, every_passes=1).export(trainer)
    again = IncrementalExporter(uri, trainer, every_minutes=20, clock=lambda: clock[0])
    assert not again.due(trainer)  # nothing trained since
    trainer.pass_id += 1
    assert again.due(trainer)


def test_a_failed_write_leaves_the_previous_version_current(data, tmp_path, monkeypatch):
    uri = tmp_path / "export"
    trainer = _trainer()
    exporter = IncrementalExporter(uri, trainer, every_passes=1)
    trainer.fit([data], progress=False, on_pass_end=exporter.on_pass_end)
    storage = exporter.exporter.storage
    real_write = storage.write_bytes

    def crash_on_dense(rel, payload):
        if rel.endswith("dense.safetensors"):
            raise OSError("disk full")
        real_write(rel, payload)

    monkeypatch.setattr(storage, "write_bytes", crash_on_dense)
    with pytest.raises(OSError, match="disk full"):
        exporter.export(trainer, full=True)
    assert not (uri / "v000005" / MANIFEST).exists()
    assert latest_version(storage) == "v000004"
    monkeypatch.setattr(storage, "write_bytes", real_write)
    assert exporter.export(trainer).name == "v000006"  # never reuses a half-written name
    assert not list(uri.rglob("*.tmp"))


def test_resume_continues_deltas_only_from_the_exact_pass(data, tmp_path):
    uri = tmp_path / "export"
    trainer = _trainer()
    exporter = IncrementalExporter(uri, trainer, every_passes=1)

    class Interrupted(Exception):
        pass

    def stop_after_two(t, record):
        exporter.on_pass_end(t, record)
        if t.pass_id == 2:
            raise Interrupted

    with pytest.raises(Interrupted):
        trainer.fit([data], progress=False, on_pass_end=stop_after_two)
    same = IncrementalExporter(uri, trainer, every_passes=1)
    assert not same.due(trainer)
    trainer.pass_id += 1  # as if a pass had been trained without exporting
    behind = IncrementalExporter(uri, trainer, every_passes=1)
    assert behind.export(trainer).kind == "full"


def test_delta_needs_a_version_to_build_on(tmp_path):
    with pytest.raises(ExportError, match="no version to build a delta on"):
        ModelExporter(tmp_path / "empty").write_delta(
            dense={}, keys=np.empty(0, np.int64), values=np.empty((0, 2), np.float32),
            deleted=np.empty(0, np.int64), pass_id=0)


def test_an_unreadable_newest_manifest_does_not_block_the_next_version(tmp_path):
    """A server skips a newest version whose manifest cannot be read and waits for a good
    full version; writing one (or a delta) failed on that very manifest, so nothing could
    replace it short of deleting it by hand."""
    uri = tmp_path / "export"
    exporter = ModelExporter(uri)
    keys, values = np.array([1, 5], np.int64), np.ones((2, 4), np.float32)
    exporter.write_full(schema=SCHEMA, model_config=ModelConfig(), dense={}, keys=keys,
                        values=values, pass_id=1)
    broken = uri / "v000002"
    broken.mkdir()
    (broken / MANIFEST).write_text('{"name": ')  # truncated
    (uri / LATEST).write_text("v000002")
    delta = exporter.write_delta(dense={}, keys=keys[:1], values=values[:1] * 2,
                                 deleted=np.empty(0, np.int64), pass_id=2)
    assert delta.name == "v000003"
    assert read_manifest(Storage(uri), "v000003").data["parent"] == "v000001"
    full = exporter.write_full(schema=SCHEMA, model_config=ModelConfig(), dense={},
                               keys=keys, values=values, pass_id=3)
    assert full.name == "v000004" and latest_version(Storage(uri)) == "v000004"


def test_unsorted_keys_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="sorted"):
        ModelExporter(tmp_path / "x").write_full(
            schema=SCHEMA, model_config=ModelConfig(), dense={},
            keys=np.array([3, 1], np.int64), values=np.zeros((2, 4), np.float32), pass_id=0)


def test_non_finite_rows_are_refused(tmp_path):
    values = np.zeros((3, 4), np.float32)
    values[1, 2] = np.nan
    with pytest.raises(ValueError, match="1 rows hold non-finite values .first key 5"):
        ModelExporter(tmp_path / "x").write_full(
            schema=SCHEMA, model_config=ModelConfig(), dense={},
            keys=np.array([1, 5, 9], np.int64), values=values, pass_id=0)
    assert latest_version(Storage(tmp_path / "x")) is None




def test_rows_beyond_fp16_are_refused_naming_the_key(tmp_path):
    # The encoder named the row's position in its shard ("row 1"), not its key.
    values = np.zeros((3, 4), np.float32)
    values[1, 2] = -1e6
    with pytest.raises(ValueError, match=r"1 rows hold values beyond \+-65504, which fp16 "
                                         r"\(--bits 16\) cannot store \(first key 5\)"):
        ModelExporter(tmp_path / "x", codec=RowCodec(16)).write_full(
            schema=SCHEMA, model_config=ModelConfig(), dense={},
            keys=np.array([1, 5, 9], np.int64), values=values, pass_id=0)
    assert latest_version(Storage(tmp_path / "x")) is None


def _chunk(keys: list[int], values: np.ndarray) -> RowChunk:
    n = len(keys)
    return RowChunk(np.array(keys, np.int64), values, np.zeros((n, 0), np.float32),
                    np.ones(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.int32))


def test_shard_rows_beyond_the_table_hold_no_buffer_of_that_size(tmp_path):
    # A shard buffer of 10**13 rows could not be allocated: the export failed.
    exporter = ModelExporter(tmp_path / "x", shard_rows=10**13)
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    result = exporter.write_full(schema=SCHEMA, model_config=ModelConfig(), dense={},
                                 rows=[_chunk([1, 5], values[:2]), _chunk([9], values[2:])],
                                 row_dim=4, pass_id=0)
    assert result.rows == 3 and len(read_manifest(exporter.storage, result.name).shards) == 1
    replayed = _replay(tmp_path / "x", result.name)
    np.testing.assert_array_equal(np.stack([replayed[k] for k in (1, 5, 9)]), values)


def test_full_export_of_a_spilling_tiered_store_streams_its_rows(data, tmp_path):
    config = TrainConfig(batch_size=200, pass_rows=600, seed=1, threads=1,
                         model=ModelConfig(name="fm", embedding_dim=4),
                         store=StoreConfig(memory_budget="600KB",
                                           disk_path=str(tmp_path / "store")))
    trainer = Trainer(SCHEMA, config)
    trainer.fit([data], progress=False)
    assert trainer.store.tier_stats().spilled > 0
    uri = tmp_path / "export"
    result = IncrementalExporter(uri, trainer, shard_rows=128).export(trainer, full=True)
    assert result.kind == "full" and result.rows == len(trainer.store)
    assert len(read_manifest(Storage(uri), result.name).shards) == -(-result.rows // 128)
    replayed, live = _replay(uri, result.name), _store_rows(trainer)
    assert replayed.keys() == live.keys()
    for key, row in live.items():
        np.testing.assert_array_equal(replayed[key], row)


def test_cli_export_writes_the_checkpoint_as_a_full_version(data, tmp_path, capsys):
    trainer = _trainer(evict_after_passes=None)
    trainer.fit([data], progress=False)
    save_checkpoint(tmp_path / "model", trainer)
    uri = tmp_path / "export"
    assert cli_main(["export", "--model", str(tmp_path / "model"), "--out", str(uri),
                     "--shard-rows", "700"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["name"] == "v000001" and printed["kind"] == "full"
    ckpt = load_checkpoint(tmp_path / "model")
    replayed = _replay(uri, "v000001")
    assert sorted(replayed) == ckpt.sparse["keys"].tolist()
    np.testing.assert_array_equal(np.stack([replayed[k] for k in sorted(replayed)]),
                                  ckpt.sparse["values"])
    manifest = read_manifest(Storage(uri), "v000001")
    assert manifest.pass_id == trainer.pass_id
    assert manifest.data["model"]["name"] == "deepfm"


def test_cli_train_exports_a_full_version_and_deltas(data, tmp_path):
    uri = tmp_path / "export"
    assert cli_main(["train", "--train", str(data), "--out", str(tmp_path / "model"),
                     "--pass-rows", "800", "--batch-size", "400", "--embedding-dim", "4",
                     "--threads", "1", "--no-progress", "--export-to", str(uri),
                     "--delta-every", "1", "--valid-split", "0"]) == 0  # one epoch
    storage = Storage(uri)
    assert latest_version(storage) == "v000003"
    kinds = [read_manifest(storage, f"v00000{i}").kind for i in (1, 2, 3)]
    assert kinds == ["full", "delta", "delta"]
    assert cli_main(["train", "--train", str(data), "--out", str(tmp_path / "m2"),
                     "--delta-every", "2"]) == 2



def test_a_slice_exported_again_is_a_delta_with_bucketed_numeric_fields(data, tmp_path,
                                                                      capsys):
    # Bucket edges are a tuple in the schema and a list in the manifest read back.
    schema = replace(SCHEMA, fields=tuple(replace(f, buckets=(0.5, 1.5)) if f.name == "I1"
                                          else f for f in SCHEMA.fields))
    trainer = Trainer(schema, _trainer(evict_after_passes=None).config)
    trainer.fit([data], progress=False)
    save_checkpoint(tmp_path / "model", trainer)
    keys_file = tmp_path / "keys.tsv"
    values = [line.split("\t")[14] for line in data.read_text().splitlines()]
    keys_file.write_text("C1\n" + "\n".join(values) + "\n")
    argv = ["export", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "export"),
            "--slice", "C1", "--keys-from", str(keys_file)]
    assert cli_main(argv) == 0 and cli_main(argv) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [p["kind"] for p in printed] == ["full", "delta"]
    assert printed[0]["rows"] > 0 and printed[1]["rows"] == printed[1]["deleted"] == 0



def _model_and_c1_keys(data, tmp_path):
    """A model trained on ``data`` in ``tmp_path / "model"``, and a one-column file with a
    header holding the C1 values of ``data``."""
    trainer = _trainer(evict_after_passes=None)
    trainer.fit([data], progress=False)
    save_checkpoint(tmp_path / "model", trainer)
    keys_file = tmp_path / "keys.tsv"
    keys_file.write_text("C1\n" + "\n".join(line.split("\t")[14] for line in
                                              data.read_text().splitlines()) + "\n")
    return keys_file


def test_a_criteo_slice_takes_its_keys_from_the_headerless_training_file(data, tmp_path):
    """The Criteo files a model trained on have no header: read with the model's own
    columns, they give the keys a one-column file with a header gives."""
    keys_file = _model_and_c1_keys(data, tmp_path)
    rows = []
    for name, source in (("headed", keys_file), ("training", data)):
        assert cli_main(["export", "--model", str(tmp_path / "model"), "--out",
                         str(tmp_path / name), "--slice", "C1", "--keys-from",
                         str(source)]) == 0
        rows.append(read_manifest(Storage(tmp_path / name), "v000001").data["sparse"]["rows"])
    assert rows[0] == rows[1] > 0


def test_a_delta_of_an_empty_slice_keeps_the_row_width(data, tmp_path):
    # A delta with no changed row (the same checkpoint exported again): its rows were
    # 0 x 0, the manifest said row_dim 0 and no reader could open it.
    keys_file = _model_and_c1_keys(data, tmp_path)
    uri = tmp_path / "export"
    argv = ["export", "--model", str(tmp_path / "model"), "--out", str(uri),
            "--slice", "C1", "--keys-from", str(keys_file)]
    assert cli_main(argv) == 0 and cli_main(argv) == 0
    storage = Storage(uri)
    full, delta = read_manifest(storage, "v000001"), read_manifest(storage, "v000002")
    assert delta.kind == "delta" and delta.data["sparse"]["rows"] == 0
    assert delta.row_dim == full.row_dim == full.data["model"]["embedding_dim"] + 1 > 1



def test_a_slice_and_a_whole_model_never_share_a_uri(data, tmp_path, capsys):
    """Written over another part, a version silently became what the URI serves."""
    trainer = _trainer(evict_after_passes=None)
    trainer.fit([data], progress=False)
    model = tmp_path / "model"
    save_checkpoint(model, trainer)
    keys_file = tmp_path / "keys.tsv"
    keys_file.write_text("C1\n" + "\n".join(line.split("\t")[14] for line in
                                              data.read_text().splitlines()) + "\n")
    whole, part = tmp_path / "whole", tmp_path / "part"
    base = ["export", "--model", str(model), "--out"]
    sliced = ["--keys-from", str(keys_file), "--slice"]
    assert cli_main([*base, str(whole)]) == 0 and cli_main([*base, str(part), *sliced, "C1"]) == 0
    capsys.readouterr()
    for argv, message in (
            ([*base, str(whole), *sliced, "C1"],
             f"{whole} holds a whole model (newest version v000001); export slice 'C1' to a "
             "URI of its own"),
            ([*base, str(part)], f"{part} holds slice 'C1' (newest version v000001); export a "
                                 "whole model to a URI of its own"),
            ([*base, str(part), *sliced, "C1,C2"], f"{part} holds slice 'C1' (newest version "
                                                   "v000001); export slice 'C1,C2' to")):
        assert cli_main(argv) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(ExportError, match=f"{part} holds slice 'C1'"):  # train --export-to
        IncrementalExporter(part, trainer)
    assert latest_version(Storage(whole)) == latest_version(Storage(part)) == "v000001"
    assert cli_main([*base, str(part), *sliced, "C1"]) == 0  # the same slice: a delta


MANIFEST_ERRORS = [
    (lambda m: m.update(kind="partial"), "kind: 'partial' is not one of full, delta"),
    (lambda m: m.update(row_dim="4"), "row_dim must be an integer, got string '4'"),
    (lambda m: m.update(row_dim=0), "row_dim: 0 must be >= 1"),
    (lambda m: m.pop("files"), "missing field(s) ['files']"),
    (lambda m: m.update(owner="me"), "unknown field(s) ['owner']"),
    (lambda m: m["sparse"]["shards"][0].update(rows=-1), "sparse.shards[0].rows: -1 must be"),
    (lambda m: m["sparse"]["shards"][0].pop("last_key"),
     "sparse.shards[0]: missing field(s) ['last_key']"),
    (lambda m: m["files"]["dense.safetensors"].update(sha256="xyz"),
     "files['dense.safetensors'].sha256: 'xyz' does not match"),
    (lambda m: m.update(deltas="v000002"), "deltas must be an array, got string"),
]


@pytest.mark.parametrize(("edit", "message"), MANIFEST_ERRORS,
                         ids=[m.split(":")[0].split(" ")[0] for _, m in MANIFEST_ERRORS])
def test_bad_manifests_are_refused_naming_the_path(tmp_path, edit, message):
    trainer = _trainer()
    keys = np.arange(5, dtype=np.int64)
    exporter = ModelExporter(tmp_path / "export")
    exporter.write_full(schema=SCHEMA, model_config=trainer.config.model,
                        dense={"w": torch.zeros(2)}, keys=keys,
                        values=np.zeros((5, 4), np.float32), pass_id=1)
    path = tmp_path / "export" / "v000001" / MANIFEST
    body = json.loads(path.read_text())
    read_manifest(Storage(tmp_path / "export"), "v000001")  # the written one is fine
    edit(body)
    path.write_text(json.dumps(body))
    with pytest.raises(ExportError) as info:
        read_manifest(Storage(tmp_path / "export"), "v000001")
    assert f"{MANIFEST}: " in str(info.value) and message in str(info.value)
