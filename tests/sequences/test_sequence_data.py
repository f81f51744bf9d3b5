"""Sequence fields and shared tables on the data side: slots, truncation, hashing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from terarec.data.hashing import hash_values
from terarec.data.readers import batch_from_records, iter_batches
from terarec.data.sequences import parse_sequence, parse_share, slot_keys
from terarec.data.spec import DataSpec
from terarec.types import FeatureSchema
from terarec.validation import InvalidInput

ROWS = [("1", "u1", "7", "1|2|3|4|5"), ("0", "u2", "3", "9"), ("1", "u3", "5", ""),
        ("0", "u1", "2", "4|2")]


def _spec(**extra: object) -> DataSpec:
    return DataSpec.of(format="csv", label="label", categorical="user,item",
                       sequences="hist:3", share_tables="hist=item", **extra)


def _csv(tmp_path: Path) -> Path:
    path = tmp_path / "rows.csv"
    path.write_text("label,user,item,hist\n" + "".join(",".join(r) + "\n" for r in ROWS))
    return path


def test_slot_keys_keep_the_most_recent_in_order() -> None:
    keys = np.array([1, 2, 3, 4, 5, 9, 4, 2], np.int64)
    lengths = np.array([5, 1, 0, 2])
    values, filled = slot_keys(keys, lengths, 3)
    # slot-major: slot 0 of rows 0..3, then slot 1 ...
    assert filled.reshape(3, 4).tolist() == [[1, 1, 0, 1], [1, 0, 0, 1], [1, 0, 0, 0]]
    assert values.tolist() == [3, 9, 4, 4, 2, 5]


def test_a_sequence_becomes_max_len_slots_holding_the_last_values(tmp_path: Path) -> None:
    schema = _spec().schema()
    assert schema.sparse_names == ("user", "item", "hist#0", "hist#1", "hist#2")
    assert [f.name for f in schema.sequence_fields] == ["hist"]
    batch = next(iter_batches(_csv(tmp_path), schema, 4))
    sparse = batch.sparse
    assert sparse.fields == schema.sparse_names
    lengths = sparse.lengths.view(5, 4)
    assert lengths[2:].sum(0).tolist() == [3, 1, 0, 2]  # truncated to 3, empty stays empty

    def key(value: str) -> int:
        return int(hash_values("item", [value], schema.hash_salt)[0])

    # the shared table: a history value has the key of the same item
    assert sparse.field_values("item").tolist() == [key(r[2]) for r in ROWS]
    assert sparse.field_values("hist#0").tolist() == [key("3"), key("9"), key("4")]
    assert sparse.field_values("hist#2").tolist() == [key("5")]


def test_a_parquet_list_column_and_a_request_list_give_the_csv_keys(tmp_path: Path) -> None:
    schema = _spec().schema()
    want = next(iter_batches(_csv(tmp_path), schema, 4)).sparse
    table = pa.table({"label": [int(r[0]) for r in ROWS], "user": [r[1] for r in ROWS],
                      "item": [r[2] for r in ROWS],
                      "hist": [r[3].split("|") if r[3] else [] for r in ROWS]})
    pq.write_table(table, tmp_path / "rows.parquet")
    pschema = DataSpec.of(format="parquet", label="label", categorical="user,item",
                          sequences="hist:3", share_tables="hist=item").schema()
    got = next(iter_batches(tmp_path / "rows.parquet", pschema, 4)).sparse
    assert got.values.tolist() == want.values.tolist()
    assert got.offsets.tolist() == want.offsets.tolist()
    records = [{"user": r[1], "item": int(r[2]), "hist": r[3].split("|") if r[3] else []}
               for r in ROWS]
    req = batch_from_records(records, schema).sparse
    assert req.values.tolist() == want.values.tolist()
    assert req.offsets.tolist() == want.offsets.tolist()


def test_the_schema_round_trips_and_refuses_a_sequence_that_is_not_multi_valued() -> None:
    schema = _spec().schema()
    again = FeatureSchema.from_dict(schema.to_dict())
    assert again == schema
    assert again.sparse_names == schema.sparse_names
    bad = schema.to_dict()
    user = next(i for i, f in enumerate(bad["fields"]) if f["name"] == "user")
    bad["fields"][user]["max_len"] = 4
    with pytest.raises(InvalidInput, match=rf"fields\[{user}\]\.max_len: only a multi-valued"):
        FeatureSchema.from_dict(bad)


def test_flag_values_are_checked_with_the_flag_named() -> None:
    assert parse_sequence("hist:20") == ("hist", 20)
    assert parse_sequence("hist") == ("hist", None)
    assert parse_share(" hist = item ") == ("hist", "item")
    with pytest.raises(ValueError, match="--sequence 'hist:x': max_len 'x' is not"):
        parse_sequence("hist:x")
    with pytest.raises(ValueError, match="max_len must be at least 1"):
        parse_sequence("hist:0")
    with pytest.raises(ValueError, match="--share-table 'hist': expected FIELD=TABLE"):
        parse_share("hist")
    with pytest.raises(ValueError, match="--share-table 'nope=item': 'nope' is not a "
                                         "categorical column"):
        DataSpec.of(format="csv", label="label", categorical="item",
                    share_tables="nope=item").schema()
    with pytest.raises(ValueError, match="only for --format csv or parquet"):
        DataSpec.of(sequences="C1:5").schema()


def test_the_default_length_and_a_model_schema_refusing_the_flags() -> None:
    schema = DataSpec.of(format="csv", label="label", categorical="item",
                         sequences="hist").schema()
    assert schema.sequence_fields[0].max_len == 50
    assert schema.sequence_fields[0].separator == "|"
    with pytest.raises(ValueError, match="--sequence"):
        DataSpec.of(sequences="hist:5").for_model(schema)
