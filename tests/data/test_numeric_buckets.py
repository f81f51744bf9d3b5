"""Buckets of numeric columns (quantile; log-square for integer columns on request): edges
from the stats pass, saved in the schema, fed as one categorical key per row by training,
predict and the server alike."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from terarec.cli.main import main
from terarec.data.numeric import (
    MAX_BUCKETS,
    ROWS_PER_BUCKET,
    bucket_edges,
    bucket_index,
    log_or_tested_edges,
    log_square_edges,
    transform_values,
    with_numeric_stats,
)
from terarec.data.readers import batch_from_records, csv_schema, iter_batches
from terarec.serving.engine import ServingEngine
from terarec.serving.features import request_batch
from terarec.types import FeatureSchema
from terarec.validation import InvalidInput


@pytest.mark.parametrize("transform", ["log1p", "none"])
def test_log_square_edges_cut_integers_as_the_formula_does(transform: str) -> None:
    rng = np.random.default_rng(0)
    counts = np.minimum(rng.zipf(1.3, 5000) - 1, 10 ** 5)  # 148 edges: none thinned
    x = np.concatenate([rng.integers(-50, 50, 2000), counts, [10 ** 5]]).astype(np.float64)
    t = transform_values(x, transform)
    edges = log_square_edges(t, transform)
    assert edges is not None and list(edges) == sorted(set(edges))
    ours = bucket_index(t, edges)
    formula = np.sign(x) * np.floor(np.log1p(np.abs(x)) ** 2)
    # The same partition of the values: each formula bucket is one of ours and back.
    pairs = np.unique(np.stack([ours, formula]), axis=1)
    assert pairs.shape[1] == len(np.unique(ours)) == len(np.unique(formula))
    assert len(np.unique(formula[np.abs(x) <= 1])) == 1  # 0 and +-1 share a bucket
    assert len(np.unique(ours[(x >= 4) & (x <= 5)])) == 2  # 4 and 5 do not
    # A range too wide for MAX_BUCKETS is thinned evenly, not cut off.
    wide = transform_values(np.array([-3e38, 0.0, 3e38]), transform)
    thinned = log_square_edges(wide, transform)
    assert thinned is not None and len(thinned) == MAX_BUCKETS - 1
    assert thinned[0] < 0 < thinned[-1]
    assert log_square_edges(transform_values(np.array([0.0, 1.0]), transform),
                            transform) is None  # one bucket: nothing to cut


def test_integer_columns_get_log_square_buckets_and_others_the_tested_ones() -> None:
    rng = np.random.default_rng(1)
    counts = np.floor(np.exp(rng.normal(2, 1.5, 5000)))
    t = transform_values(counts, "log1p")
    no_effect = (rng.random(5000) < 0.3).astype(np.float64)
    # No test for counts: they are cut whatever the label does.
    assert log_or_tested_edges(t, no_effect, "log1p") == log_square_edges(t, "log1p")
    floats = t + rng.uniform(0.01, 0.99, 5000)
    assert log_or_tested_edges(floats, no_effect, "log1p") is None  # tested, and linear
    window = (np.abs(floats - 2.5) < 0.5).astype(np.float64)
    assert log_or_tested_edges(floats, window, "log1p") is not None


def test_buckets_only_where_the_label_departs_from_a_linear_effect() -> None:
    from terarec.data.numeric import departs_from_linear

    rng = np.random.default_rng(3)
    t = rng.normal(size=20_000)
    edges = bucket_edges(t)
    linear = (rng.random(len(t)) < 1 / (1 + np.exp(-(-1.2 + 0.8 * t)))).astype(float)
    window = (rng.random(len(t)) < np.where(np.abs(t) < 0.5, 0.35, 0.2)).astype(float)
    assert not departs_from_linear(t, linear, edges)
    assert departs_from_linear(t, window, edges)


def test_coarser_buckets_see_a_curve_the_sized_ones_spread_too_thin() -> None:
    """On few rows a smooth curve spread over the data-sized count of buckets has too few
    rows per bucket to show; the test also tries half as many, sharing its p between the
    two counts, so a linear column stays unbucketed about as often as before."""
    from terarec.data.numeric import COARSE_FACTOR, departs_from_linear, tested_edges

    rng = np.random.default_rng(7)
    sized_found = tested_found = false_found = 0
    for _ in range(60):
        t = rng.normal(size=4000)
        curved = (rng.random(len(t)) < 1 / (1 + np.exp(1.4 - 0.15 * t * t))).astype(float)
        linear = (rng.random(len(t)) < 1 / (1 + np.exp(1.4 - 0.5 * t))).astype(float)
        sized = bucket_edges(t)
        sized_found += departs_from_linear(t, curved, sized)
        edges = tested_edges(t, curved)
        if edges is not None:
            tested_found += 1
            assert edges in (sized, bucket_edges(t, (len(t) // ROWS_PER_BUCKET) // COARSE_FACTOR))
        false_found += tested_edges(t, linear) is not None
    assert tested_found > sized_found + 3
    assert false_found <= 3


def test_edges_give_a_point_mass_its_own_bucket_and_follow_the_data_size() -> None:
    rng = np.random.default_rng(0)
    values = np.where(rng.random(5000) < 0.7, 0.0, rng.exponential(3.0, 5000))
    edges = np.array(bucket_edges(values))
    assert len(edges) >= 2 and np.all(np.diff(edges) > 0)
    assert edges[0] > 0.0  # 0 (70% of the values) and anything below share bucket 0
    assert len(edges) + 1 <= len(values) // ROWS_PER_BUCKET
    index = np.searchsorted(edges, values, side="right")
    assert (index[values == 0.0] == 0).all() and (index[values > edges[0]] > 0).all()
    assert len(bucket_edges(rng.normal(size=10 ** 6))) + 1 == MAX_BUCKETS
    assert bucket_edges(values[:150]) is None  # too few values for two buckets
    assert bucket_edges(np.ones(1000)) is None  # a constant has nothing to cut
    assert len(bucket_edges(values, 4)) <= 3


def _planted(path: Path, n: int, seed: int) -> Path:
    """A label that depends on ``x`` through a window (not monotone), plus a weak
    categorical and a plain second numeric column."""
    rng = np.random.default_rng(seed)
    x = rng.exponential(100.0, n).round()
    z = rng.normal(size=n)
    c = rng.integers(0, 5, n)
    p = np.where((x > 40) & (x < 120), 0.6, 0.15) + 0.02 * c
    y = (rng.random(n) < p).astype(int)
    lines = [f"{yi},{'' if i % 17 == 0 else int(xi)},{zi:.4f},k{ci}"
             for i, (yi, xi, zi, ci) in enumerate(zip(y, x, z, c, strict=True))]
    path.write_text("y,x,z,c\n" + "\n".join(lines) + "\n")
    return path


def test_schema_keys_and_round_trip(tmp_path: Path) -> None:
    data = _planted(tmp_path / "train.csv", 3000, 0)
    # Tested: x (a window) departs from a linear effect and gets buckets, z (no effect
    # at all) does not.
    sized = with_numeric_stats(csv_schema("y", ["x", "z"], ["c"]), [data], buckets="tested")
    assert sized.numeric[0].buckets is not None and sized.numeric[1].buckets is None
    assert sized.sparse_names == ("c", "x")
    schema = with_numeric_stats(csv_schema("y", ["x", "z"], ["c"]), [data], buckets=64)
    x, z = schema.numeric
    assert x.buckets is not None and z.buckets is not None
    assert schema.sparse_names == ("c", "x", "z")  # categorical first, then bucketed
    assert with_numeric_stats(csv_schema("y", ["x", "z"], ["c"]), [data],
                              buckets=0).sparse_names == ("c",)
    # "log" (the default): the integer column x is cut at the log-square edges,
    # untested; z (fractions, no effect) stays tested and gets none.
    logged = with_numeric_stats(csv_schema("y", ["x", "z"], ["c"]), [data], buckets="log")
    assert with_numeric_stats(csv_schema("y", ["x", "z"], ["c"]), [data]) == logged
    x_log, z_log = logged.numeric
    assert z_log.buckets is None and x_log.buckets is not None
    assert x_log.buckets != sized.numeric[0].buckets
    raw = np.array(x_log.buckets) if x_log.transform == "none" else np.expm1(x_log.buckets)
    k = np.log1p(raw) ** 2  # the edges sit at log1p(x) = sqrt(k)
    assert np.allclose(k, np.round(k)) and np.all(np.diff(np.round(k)) == 1)
    schema.save(tmp_path / "schema.json")
    assert FeatureSchema.load(tmp_path / "schema.json") == schema

    batch = next(iter(iter_batches(data, schema, 3000)))
    assert batch.sparse.fields == ("c", "x", "z") and batch.sparse.one_per_slot
    keys = batch.sparse.field_values("x").numpy()
    raw = np.genfromtxt(data, delimiter=",", skip_header=1, usecols=1)
    t = transform_values(raw, x.transform)
    index = np.searchsorted(np.array(x.buckets), t, side="right")
    for b in np.unique(index[~np.isnan(raw)])[:10]:  # one key per bucket, and only one
        assert len(np.unique(keys[(index == b) & ~np.isnan(raw)])) == 1
    present = ~np.isnan(raw)
    assert len(np.unique(keys[present])) == len(np.unique(index[present]))
    missing = np.unique(keys[~present])
    assert len(missing) == 1 and missing[0] not in set(keys[present].tolist())
    # A request builds the same keys as the file, the value in the context or not.
    records = [{"x": None if np.isnan(v) else int(v), "z": 0.5, "c": "k1"} for v in raw[:40]]
    from_file = batch_from_records(records, schema).sparse.field_values("x")
    assert np.array_equal(from_file.numpy()[present[:40]], keys[:40][present[:40]])
    context = {"x": records[0]["x"]}  # a bucketed field in the shared context
    candidates = [{k: v for k, v in r.items() if k != "x"} for r in records]
    merged = [{**context, **c} for c in candidates]
    assert np.array_equal(request_batch(context, candidates, schema).sparse.values.numpy(),
                          batch_from_records(merged, schema).sparse.values.numpy())


@pytest.mark.parametrize(("spec", "message"), [
    ({"buckets": [1.0, 1.0]}, "fields[0].buckets: expected a non-empty list of strictly"),
    ({"buckets": []}, "fields[0].buckets"),
    ({"buckets": [0.5], "kind": "categorical"}, "fields[0].buckets: only numeric"),
])
def test_bad_bucket_edges_are_refused_naming_the_field(spec: dict, message: str) -> None:
    d = csv_schema("y", ["x"], ["c"]).to_dict()
    d["fields"][0].update(spec)
    with pytest.raises(InvalidInput, match=message.replace("[", r"\[").replace("]", r"\]")):
        FeatureSchema.from_dict(d, "schema.json")


def _train(train: Path, valid: Path, out: Path, *extra: str) -> dict:
    assert main(["train", "--train", str(train), "--valid", str(valid), "--out", str(out),
                 "--format", "csv", "--label", "y", "--numeric", "x,z", "--categorical", "c",
                 "--model", "lr", "--batch-size", "256", "--sparse-lr", "0.05", "--epochs", "8",
                 "--no-progress", "--threads", "1", *extra]) == 0
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.slow
def test_buckets_learn_a_window_and_serve_like_predict(tmp_path: Path) -> None:
    train = _planted(tmp_path / "train.csv", 4000, 1)
    valid = _planted(tmp_path / "valid.csv", 1500, 2)
    plain = _train(train, valid, tmp_path / "plain", "--numeric-buckets", "0")
    bucketed = _train(train, valid, tmp_path / "bucketed")
    # A linear term in log(x) cannot express the window; a weight per bucket can.
    assert bucketed["auc"] > plain["auc"] + 0.05

    model = tmp_path / "bucketed"
    scores = tmp_path / "scores.txt"
    assert main(["predict", "--model", str(model), "--data", str(valid),
                 "--out", str(scores)]) == 0
    offline = np.loadtxt(scores)
    assert main(["export", "--model", str(model), "--out", str(tmp_path / "export")]) == 0
    engine = ServingEngine(tmp_path / "export")
    try:
        assert engine.refresh()
        lines = valid.read_text().splitlines()[1:]
        records = []
        for line in lines:
            _, x, z, c = line.split(",")
            records.append({"c": c, "z": float(z), **({"x": int(x)} if x else {})})
        served, _ = engine.score_records(records)
        np.testing.assert_allclose(served, offline, rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


def test_log_buckets_from_the_command_line(tmp_path: Path, capsys) -> None:
    train = _planted(tmp_path / "train.csv", 3000, 1)
    valid = _planted(tmp_path / "valid.csv", 1000, 2)
    _train(train, valid, tmp_path / "log", "--numeric-buckets", "log")
    x, z = FeatureSchema.load(tmp_path / "log" / "schema.json").numeric
    assert x.buckets is not None and z.buckets is None
    _train(train, valid, tmp_path / "tested", "--numeric-buckets", "tested")
    tested = FeatureSchema.load(tmp_path / "tested" / "schema.json").numeric
    assert tested[0].buckets is not None and tested[0].buckets != x.buckets
    capsys.readouterr()
    with pytest.raises(SystemExit):
        _train(train, valid, tmp_path / "bad", "--numeric-buckets", "logs")
    assert "--numeric-buckets: 'logs': expected a bucket count, 'log' or 'tested'" in \
        capsys.readouterr().err


def test_two_tower_puts_bucketed_numerics_on_the_user_side() -> None:
    from dataclasses import replace

    from terarec.config import ModelConfig
    from terarec.models.dssm import DSSM

    schema = csv_schema("y", ["age", "price"], ["user", "item"])
    age, price, *cats = schema.fields
    schema = replace(schema, fields=(replace(age, buckets=(1.0, 2.0)),
                                     replace(price, buckets=(3.0,)), *cats))
    model = DSSM(schema, ModelConfig(name="dssm", user_fields=("user",), embedding_dim=4,
                                     deep_mlp=(8,)))
    assert model.user_fields == ("user", "age", "price") and model.item_fields == ("item",)
    named = DSSM(schema, ModelConfig(name="dssm", user_fields=("user",),
                                     item_fields=("item", "price"), embedding_dim=4,
                                     deep_mlp=(8,)))
    assert named.user_fields == ("user", "age") and named.item_fields == ("item", "price")
