"""Numeric standardisation: statistics gathered from the training file, saved in the
schema, applied identically when serving; schemas without statistics behave as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from terarec.cli.main import main
from terarec.data.numeric import with_numeric_stats
from terarec.data.readers import batch_from_records, csv_schema, iter_batches
from terarec.serving.features import request_batch
from terarec.types import FeatureSchema


def _write(path: Path, hours: np.ndarray, counts: np.ndarray, labels: np.ndarray) -> Path:
    rows = [f"{y},{h},{'' if np.isnan(c) else repr(float(c))},k{i % 7}"
            for i, (y, h, c) in enumerate(zip(labels, hours, counts, strict=True))]
    path.write_text("y,hour,count,c\n" + "\n".join(rows) + "\n")
    return path


@pytest.fixture
def csv_file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    n = 600
    hours = 14102100 + rng.integers(0, 24, n)  # Avazu-like: huge, nearly constant
    counts = np.where(rng.random(n) < 0.1, np.nan, rng.exponential(500.0, n).round())
    labels = (rng.random(n) < 0.2 + 0.02 * (hours - 14102100) / 24).astype(int)
    return _write(tmp_path / "train.csv", hours, counts, labels)


def test_stats_standardise_each_transformed_column(csv_file: Path) -> None:
    schema = csv_schema("y", ["hour", "count"], ["c"], transform={"count": "log1p"})
    fitted = with_numeric_stats(schema, [csv_file])
    dense = torch.cat([b.dense for b in iter_batches(csv_file, fitted, 128)]).double()
    hour, count, count_missing = dense[:, 0], dense[:, 1], dense[:, 3].bool()
    assert abs(hour.mean()) < 1e-6 and abs(hour.std(unbiased=False) - 1) < 1e-3
    present = count[~count_missing]
    assert abs(present.mean()) < 1e-5 and abs(present.std(unbiased=False) - 1) < 1e-3
    assert (count[count_missing] == 0).all()  # missing sits at the mean, with its flag
    # A bounded sample: statistics from the first 100 rows only.
    first = with_numeric_stats(schema, [csv_file], max_rows=100)
    assert first.fields[0].mean != fitted.fields[0].mean


def test_schema_round_trip_keeps_stats_and_old_schemas_load(csv_file: Path,
                                                            tmp_path: Path) -> None:
    schema = with_numeric_stats(csv_schema("y", ["hour", "count"], ["c"]), [csv_file])
    schema.save(tmp_path / "schema.json")
    assert FeatureSchema.load(tmp_path / "schema.json") == schema
    old = schema.to_dict()
    for spec in old["fields"]:
        spec.pop("mean")
        spec.pop("std")
    (tmp_path / "old.json").write_text(json.dumps(old))
    legacy = FeatureSchema.load(tmp_path / "old.json")
    assert all(f.std is None for f in legacy.fields)
    batch = batch_from_records([{"hour": 14102105, "count": 3, "c": "k1"}], legacy)
    assert batch.dense[0, 0] == 14102105.0  # fed as before: untransformed


def test_train_then_serve_applies_the_same_transform(csv_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    assert main(["train", "--train", str(csv_file), "--out", str(out), "--format", "csv",
                 "--label", "y", "--numeric", "hour,count", "--categorical", "c",
                 "--no-progress", "--threads", "1", "--embedding-dim", "4"]) == 0
    saved = FeatureSchema.load(out / "schema.json")
    assert [f.transform for f in saved.numeric] == ["log1p", "log1p"]  # the default
    assert all(f.std is not None for f in saved.numeric)
    file_dense = next(iter(iter_batches(csv_file, saved, 5))).dense
    lines = csv_file.read_text().splitlines()[1:6]
    records = []
    for line in lines:
        _, hour, count, c = line.split(",")
        records.append({"hour": int(hour), "c": c, **({"count": float(count)} if count
                                                      else {})})
    served = request_batch({}, records, saved).dense
    torch.testing.assert_close(served, file_dense)
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= metrics["auc"] <= 1.0 and np.isfinite(metrics["logloss"])
    report = (out / "report" / "report.html").read_text()  # every train writes its report
    assert "terarec train: deepfm on train.csv" in report and "batch size" in report


def test_log1p_list_still_names_the_transformed_columns(csv_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    assert main(["train", "--train", str(csv_file), "--out", str(out), "--format", "csv",
                 "--label", "y", "--numeric", "hour,count", "--categorical", "c",
                 "--log1p", "count", "--no-standardize", "--no-progress", "--threads", "1",
                 "--embedding-dim", "4"]) == 0
    saved = FeatureSchema.load(out / "schema.json")
    assert [(f.transform, f.std) for f in saved.numeric] == [("none", None), ("log1p", None)]
