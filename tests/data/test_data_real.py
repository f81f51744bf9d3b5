"""Real click-log samples (../shared/data, outside the repository): formats as found."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.csv as pa_csv
import pytest
import torch

from terarec.data.hashing import hash_column
from terarec.data.readers import batch_from_records, csv_schema, iter_batches
from terarec.types import Batch, FeatureSchema

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
CRITEO_SAMPLE = DATA / "criteo-kaggle-sample" / "train-10k.txt"
AVAZU_SAMPLE = DATA / "avazu-sample" / "train-10k.csv"

pytestmark = pytest.mark.real_data

AVAZU_CATEGORICAL = [
    "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id", "app_domain",
    "app_category", "device_id", "device_ip", "device_model", "device_type",
    "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21",
]


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is not available")
    return path


def test_criteo_sample_reads_completely():
    path = need(CRITEO_SAMPLE)
    schema = FeatureSchema.criteo()
    batches = list(iter_batches(path, schema, batch_size=4096))
    assert [len(b) for b in batches] == [4096, 4096, 1808]
    batch = Batch.concat(batches)
    assert int(batch.labels.sum()) == 2182  # 21.8 % clicks, as documented
    flags = batch.dense[:, 13:]
    assert set(torch.unique(flags).tolist()) == {0.0, 1.0}
    assert flags[:, 0].mean() > 0.3  # I1 is missing in a large share of rows
    assert torch.isfinite(batch.dense).all()
    assert batch.sparse.one_per_slot
    raw = pa_csv.read_csv(path, read_options=pa_csv.ReadOptions(
        column_names=list(schema.column_names)), parse_options=pa_csv.ParseOptions(
        delimiter="\t"), convert_options=pa_csv.ConvertOptions(
        column_types={n: "string" for n in schema.column_names}))
    for name in ("C1", "C3", "C22", "C26"):
        expected = hash_column(name, raw.column(name), schema.hash_salt)
        assert np.array_equal(batch.sparse.field_values(name).numpy(), expected)


def test_avazu_sample_reads_with_header_and_serves_identically():
    path = need(AVAZU_SAMPLE)
    schema = csv_schema("click", [], AVAZU_CATEGORICAL)
    batch = Batch.concat(list(iter_batches(path, schema, batch_size=4096)))
    assert len(batch) == 9999
    assert batch.labels.mean().item() == pytest.approx(0.171, abs=0.001)
    assert batch.dense.shape == (9999, 0)
    # the same rows as JSON with integer-looking columns sent as numbers
    with open(path) as fh:
        header = fh.readline().strip().split(",")
        lines = [fh.readline().strip().split(",") for _ in range(50)]
    records = []
    for values in lines:
        rec = dict(zip(header, values, strict=True))
        for name in ("C1", "banner_pos", "C14", "C15", "C21"):
            rec[name] = int(rec[name])
        rec["click"] = int(rec["click"])
        records.append(rec)
    served = batch_from_records(records, schema)
    head = batch.slice(0, 50)
    assert torch.equal(served.sparse.values, head.sparse.values)
    assert torch.equal(served.labels, head.labels)
