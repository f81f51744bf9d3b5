"""Streaming readers: Criteo TSV, CSV with multi-valued cells, Parquet lists, bad input."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from terarec.data import readers
from terarec.data.hashing import hash_column, hash_values, missing_key
from terarec.data.readers import (
    DataError,
    ReadStats,
    batch_from_records,
    csv_schema,
    iter_batches,
    parquet_schema,
)
from terarec.types import Batch, FeatureSchema

CRITEO = FeatureSchema.criteo()
SALT = CRITEO.hash_salt


def criteo_row(label: str, ints: list[str], cats: list[str]) -> str:
    assert len(ints) == 13 and len(cats) == 26
    return "\t".join([label, *ints, *cats])


def sample_rows(n: int) -> list[list[str]]:
    rng = np.random.default_rng(7)
    rows = []
    for i in range(n):
        ints = [str(int(v)) for v in rng.integers(-3, 500, 13)]
        cats = [f"{int(v):08x}" for v in rng.integers(0, 40, 26)]
        if i % 3 == 0:
            ints[0] = ""            # missing count
            cats[5] = ""            # missing categorical
        rows.append([str(i % 2), *ints, *cats])
    return rows


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture
def criteo_file(tmp_path: Path) -> tuple[Path, list[list[str]]]:
    rows = sample_rows(7)
    return write_lines(tmp_path / "day0.txt", ["\t".join(r) for r in rows]), rows


def expected_dense(rows: list[list[str]]) -> np.ndarray:
    out = np.zeros((len(rows), 26), dtype=np.float32)
    for i, r in enumerate(rows):
        for j, v in enumerate(r[1:14]):
            if v == "":
                out[i, 13 + j] = 1.0
            else:
                x = float(v)
                out[i, j] = math.copysign(math.log1p(abs(x)), x)
    return out


def test_criteo_values_flags_keys_and_layout(criteo_file):
    path, rows = criteo_file
    batches = list(iter_batches(path, CRITEO, batch_size=3))
    assert [len(b) for b in batches] == [3, 3, 1]
    batch = Batch.concat(batches)
    assert batch.labels.dtype == torch.float32
    assert batch.labels.tolist() == [float(r[0]) for r in rows]
    assert batch.dense.shape == (7, CRITEO.dense_dim)
    np.testing.assert_allclose(batch.dense.numpy(), expected_dense(rows), rtol=1e-6)
    sparse = batches[0].sparse
    assert sparse.fields == CRITEO.sparse_names
    assert sparse.one_per_slot
    assert torch.equal(sparse.offsets, torch.arange(26 * 3 + 1))
    for f, name in enumerate(CRITEO.sparse_names):
        raw = pa.array([r[14 + f] for r in rows[:3]])
        assert np.array_equal(sparse.field_values(name).numpy(), hash_column(name, raw, SALT))
    # an empty categorical cell is the field's missing key, still one key in its slot
    assert int(sparse.field_values("C6")[0]) == missing_key("C6", SALT)


def test_batches_do_not_depend_on_batch_size(criteo_file):
    path, _ = criteo_file
    whole = next(iter_batches(path, CRITEO, batch_size=100))
    parts = Batch.concat(list(iter_batches(path, CRITEO, batch_size=2)))
    assert torch.equal(whole.dense, parts.dense)
    assert torch.equal(whole.sparse.values, parts.sparse.values)
    assert torch.equal(whole.sparse.offsets, parts.sparse.offsets)


def test_stream_spans_many_parser_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "_BLOCK_BYTES", 1024)  # ~3 rows per pyarrow block
    rows = sample_rows(50)
    rows[37][3] = "oops"
    path = write_lines(tmp_path / "big.txt", ["\t".join(r) for r in rows])
    with pytest.raises(DataError, match=r"big\.txt: line 38: field 'I3'"):
        list(iter_batches(path, CRITEO, batch_size=8))
    stats = ReadStats()
    got = Batch.concat(list(iter_batches(path, CRITEO, 8, on_bad_row="skip", stats=stats)))
    assert (stats.rows, stats.skipped) == (49, 1)
    keep = rows[:37] + rows[38:]
    np.testing.assert_allclose(got.dense.numpy(), expected_dense(keep), rtol=1e-6)


def test_no_missing_flags_means_values_only(criteo_file):
    path, rows = criteo_file
    schema = FeatureSchema.criteo(missing_flags=False)
    batch = next(iter_batches(path, schema, batch_size=10))
    assert batch.dense.shape == (7, 13)
    np.testing.assert_allclose(batch.dense.numpy(), expected_dense(rows)[:, :13], rtol=1e-6)


# -- CSV ------------------------------------------------------------------------------------

def test_csv_header_and_multi_valued_cells(tmp_path):
    path = write_lines(tmp_path / "events.csv", [
        "id,tags,price,click,user",
        "1,a|b,3.5,1,u1",
        "2,,-2,0,",
        "3,c||a,,1,u2",
        '4,"d",1e3,0,u1',
    ])
    schema = csv_schema("click", ["price"], ["user", "tags"], separator="|",
                        multi_valued=["tags"], transform="log1p")
    batch = next(iter_batches(path, schema, batch_size=10))
    assert batch.labels.tolist() == [1, 0, 1, 0]
    price = [3.5, -2.0, None, 1000.0]
    want = [0.0 if p is None else math.copysign(math.log1p(abs(p)), p) for p in price]
    np.testing.assert_allclose(batch.dense[:, 0].numpy(), want, rtol=1e-6)
    assert batch.dense[:, 1].tolist() == [0, 0, 1, 0]
    sparse = batch.sparse
    assert sparse.fields == ("user", "tags")
    # user: single-valued, the empty cell is the missing key; tags: 2, 0, 2, 1 keys
    assert sparse.lengths.tolist() == [1, 1, 1, 1, 2, 0, 2, 1]
    assert np.array_equal(sparse.field_values("user").numpy(),
                          hash_values("user", ["u1", None, "u2", "u1"], SALT))
    assert np.array_equal(sparse.field_values("tags").numpy(),
                          hash_values("tags", ["a", "b", "c", "a", "d"], SALT))


def test_csv_without_header_uses_column_names(tmp_path):
    path = write_lines(tmp_path / "raw.tsv", ["x\t1\t7", "y\t0\t"])
    schema = csv_schema("y", ["n"], ["c"], delimiter="\t", has_header=False,
                        column_names=["c", "y", "n"])
    batch = next(iter_batches(path, schema, batch_size=4))
    assert batch.labels.tolist() == [1, 0]
    assert batch.dense.tolist() == [[7.0, 0.0], [0.0, 1.0]]


def test_csv_schema_rejects_inconsistent_declarations():
    with pytest.raises(ValueError, match="twice"):
        csv_schema("y", ["a"], ["a"])
    with pytest.raises(ValueError, match="not categorical"):
        csv_schema("y", ["a"], ["b"], multi_valued=["a"])
    with pytest.raises(ValueError, match="separator"):
        csv_schema("y", [], ["b"], separator=",")
    with pytest.raises(ValueError, match="transform"):
        csv_schema("y", ["a"], [], transform="sqrt")


# -- Parquet --------------------------------------------------------------------------------

def test_parquet_lists_match_the_same_data_as_csv(tmp_path):
    table = pa.table({
        "click": pa.array([1, 0, 0], pa.int8()),
        "genres": pa.array([["7", "3"], [], None], pa.list_(pa.string())),
        "items": pa.array([[1, 2], [5], [None, 9]], pa.list_(pa.int64())),
        "city": pa.array([12, None, 40], pa.int32()),
        "age": pa.array([31.0, float("nan"), None]),
    })
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    schema = parquet_schema("click", ["age"], ["city", "genres", "items"],
                            multi_valued=["genres", "items"])
    batch = Batch.concat(list(iter_batches(tmp_path / "t.parquet", schema, batch_size=2)))
    assert batch.labels.tolist() == [1, 0, 0]
    assert batch.dense.tolist() == [[31.0, 0.0], [0.0, 1.0], [0.0, 1.0]]
    write_lines(tmp_path / "t.csv", ["click,genres,items,city,age",
                                     "1,7|3,1|2,12,31", "0,,5,,", "0,,9,40,"])
    as_csv = next(iter_batches(tmp_path / "t.csv", csv_schema(
        "click", ["age"], ["city", "genres", "items"], multi_valued=["genres", "items"]), 8))
    assert torch.equal(batch.sparse.values, as_csv.sparse.values)
    assert torch.equal(batch.sparse.offsets, as_csv.sparse.offsets)
    assert torch.equal(batch.dense, as_csv.dense)


def test_parquet_dictionary_strings_and_bad_types(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"y": [1, 0], "c": pa.array(["a", "b"]).dictionary_encode()}),
                   path)
    batch = next(iter_batches(path, parquet_schema("y", [], ["c"]), 4))
    assert np.array_equal(batch.sparse.values.numpy(), hash_values("c", ["a", "b"], SALT))

    pq.write_table(pa.table({"y": [1], "c": pa.array([["a"]])}), tmp_path / "l.parquet")
    with pytest.raises(DataError, match=r"l\.parquet.*'c'.*multi_valued"):
        list(iter_batches(tmp_path / "l.parquet", parquet_schema("y", [], ["c"]), 4))
    pq.write_table(pa.table({"y": [1], "c": [1.5]}), tmp_path / "f.parquet")
    with pytest.raises(DataError, match=r"f\.parquet.*'c'.*double"):
        list(iter_batches(tmp_path / "f.parquet", parquet_schema("y", [], ["c"]), 4))
    pq.write_table(pa.table({"y": [1, 2], "c": ["a", "b"]}), tmp_path / "y.parquet")
    with pytest.raises(DataError, match=r"y\.parquet: row 2: field 'y'"):
        list(iter_batches(tmp_path / "y.parquet", parquet_schema("y", [], ["c"]), 4))


# -- bad input ------------------------------------------------------------------------------

GOOD = criteo_row("0", ["1"] * 13, ["aa"] * 26)
BAD_CASES = {
    "too few columns": (criteo_row("1", ["1"] * 13, ["aa"] * 26).rsplit("\t", 2)[0], "C25"),
    "too many columns": (GOOD + "\textra", "C26"),
    "non-numeric count": (criteo_row("1", ["1"] * 4 + ["12x"] + ["1"] * 8, ["aa"] * 26), "I5"),
    "label not 0/1": (criteo_row("2", ["1"] * 13, ["aa"] * 26), "label"),
    "empty label": (criteo_row("", ["1"] * 13, ["aa"] * 26), "label"),
    "nan count": (criteo_row("1", ["nan"] + ["1"] * 12, ["aa"] * 26), "I1"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_rows_name_file_line_and_field(tmp_path, case):
    bad, field = BAD_CASES[case]
    path = write_lines(tmp_path / "part-3.txt", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(DataError) as err:
        list(iter_batches(path, CRITEO, batch_size=2))
    message = str(err.value)
    assert "part-3.txt" in message and "line 3" in message and repr(field) in message
    stats = ReadStats()
    batches = list(iter_batches(path, CRITEO, batch_size=2, on_bad_row="skip", stats=stats))
    assert sum(len(b) for b in batches) == 3
    assert (stats.rows, stats.skipped) == (3, 1)
    assert "line 3" in stats.examples[0] and repr(field) in stats.examples[0]


@pytest.mark.parametrize("block_bytes", [None, 256])  # 256: about two rows per block
def test_skip_mode_keeps_line_numbers_right_after_dropped_rows(tmp_path, monkeypatch,
                                                               block_bytes):
    if block_bytes:
        monkeypatch.setattr(readers, "_BLOCK_BYTES", block_bytes)
    bad_count = GOOD + "\tx"
    bad_value = criteo_row("0", ["1"] * 12 + ["-"], ["aa"] * 26)
    bad_label = criteo_row("yes", ["1"] * 13, ["aa"] * 26)
    lines = [GOOD, bad_count, GOOD, bad_count, bad_value, GOOD, bad_label, GOOD, GOOD]
    path = write_lines(tmp_path / "mixed.txt", lines)
    stats = ReadStats()
    n = sum(len(b) for b in iter_batches(path, CRITEO, 2, on_bad_row="skip", stats=stats))
    assert (n, stats.rows, stats.skipped) == (5, 5, 4)
    assert [e.split(": field")[0] for e in stats.examples] == [
        f"{path}: line {i}" for i in (2, 4, 5, 7)]
    assert "'I13'" in stats.examples[2] and "'label'" in stats.examples[3]


def test_line_numbers_count_the_csv_header(tmp_path):
    path = write_lines(tmp_path / "h.csv", ["y,a,c", "1,2,x", "0,3", "1,z,x", "0,1,q"])
    schema = csv_schema("y", ["a"], ["c"])
    with pytest.raises(DataError, match=r"h\.csv: line 3: field 'c'"):
        list(iter_batches(path, schema, 10))
    stats = ReadStats()
    assert sum(len(b) for b in iter_batches(path, schema, 10, on_bad_row="skip",
                                            stats=stats)) == 2
    assert "line 4: field 'a'" in stats.examples[1] and "'z'" in stats.examples[1]


UNCLOSED_QUOTE_CASES = {
    # the lines after it went into its value: 3 columns, the row skipped, those uncounted
    "in a middle column": ('1,2,"x', "a quoted value runs over 20 lines, leaving 3 columns, "
                                     "expected 4"),
    # the right column count: every later line went into the last field, without a word
    "in the last field": ('1,2,x,"q', "field 'd': a quoted value runs to the end of the "
                                      "input"),
    # ... or into a last column the schema does not read
    "in an unread last column": ('1,2,x,q,"z', "column 'z': a quoted value runs to the end "
                                               "of the input"),
}


@pytest.mark.parametrize("case", sorted(UNCLOSED_QUOTE_CASES))
@pytest.mark.parametrize("block_bytes", [None, 64])
def test_an_unclosed_quote_is_an_error_even_with_skip(tmp_path, monkeypatch, case,
                                                      block_bytes):
    """An unclosed quote swallowed the rest of the file: with ``skip`` it counted as one
    bad row and the rows after it were dropped uncounted; without, they were dropped
    silently when the column count came out right. A quoted line break is data."""
    if block_bytes:
        monkeypatch.setattr(readers, "_BLOCK_BYTES", block_bytes)
    bad, what = UNCLOSED_QUOTE_CASES[case]
    unread = "unread" in case
    lines = [f"{i % 2},{i},u{i},t" + (",z" if unread else "") for i in range(40)]
    lines[10] = "0,1,short"  # a bad row of its own before it, skipped
    lines[20] = bad
    header = "y,a,c,d" + (",z" if unread else "")
    path = write_lines(tmp_path / "q.csv", [header, *lines])
    schema = csv_schema("y", ["a"], ["c", "d"])

    def check(message: str) -> None:
        if block_bytes and "a line after line" in message:  # it ran past a block's end
            assert message.startswith(f"{path}: a line after line ")
            assert int(message.split("after line ")[1].split(":")[0]) < 22
        else:
            assert message.startswith(f"{path}: line 22: {what} (an unclosed '\"'?)"), message

    stats = ReadStats()
    with pytest.raises(DataError) as err:
        list(iter_batches(path, schema, 4, on_bad_row="skip", stats=stats))
    check(str(err.value))
    assert stats.skipped == 1 and "line 12" in stats.examples[0]
    lines[10] = lines[9]  # without the short row, the default mode stops at the quote
    write_lines(path, [header, *lines])
    with pytest.raises(DataError) as err:
        list(iter_batches(path, schema, 4))
    check(str(err.value))
    lines[20] = '1,2,"x\ny",q' + (",z" if unread else "")  # a value holding a line break
    write_lines(path, [header, *lines])
    assert sum(len(b) for b in iter_batches(path, schema, 4)) == 40


def test_file_level_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for mode in ("error", "skip"):
        with pytest.raises(DataError, match=r"empty\.txt: empty file"):
            list(iter_batches(empty, CRITEO, 4, on_bad_row=mode))
    header_only = write_lines(tmp_path / "head.csv", ["y,a"])
    with pytest.raises(DataError, match=r"head\.csv: no data rows"):
        list(iter_batches(header_only, csv_schema("y", ["a"], []), 4))
    with pytest.raises(DataError, match=r"nowhere\.txt: file not found"):
        list(iter_batches(tmp_path / "nowhere.txt", CRITEO, 4))
    cols = write_lines(tmp_path / "cols.csv", ["y,a,b", "1,2,3"])
    with pytest.raises(DataError, match=r"cols\.csv: line 1: .*\['price' \(numeric\), "
                                        r"'shop' \(categorical\)\]"):
        list(iter_batches(cols, csv_schema("y", ["price", "a"], ["shop"]), 4))
    with pytest.raises(ValueError, match="on_bad_row"):
        list(iter_batches(cols, CRITEO, 4, on_bad_row="ignore"))


def test_a_field_named_by_two_header_columns_is_refused(tmp_path):
    """A header naming a field twice was read without a word, one of the two columns
    silently taken as the field's."""
    path = write_lines(tmp_path / "twice.csv", ["y,a,c,a", "1,2,x,3", "0,4,y,5"])
    for mode in ("error", "skip"):
        with pytest.raises(DataError, match=r"twice\.csv: line 1: field 'a' names columns "
                           r"2, 4; rename one"):
            list(iter_batches(path, csv_schema("y", ["a"], ["c"]), 4, on_bad_row=mode))
    # a repeated column the schema does not read is no field's
    path = write_lines(tmp_path / "other.csv", ["y,a,c,x,x", "1,2,s,x,3", "0,4,t,y,5"])
    assert len(list(iter_batches(path, csv_schema("y", ["a"], ["c"]), 4))) == 1


@pytest.mark.parametrize("mode", ["error", "skip"])
def test_a_broken_compressed_file_is_named(criteo_file, tmp_path, mode):
    """A truncated .gz (a cut-off download) or plain text named .gz failed with pyarrow's
    bare OSError traceback ("Truncated compressed stream"), naming no file."""
    import gzip

    path, rows = criteo_file
    whole = gzip.compress(("".join("\t".join(r) + "\n" for r in rows) * 50).encode())
    truncated = tmp_path / "cut.txt.gz"
    truncated.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(DataError, match=r"cut\.txt\.gz: cannot read it as \.gz compressed "
                       r"data \(decompressed by its extension\): Truncated compressed"):
        list(iter_batches(truncated, CRITEO, 4, on_bad_row=mode))
    plain = tmp_path / "plain.txt.gz"
    plain.write_bytes(path.read_bytes())
    with pytest.raises(DataError, match=r"plain\.txt\.gz: cannot read it as \.gz compressed"):
        list(iter_batches(plain, CRITEO, 4, on_bad_row=mode))


# -- serving: records -> the same Batch as the file ------------------------------------------

def test_records_give_exactly_the_file_batch(criteo_file):
    path, rows = criteo_file
    from_file = next(iter_batches(path, CRITEO, batch_size=100))
    names = CRITEO.column_names
    records = []
    for r in rows:
        # empty cells are simply absent; counts arrive as JSON numbers
        rec = {k: v for k, v in zip(names, r, strict=True) if v != ""}
        rec.update({k: int(rec[k]) for k in names[1:14] if k in rec})
        records.append(rec)
    from_records = batch_from_records(records, CRITEO)
    assert torch.equal(from_records.dense, from_file.dense)
    assert torch.equal(from_records.sparse.values, from_file.sparse.values)
    assert torch.equal(from_records.sparse.offsets, from_file.sparse.offsets)
    assert torch.equal(from_records.labels, from_file.labels)
    without_label = batch_from_records([{k: v for k, v in records[1].items() if k != "label"}],
                                       CRITEO)
    assert without_label.labels.tolist() == [0.0]


def test_records_accept_ints_lists_and_joined_strings(tmp_path):
    path = write_lines(tmp_path / "m.csv", ["y,shop,tags,n", "1,12,a|b,2.5", "0,,,"])
    schema = csv_schema("y", ["n"], ["shop", "tags"], multi_valued=["tags"])
    from_file = next(iter_batches(path, schema, 4))
    records = [{"y": 1, "shop": 12, "tags": ["a", "b"], "n": 2.5},
               {"y": 0, "shop": None, "tags": ""}]
    got = batch_from_records(records, schema)
    assert torch.equal(got.sparse.values, from_file.sparse.values)
    assert torch.equal(got.sparse.offsets, from_file.sparse.offsets)
    assert torch.equal(got.dense, from_file.dense)
    joined = batch_from_records([{"shop": "12", "tags": "a|b", "n": "2.5"}], schema)
    assert torch.equal(joined.sparse.values, got.slice(0, 1).sparse.values)


def test_bad_records_name_record_and_field():
    with pytest.raises(DataError, match=r"record 1: field 'I4'.*'lots'"):
        batch_from_records([{"I4": 3}, {"I4": "lots"}], CRITEO)
    with pytest.raises(DataError, match=r"record 0: field 'C2'.*float"):
        batch_from_records([{"C2": 1.5}], CRITEO)
    with pytest.raises(DataError, match=r"record 0: field 'label'"):
        batch_from_records([{"label": 3}], CRITEO)
    with pytest.raises(DataError, match="no records"):
        batch_from_records([], CRITEO)
    tags = csv_schema("y", [], ["tags"], multi_valued=["tags"])
    with pytest.raises(DataError, match=r"record 1: field 'tags'.*float"):
        batch_from_records([{"tags": ["a"]}, {"tags": ["b", 1.5]}], tags)
