"""Applying feature tables to batches and files: values, defaults, row order, no leakage."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from autofeature_helpers import (
    CRITEO,
    assert_close_with_nulls,
    assert_features,
    concat,
    criteo_rows,
    num_rows,
    reference_feature,
    take,
    to_arrow,
    write_tsv,
)

from terarec.autofeature import (
    AutoFeatureEngine,
    AutoFeatureError,
    Candidate,
    apply,
    apply_file,
    compute_tables,
    extend_schema,
)

CANDIDATES = [
    Candidate("count", ("C1",)),
    Candidate("count", ("C3",)),
    Candidate("count", ("I3",)),
    Candidate("cross_count", ("C1", "C2")),
    Candidate("cross_count", ("C2", "I5")),
    Candidate("groupby", ("I1", "C3"), "max"),
    Candidate("groupby", ("I1", "C3"), "avg"),
    Candidate("groupby", ("I2", "C1"), "sum"),
    Candidate("groupby", ("I4", "C2"), "min"),
]


@pytest.fixture(scope="module")
def engine():
    # Few joins per query, so that applying CANDIDATES takes several rounds.
    with AutoFeatureEngine(memory_limit="256MB", threads=2, joins_per_query=4) as eng:
        yield eng


@pytest.fixture(scope="module")
def train():
    return criteo_rows(3000, seed=1)


@pytest.fixture(scope="module")
def valid():
    # A larger vocabulary: many validation keys were never seen in training.
    return criteo_rows(6000, seed=2, vocab_scale=4)


@pytest.fixture(scope="module")
def tables(tmp_path_factory, engine, train):
    root = tmp_path_factory.mktemp("apply")
    return compute_tables(CANDIDATES, write_tsv(root / "train.txt", train), CRITEO,
                          root / "features", engine=engine)


def test_apply_matches_reference_and_keeps_rows(engine, tables, train, valid):
    batch = to_arrow(valid)
    out = apply(tables, batch, engine=engine)
    assert out.num_rows == batch.num_rows
    assert out.column_names == batch.column_names + [c.name for c in CANDIDATES]
    assert out.select(batch.column_names).equals(batch)  # source columns untouched
    assert out.schema.field("count(C3)").type == pa.string()
    assert out.schema.field("avg(I1)_by(C3)").type == pa.float64()
    assert_features(out, CANDIDATES, train, valid)


def test_row_order_follows_the_batch(engine, tables, train, valid):
    order = np.random.default_rng(7).permutation(num_rows(valid))
    shuffled = take(valid, order)
    out = apply(tables, to_arrow(shuffled), engine=engine)
    assert out.column("C3").to_pylist() == shuffled["C3"]
    assert_features(out, CANDIDATES, train, shuffled)


def test_row_order_holds_when_tables_outgrow_the_batch(tmp_path, engine):
    """A batch smaller than a table becomes the join's build side, and rows then come out in
    the table's order unless they are put back in the batch's."""
    train = criteo_rows(4000, seed=3, vocab_scale=60)
    cands = [Candidate("count", ("C3",)), Candidate("groupby", ("I1", "C3"), "avg")]
    tables = compute_tables(cands, write_tsv(tmp_path / "train.txt", train), CRITEO,
                            tmp_path / "features", engine=engine)
    assert tables["count(C3)"].rows > 300
    rows = take(train, np.random.default_rng(8).permutation(4000)[:150])
    out = apply(tables, to_arrow(rows), engine=engine)
    assert out.column("count(C3)").to_pylist() == reference_feature(cands[0], train, rows)
    assert_close_with_nulls(out.column("avg(I1)_by(C3)").to_pylist(),
                            reference_feature(cands[1], train, rows))
    written = pq.read_table(apply_file(tables, write_tsv(tmp_path / "rows.txt", rows), CRITEO,
                                       tmp_path / "rows.parquet", engine=engine))
    assert written.column("C3").to_pylist() == rows["C3"]
    assert written.column("count(C3)").to_pylist() == reference_feature(cands[0], train, rows)


def test_no_leakage_unseen_keys_get_defaults(engine, tables, train, valid):
    out = apply(tables, to_arrow(valid), engine=engine)
    seen = set(train["C3"])
    unseen = [i for i, k in enumerate(valid["C3"]) if k not in seen]
    assert len(unseen) > 100
    counts = out.column("count(C3)").to_pylist()
    maxima = out.column("max(I1)_by(C3)").to_pylist()
    assert {counts[i] for i in unseen} == {"0"}
    assert {maxima[i] for i in unseen} == {None}
    # Counts come from the training rows alone: counting validation rows too would change
    # them for keys present in both.
    leaked = reference_feature(CANDIDATES[1], concat(train, valid), valid)
    assert counts != leaked


def test_missing_keys_join_the_missing_group(engine, tables, train):
    rows = criteo_rows(50, seed=9)
    rows["C3"] = [None] * 50
    out = apply(tables, to_arrow(rows), engine=engine)
    n_missing = sum(v is None for v in train["C3"])
    assert n_missing > 0
    assert set(out.column("count(C3)").to_pylist()) == {str((n_missing + 1).bit_length() - 1)}


def test_numeric_keys_may_arrive_as_text(engine, tables, train, valid):
    """A serving request carries raw strings: "5" must find the key 5, "" is missing."""
    batch = to_arrow(valid)
    as_text = pa.array(["" if v is None else str(v) for v in valid["I3"]], pa.string())
    text_batch = batch.set_column(batch.column_names.index("I3"), "I3", as_text)
    one = tables.select(["count(I3)", "cross_count(C2,I5)"])
    expected = apply(one, batch, engine=engine)
    got = apply(one, text_batch, engine=engine)
    assert got.column("count(I3)").equals(expected.column("count(I3)"))
    assert got.column("cross_count(C2,I5)").equals(expected.column("cross_count(C2,I5)"))


def test_small_and_empty_batches(engine, tables, train, valid):
    one_row = take(valid, [17])
    out = apply(tables, to_arrow(one_row), engine=engine)
    assert out.num_rows == 1
    assert_features(out, CANDIDATES, train, one_row)
    empty = apply(tables, to_arrow(valid).slice(0, 0), engine=engine)
    assert empty.num_rows == 0
    assert empty.column_names[-len(CANDIDATES):] == [c.name for c in CANDIDATES]


def test_apply_errors_name_the_problem(engine, tables, valid):
    batch = to_arrow(valid).drop_columns(["C2"])
    with pytest.raises(AutoFeatureError, match="needs column 'C2'"):
        apply(tables, batch, engine=engine)
    applied = apply(tables.select(["count(C1)"]), to_arrow(valid), engine=engine)
    with pytest.raises(AutoFeatureError, match=r"already have columns named \['count\(C1\)'\]"):
        apply(tables, applied, engine=engine)
    with pytest.raises(AutoFeatureError, match="no feature tables"):
        apply(tables.select([]), to_arrow(valid), engine=engine)


def test_apply_file_writes_the_augmented_rows_in_order(tmp_path, engine, tables, train, valid):
    path = write_tsv(tmp_path / "valid.txt", valid)
    out_path = apply_file(tables, path, CRITEO, tmp_path / "out" / "valid.parquet",
                          engine=engine)
    written = pq.read_table(out_path)
    schema = extend_schema(CRITEO, tables)
    assert written.column_names == list(schema.column_names)
    assert written.num_rows == num_rows(valid)
    for name in CRITEO.column_names:  # raw columns, in file order
        assert written.column(name).to_pylist() == valid[name], name
    assert_features(written, CANDIDATES, train, valid)
    # The same values as the in-memory path.
    in_memory = apply(tables, to_arrow(valid), engine=engine)
    for cand in CANDIDATES:
        assert written.column(cand.name).to_pylist() == in_memory.column(cand.name).to_pylist()
    assert not list((tmp_path / "out").glob(".*"))  # no temp files left behind


def test_apply_file_in_one_round_equals_several(tmp_path, tables, valid):
    path = write_tsv(tmp_path / "valid.txt", valid)
    results = []
    for joins in (2, 64):
        with AutoFeatureEngine(memory_limit="256MB", threads=2, joins_per_query=joins) as eng:
            results.append(pq.read_table(
                apply_file(tables, path, CRITEO, tmp_path / f"out-{joins}.parquet", engine=eng)))
            assert not list(eng.scratch_dir().iterdir())  # intermediate rounds removed
    # Values and types agree; DuckDB may mark columns it proves non-null as required.
    assert [(f.name, f.type) for f in results[0].schema] == \
        [(f.name, f.type) for f in results[1].schema]
    assert results[0].to_pydict() == results[1].to_pydict()


def test_tables_loaded_once_are_refreshed_when_rewritten(tmp_path, engine):
    first, second = criteo_rows(300, seed=21), criteo_rows(300, seed=22)
    cands = [Candidate("count", ("C2",))]
    probe = to_arrow(first)
    t1 = compute_tables(cands, write_tsv(tmp_path / "a.txt", first), CRITEO, tmp_path / "f",
                        engine=engine)
    assert apply(t1, probe, engine=engine).column("count(C2)").to_pylist() == \
        reference_feature(cands[0], first, first)
    t2 = compute_tables(cands, write_tsv(tmp_path / "b.txt", second), CRITEO, tmp_path / "f",
                        engine=engine)
    assert apply(t2, probe, engine=engine).column("count(C2)").to_pylist() == \
        reference_feature(cands[0], second, first)
