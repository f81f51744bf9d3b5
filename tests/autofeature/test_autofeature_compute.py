"""Feature tables computed by DuckDB against pure-Python references, for every input format."""

from __future__ import annotations

import dataclasses
import json

import pytest
from autofeature_helpers import (
    CRITEO,
    TRICKY,
    concat,
    criteo_rows,
    num_rows,
    reference_table,
    stored_table,
    write_csv,
    write_parquet,
    write_tsv,
)

from terarec.autofeature import (
    AutoFeatureEngine,
    AutoFeatureError,
    Candidate,
    FeatureTables,
    compute_tables,
    extend_schema,
)
from terarec.data.readers import DataError
from terarec.types import FeatureSchema

CANDIDATES = [
    Candidate("count", ("C1",)),
    Candidate("count", ("C3",)),
    Candidate("count", ("I3",)),  # numeric key
    Candidate("cross_count", ("C1", "C2")),
    *(Candidate("groupby", ("I1", "C2"), agg) for agg in ("max", "min", "avg", "sum")),
    Candidate("groupby", ("I2", "C1"), "avg"),
]


@pytest.fixture(scope="module")
def engine():
    with AutoFeatureEngine(memory_limit="256MB", threads=2) as eng:
        yield eng


@pytest.fixture(scope="module")
def train_rows():
    return criteo_rows(3000, seed=1)


def assert_matches_reference(tables: FeatureTables, rows) -> None:
    for cand in CANDIDATES:
        expected = reference_table(cand, rows)
        got = stored_table(tables, cand.name)
        assert got.keys() == expected.keys(), cand.name
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-12), (cand.name, key)
        table = tables[cand.name]
        assert table.rows == len(expected)
        assert table.value_min == pytest.approx(min(expected.values()))
        assert table.value_max == pytest.approx(max(expected.values()))


@pytest.mark.parametrize("stage_text", [True, False])
def test_criteo_tsv_matches_reference(tmp_path, engine, train_rows, stage_text):
    path = write_tsv(tmp_path / "train.txt", train_rows)
    engine.stage_text = stage_text
    try:
        tables = compute_tables(CANDIDATES, path, CRITEO, tmp_path / "features", engine=engine)
    finally:
        engine.stage_text = True
    assert_matches_reference(tables, train_rows)
    assert tables.train_rows == 3000
    # Empty fields are missing values, and a missing key is counted as a key of its own.
    counts = stored_table(tables, "count(C3)")
    assert counts[(None,)] == sum(v is None for v in train_rows["C3"]) > 0
    assert sum(counts.values()) == 3000
    # Strings that look like numbers stay strings.
    c1 = stored_table(tables, "count(C1)")
    assert {(t,) for t in TRICKY if t in train_rows["C1"]} <= c1.keys()


def test_csv_with_header_and_parquet_give_the_same_tables(tmp_path, engine, train_rows):
    csv_schema = dataclasses.replace(CRITEO, format="csv", delimiter=",", has_header=True,
                                     column_names=())
    parquet_schema = dataclasses.replace(CRITEO, format="parquet")
    for name, schema, path in [
        ("csv", csv_schema, write_csv(tmp_path / "train.csv", train_rows)),
        ("parquet", parquet_schema, write_parquet(tmp_path / "train.parquet", train_rows)),
    ]:
        tables = compute_tables(CANDIDATES, path, schema, tmp_path / name, engine=engine)
        assert_matches_reference(tables, train_rows)


def test_several_files_and_globs_form_one_training_range(tmp_path, engine):
    parts = [criteo_rows(700, seed=s) for s in (11, 12, 13)]
    for i, part in enumerate(parts):
        write_tsv(tmp_path / f"part-{i}.txt", part)
    tables = compute_tables(CANDIDATES, [tmp_path / "part-0.txt", str(tmp_path / "part-[12].txt")],
                            CRITEO, tmp_path / "features", engine=engine)
    assert len(tables.train_paths) == 3
    assert_matches_reference(tables, concat(*parts))


def test_tables_only_hold_training_keys(tmp_path, engine, train_rows):
    valid = criteo_rows(500, seed=2, vocab_scale=3)
    path = write_tsv(tmp_path / "train.txt", train_rows)
    write_tsv(tmp_path / "valid.txt", valid)
    tables = compute_tables(CANDIDATES, path, CRITEO, tmp_path / "features", engine=engine)
    only_valid = set(valid["C3"]) - set(train_rows["C3"])
    assert only_valid, "the validation rows should hold keys training never saw"
    assert not {(k,) for k in only_valid} & stored_table(tables, "count(C3)").keys()


# -- bad input -------------------------------------------------------------------------
def test_empty_training_range_is_an_error(tmp_path, engine):
    cands = CANDIDATES[:1]
    with pytest.raises(AutoFeatureError, match="no paths given"):
        compute_tables(cands, [], CRITEO, tmp_path / "f", engine=engine)
    with pytest.raises(AutoFeatureError, match=r"no file matches .*nothing-\*\.txt"):
        compute_tables(cands, str(tmp_path / "nothing-*.txt"), CRITEO, tmp_path / "f",
                       engine=engine)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        compute_tables(cands, tmp_path / "missing.txt", CRITEO, tmp_path / "f", engine=engine)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(AutoFeatureError, match="empty.txt holds no rows"):
        compute_tables(cands, tmp_path / "empty.txt", CRITEO, tmp_path / "f", engine=engine)


@pytest.mark.parametrize("stage_text", [True, False])
def test_a_malformed_value_names_file_line_and_column(tmp_path, engine, stage_text):
    """DuckDB's error (its own line count, or a long sniffer report for a row with a
    column too many) gives way to the reader's: file, line, field, what is wrong."""
    rows = criteo_rows(5, seed=3)
    rows["I4"][2] = "x7"
    path = write_tsv(tmp_path / "broken.txt", rows)
    cands = [Candidate("groupby", ("I4", "C1"), "max"), Candidate("count", ("C2",))]
    engine.stage_text = stage_text
    try:
        with pytest.raises(DataError) as info:
            compute_tables(cands, path, CRITEO, tmp_path / "f", engine=engine)
    finally:
        engine.stage_text = True
    assert str(info.value).startswith(f"{path}: line 3: field 'I4': ")
    assert "'x7'" in str(info.value)


def test_invalid_candidates_fail_before_reading(tmp_path, engine):
    with pytest.raises(AutoFeatureError, match="unknown column 'C0'"):
        compute_tables([Candidate("count", ("C0",))], tmp_path / "never-read.txt", CRITEO,
                       tmp_path / "f", engine=engine)


def test_unsupported_format_is_named(tmp_path, engine, train_rows):
    path = write_tsv(tmp_path / "train.txt", train_rows)
    schema = dataclasses.replace(CRITEO, format="avro")
    with pytest.raises(AutoFeatureError, match="'avro'"):
        compute_tables(CANDIDATES[:1], path, schema, tmp_path / "f", engine=engine)


# -- manifest ----------------------------------------------------------------------------
def test_save_load_select_and_copy(tmp_path, engine, train_rows):
    path = write_tsv(tmp_path / "train.txt", train_rows)
    tables = compute_tables(CANDIDATES, path, CRITEO, tmp_path / "features", engine=engine)
    loaded = FeatureTables.load(tmp_path / "features")
    assert loaded == tables

    kept = loaded.select(["max(I1)_by(C2)", "count(C3)"])
    assert kept.names == ("count(C3)", "max(I1)_by(C2)")  # computed order is kept
    exported = kept.save(tmp_path / "model" / "features")
    again = FeatureTables.load(tmp_path / "model" / "features")
    assert again == exported and again.names == kept.names
    assert stored_table(again, "count(C3)") == stored_table(tables, "count(C3)")
    assert len(list((tmp_path / "model" / "features").glob("*.parquet"))) == 2

    with pytest.raises(AutoFeatureError, match="unknown feature tables"):
        tables.select(["count(C99)"])


def test_load_rejects_broken_manifests(tmp_path, engine, train_rows):
    path = write_tsv(tmp_path / "train.txt", train_rows)
    tables = compute_tables(CANDIDATES[:2], path, CRITEO, tmp_path / "features", engine=engine)
    manifest = tmp_path / "features" / "manifest.json"
    data = json.loads(manifest.read_text())

    manifest.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(AutoFeatureError, match="version 99"):
        FeatureTables.load(tmp_path / "features")

    manifest.write_text(json.dumps(data))
    tables.path(tables.tables[1]).unlink()
    with pytest.raises(FileNotFoundError, match="count\\(C3\\)"):
        FeatureTables.load(tmp_path / "features")

    with pytest.raises(FileNotFoundError, match="manifest.json missing"):
        FeatureTables.load(tmp_path / "elsewhere")


# -- schema ------------------------------------------------------------------------------
def test_extended_schema_describes_the_new_fields(tmp_path, engine, train_rows):
    path = write_tsv(tmp_path / "train.txt", train_rows)
    tables = compute_tables(CANDIDATES, path, CRITEO, tmp_path / "features", engine=engine)
    schema = extend_schema(CRITEO, tables)
    new = {f.name: f for f in schema.fields[len(CRITEO.fields):]}
    assert list(new) == [c.name for c in CANDIDATES]
    assert schema.format == "parquet"
    assert schema.column_names == CRITEO.column_names + tuple(new)
    assert all(new[c.name].kind == "categorical" for c in CANDIDATES if c.is_count)
    # I1 is log1p-scaled in Criteo; its aggregates over values >= -3 may be negative.
    assert new["min(I1)_by(C2)"].kind == "numeric"
    assert new["min(I1)_by(C2)"].transform == "none"  # min reaches -3: log1p is undefined
    assert FeatureSchema.from_dict(json.loads(json.dumps(schema.to_dict()))) == schema
    with pytest.raises(AutoFeatureError, match="already name columns"):
        extend_schema(schema, tables)


def test_log1p_is_kept_for_non_negative_aggregates(tmp_path, engine):
    rows = criteo_rows(400, seed=5)
    rows["I7"] = [None if v is None else abs(v) for v in rows["I7"]]
    path = write_tsv(tmp_path / "train.txt", rows)
    cands = [Candidate("groupby", ("I7", "C1"), agg) for agg in ("max", "sum")]
    tables = compute_tables(cands, path, CRITEO, tmp_path / "f", engine=engine)
    plain = dataclasses.replace(CRITEO, fields=tuple(
        dataclasses.replace(f, transform="none") for f in CRITEO.fields))
    logged = {f.name: f.transform for f in extend_schema(CRITEO, tables).fields}
    unlogged = {f.name: f.transform for f in extend_schema(plain, tables).fields}
    assert logged["max(I7)_by(C1)"] == "log1p" and logged["sum(I7)_by(C1)"] == "log1p"
    # Without log1p on the source, only the sum (which grows with group size) gets it.
    assert unlogged["max(I7)_by(C1)"] == "none" and unlogged["sum(I7)_by(C1)"] == "log1p"
    assert num_rows(rows) == 400


def test_a_field_missing_from_the_file_is_named(tmp_path, engine):
    path = tmp_path / "clicks.csv"
    path.write_text("label,city\n1,paris\n0,oslo\n")
    schema = FeatureSchema(label="label", format="csv", fields=(
        dataclasses.replace(CRITEO.fields[13], name="city"),
        dataclasses.replace(CRITEO.fields[14], name="device")))
    with pytest.raises(DataError, match=r"clicks\.csv: line 1: field\(s\) \['device' "
                       r"\(categorical\)\] are not among the file's columns "
                       r"\['label', 'city'\]"):
        compute_tables([Candidate("count", ("city",))], path, schema, tmp_path / "f",
                       engine=engine)
