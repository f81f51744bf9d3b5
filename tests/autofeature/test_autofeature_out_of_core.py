"""Aggregates over a file whose GROUP BY state does not fit DuckDB's memory limit spill to
disk and still give exact results."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from terarec.autofeature import AutoFeatureEngine, Candidate, compute_tables
from terarec.types import FeatureSchema, FieldSpec

ROWS = 1_000_000
MEMORY_LIMIT = "64MB"
SCHEMA = FeatureSchema(label="label", fields=(FieldSpec("I1", "numeric"),
                                              FieldSpec("C1", "categorical")), format="csv")
CANDIDATES = [Candidate("count", ("C1",)), Candidate("groupby", ("I1", "C1"), "max")]


class InMemoryOnlyEngine(AutoFeatureEngine):
    """The same engine with spilling switched off, to show the data needs it."""

    def duckdb_config(self) -> dict:
        return {**super().duckdb_config(), "temp_directory": ""}


def write_rows(path: Path, keys: np.ndarray, values: np.ndarray, labels: np.ndarray) -> None:
    """``label,I1,C1`` lines ``"1,07,k0123456789"`` built as one byte matrix (fast)."""
    n = len(keys)
    line = np.empty((n, 17), np.uint8)
    line[:, 0] = ord("0") + labels
    line[:, [1, 4]] = ord(",")
    line[:, 2] = ord("0") + values // 10
    line[:, 3] = ord("0") + values % 10
    line[:, 5] = ord("k")
    powers = 10 ** np.arange(9, -1, -1, dtype=np.int64)
    line[:, 6:16] = ord("0") + (keys[:, None] // powers) % 10
    line[:, 16] = ord("\n")
    with open(path, "wb") as fh:
        fh.write(b"label,I1,C1\n")
        fh.write(line.tobytes())


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 10**10, ROWS)  # nearly all distinct: a million groups
    values = rng.integers(0, 100, ROWS)
    path = tmp_path_factory.mktemp("ooc") / "big.csv"
    write_rows(path, keys, values, rng.integers(0, 2, ROWS))
    return path, keys, values


def test_group_by_beyond_the_memory_limit_spills_and_is_exact(tmp_path, big_file):
    path, keys, values = big_file
    spill = tmp_path / "spill"
    with InMemoryOnlyEngine(memory_limit=MEMORY_LIMIT, threads=2) as engine, \
            pytest.raises(MemoryError, match="ran out of memory"):
        compute_tables(CANDIDATES, path, SCHEMA, tmp_path / "in-memory", engine=engine)

    with AutoFeatureEngine(memory_limit=MEMORY_LIMIT, temp_dir=spill, threads=2) as engine:
        tables = compute_tables(CANDIDATES, path, SCHEMA, tmp_path / "features", engine=engine)

    unique, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    maxima = np.zeros(len(unique), np.int64)
    np.maximum.at(maxima, inverse, values)
    assert tables.train_rows == ROWS
    for name, expected in [("count(C1)", counts), ("max(I1)_by(C1)", maxima)]:
        stored = pq.read_table(tables.path(tables[name]))
        stored_keys = pc.cast(pc.utf8_slice_codeunits(stored.column("C1"), 1), "int64")
        order = np.argsort(stored_keys.to_numpy())
        assert np.array_equal(stored_keys.to_numpy()[order], unique)
        assert np.array_equal(stored.column("value").to_numpy()[order], expected), name
