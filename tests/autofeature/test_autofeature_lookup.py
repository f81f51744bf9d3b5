"""The in-memory lookup path gives exactly what the SQL ``apply`` gives."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from autofeature_helpers import (
    CRITEO,
    assert_features,
    criteo_rows,
    take,
    to_arrow,
    write_tsv,
)

from terarec.autofeature import AutoFeatureEngine, AutoFeatureError, Candidate, apply
from terarec.autofeature import compute_tables as compute
from terarec.autofeature.lookup import FeatureLookup, count_buckets

CANDIDATES = [
    Candidate("count", ("C1",)),           # C1 holds "007", "0e10": strings, not numbers
    Candidate("count", ("C3",)),
    Candidate("count", ("I3",)),           # a numeric key
    Candidate("cross_count", ("C1", "C2")),
    Candidate("cross_count", ("C2", "I5")),
    Candidate("groupby", ("I1", "C3"), "max"),
    Candidate("groupby", ("I1", "C3"), "avg"),
    Candidate("groupby", ("I2", "C1"), "sum"),
]


@pytest.fixture(scope="module")
def engine():
    with AutoFeatureEngine(memory_limit="256MB", threads=2) as eng:
        yield eng


@pytest.fixture(scope="module")
def train():
    return criteo_rows(3000, seed=11)


@pytest.fixture(scope="module")
def tables(tmp_path_factory, engine, train):
    root = tmp_path_factory.mktemp("lookup")
    return compute(CANDIDATES, write_tsv(root / "train.txt", train), CRITEO,
                   root / "features", engine=engine)


@pytest.fixture(scope="module")
def lookup(tables):
    return FeatureLookup(tables)


def test_lookup_equals_sql_apply_on_seen_unseen_and_missing_keys(engine, tables, lookup):
    # A larger vocabulary: many keys unseen in training; missing values in every column.
    rows = criteo_rows(2000, seed=12, vocab_scale=3, missing=0.2)
    batch = to_arrow(rows)
    fast = lookup.apply(batch)
    assert fast.equals(apply(tables, batch, engine=engine))
    counts = fast.column("count(C3)").to_pylist()
    assert "0" in counts and len(set(counts)) > 3
    assert None in fast.column("max(I1)_by(C3)").to_pylist()


def test_lookup_matches_the_plain_python_reference(lookup, train):
    rows = take(train, np.arange(0, 3000, 7))
    assert_features(lookup.apply(to_arrow(rows)), CANDIDATES, train, rows)


def test_one_row_and_column_order_do_not_matter(engine, tables, lookup, train):
    rows = to_arrow(take(train, [5]))
    reordered = rows.select(list(reversed(rows.column_names)))
    assert lookup.apply(reordered).equals(apply(tables, reordered, engine=engine))


def test_text_keys_convert_like_sql(engine, tables, lookup, train):
    """Numeric keys sent as text (trimmed, "" missing) and categorical keys sent as
    integers match what the SQL path makes of them."""
    rows = take(train, range(40))
    batch = to_arrow(rows)
    texts = [None if v is None else f" {v} " for v in rows["I3"]]
    texts[:3] = ["", " ", None]
    as_text = batch.set_column(batch.column_names.index("I3"), "I3", pa.array(texts))
    ints = pa.array([i % 5 for i in range(40)], pa.int64())
    as_int = as_text.set_column(batch.column_names.index("C2"), "C2", ints)
    assert lookup.apply(as_int).equals(apply(tables, as_int, engine=engine))


def test_records_get_the_features_of_the_same_rows_in_a_file(lookup, train):
    rows = take(train, range(30))
    records = [{c: rows[c][i] for c in rows} for i in range(30)]
    records[0]["C3"] = ""          # an empty cell reads as missing, as in a file
    records[1]["C3"] = "never-seen"
    records[2]["I3"] = str(records[2]["I3"]) if records[2]["I3"] is not None else "4"
    expected = {k: list(v) for k, v in rows.items()}
    expected["C3"][0], expected["C3"][1] = None, "never-seen"
    expected["I3"][2] = int(records[2]["I3"])
    out = lookup.apply_records(records)
    want = lookup.apply(to_arrow(expected))
    for name in lookup.names:
        assert [r[name] for r in out] == want.column(name).to_pylist(), name
    assert out[1]["count(C3)"] == "0" and out[1]["max(I1)_by(C3)"] is None
    assert out[5]["C7"] == records[5]["C7"]  # the raw values stay


def test_count_buckets_are_exact_at_powers_of_two():
    counts = np.array([0, 1, 2, 3, 6, 7, 8, 2**40 - 2, 2**40 - 1])
    assert count_buckets(counts).to_pylist() == [
        str((int(c) + 1).bit_length() - 1) for c in counts]


def test_lookup_errors_name_the_problem(tables, lookup, tmp_path):
    batch = to_arrow(criteo_rows(5, seed=1)).drop_columns(["C3"])
    with pytest.raises(AutoFeatureError, match=r"count\(C3\) needs column 'C3'"):
        lookup.apply(batch)
    full = to_arrow(criteo_rows(5, seed=1))
    with pytest.raises(AutoFeatureError, match="already have columns"):
        lookup.apply(lookup.apply(full))
    floats = full.set_column(full.column_names.index("C1"), "C1",
                             pa.array([1.5] * 5, pa.float64()))
    with pytest.raises(AutoFeatureError, match="'C1' has type double"):
        lookup.apply(floats)
    assert pq.read_table(tables.path(tables["count(C1)"])).num_rows > 0
