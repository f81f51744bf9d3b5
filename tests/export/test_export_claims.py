"""Version numbers are claimed atomically on an object store too (conditional put, moto's
S3 server on loopback): concurrent writers to one URI never share a version name."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from terarec.config import ModelConfig
from terarec.export import ModelExporter, Storage, read_manifest
from terarec.export.format import CLAIM
from terarec.models import build_model
from terarec.types import FeatureSchema

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

SCHEMA = FeatureSchema.criteo()


@pytest.fixture
def s3(s3_server):
    fs = Storage("s3://claims", s3_server).fs
    if not fs.exists("claims"):  # moto's state is per process, shared by its servers
        fs.mkdir("claims")
    return s3_server


def _full(exporter: ModelExporter) -> str:
    config = ModelConfig(name="lr", embedding_dim=4)
    model = build_model(SCHEMA, config)
    keys = np.arange(10, dtype=np.int64)
    values = np.ones((10, model.row_dim), np.float32)
    dense = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return exporter.write_full(schema=SCHEMA, model_config=config, dense=dense, keys=keys,
                               values=values, pass_id=1).name


def test_a_claimed_name_is_skipped_on_s3(s3):
    storage = Storage("s3://claims/claimed", s3)
    assert storage.create_exclusive(f"v000001/{CLAIM}", b"other writer")
    assert not storage.create_exclusive(f"v000001/{CLAIM}", b"me")
    assert _full(ModelExporter("s3://claims/claimed", s3)) == "v000002"
    assert storage.read_bytes(f"v000001/{CLAIM}") == b"other writer"


def test_concurrent_writers_on_s3_never_share_a_version(s3):
    def write(_: int) -> str:
        return _full(ModelExporter("s3://claims/ctr", s3))

    with ThreadPoolExecutor(4) as pool:
        names = list(pool.map(write, range(8)))
    assert len(set(names)) == 8
    storage = Storage("s3://claims/ctr", s3)
    for name in names:
        assert read_manifest(storage, name).name == name
        assert json.loads(storage.read_bytes(f"{name}/{CLAIM}"))["pid"] > 0
