"""VersionReader gives back what the writer wrote, and refuses what does not fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from terarec.config import ModelConfig
from terarec.export import ExportError, ModelExporter, Storage
from terarec.export.reader import VersionReader
from terarec.models import build_model
from terarec.types import FeatureSchema, FieldSpec

SCHEMA = FeatureSchema(label="y", fields=(FieldSpec("n", "numeric"), FieldSpec("c", "categorical")))
CONFIG = ModelConfig(name="lr", embedding_dim=4)


def _dense() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build_model(SCHEMA, CONFIG).state_dict().items()}


def test_full_and_delta_rows_read_back(tmp_path):
    model = build_model(SCHEMA, CONFIG)
    dim = model.row_dim
    exporter = ModelExporter(tmp_path / "export", shard_rows=3)
    keys = np.array([2, 5, 7, 11, 13], np.int64)
    values = np.arange(5 * dim, dtype=np.float32).reshape(5, dim)
    exporter.write_full(schema=SCHEMA, model_config=CONFIG, dense=_dense(), keys=keys,
                        values=values, pass_id=1)
    exporter.write_delta(dense=_dense(), keys=np.array([5, 17], np.int64),
                         values=np.ones((2, dim), np.float32), deleted=np.array([7]),
                         pass_id=2)
    reader = VersionReader(Storage(tmp_path / "export"), tmp_path / "cache")
    assert reader.latest() == "v000002"
    full = reader.manifest("v000001")
    shards = reader.shards(full)
    assert [len(k) for k, _ in shards] == [3, 2]
    np.testing.assert_array_equal(np.concatenate([k for k, _ in shards]), keys)
    np.testing.assert_array_equal(np.concatenate([np.asarray(v) for _, v in shards]), values)
    assert reader.schema(full) == SCHEMA
    net = reader.network(full, SCHEMA)
    assert not net.training and net.row_dim == dim
    upserts, rows, deleted = reader.delta(reader.manifest("v000002"))
    assert upserts.tolist() == [5, 17] and deleted.tolist() == [7]
    np.testing.assert_array_equal(rows, np.ones((2, dim), np.float32))


def test_a_replaced_file_is_refused(tmp_path):
    dim = build_model(SCHEMA, CONFIG).row_dim
    ModelExporter(tmp_path / "export").write_full(
        schema=SCHEMA, model_config=CONFIG, dense=_dense(), keys=np.array([1], np.int64),
        values=np.zeros((1, dim), np.float32), pass_id=1)
    shard = tmp_path / "export" / "v000001" / "sparse" / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4] + b"\0\0\0\1")
    reader = VersionReader(Storage(tmp_path / "export"), tmp_path / "cache")
    with pytest.raises(ExportError, match="shard-00000.safetensors: checksum mismatch"):
        reader.shards(reader.manifest("v000001"))
