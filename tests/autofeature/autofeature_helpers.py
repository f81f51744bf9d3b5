"""Generated Criteo-style rows and pure-Python reference aggregates for the AutoFeature tests.

The references use only ``collections`` and plain Python arithmetic, so they share no code
(and no SQL) with the implementation they check.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from terarec.autofeature import Candidate, FeatureTables
from terarec.types import FeatureSchema

CRITEO = FeatureSchema.criteo()
NUMERIC = [f"I{i}" for i in range(1, 14)]
CATEGORICAL = [f"C{i}" for i in range(1, 27)]
#: Values that a type-guessing reader would turn into numbers ("0e10" is 0.0, "007" is 7).
TRICKY = ["007", "0e10", "1e5", "00000012"]

Rows = dict[str, list]


def criteo_rows(n: int, seed: int, vocab_scale: int = 1, missing: float = 0.15) -> Rows:
    """``n`` Criteo rows: ints in [-3, 60] and hex-like strings, about ``missing`` empty.

    Column ``C{i}`` draws from a vocabulary of ``vocab_scale * (3 + 7 * i)`` values (C1
    also from ``TRICKY``), so cardinalities differ between columns.
    """
    rng = np.random.default_rng(seed)
    rows: Rows = {"label": rng.integers(0, 2, n).tolist()}
    for name in NUMERIC:
        values = rng.integers(-3, 61, n)
        mask = rng.random(n) < missing
        rows[name] = [None if m else int(v) for v, m in zip(values, mask, strict=True)]
    for i, name in enumerate(CATEGORICAL, start=1):
        vocab = [f"{(i * 7919 + j) * 2654435761 % (1 << 32):08x}"
                 for j in range(vocab_scale * (3 + 7 * i))]
        if i == 1:
            vocab += TRICKY
        # Zipf-like: a few values are frequent, most are rare.
        idx = np.minimum(rng.zipf(1.3, n) - 1, len(vocab) - 1)
        mask = rng.random(n) < missing
        rows[name] = [None if m else vocab[k] for k, m in zip(idx, mask, strict=True)]
    return rows


def num_rows(rows: Rows) -> int:
    return len(rows["label"])


def concat(*parts: Rows) -> Rows:
    return {k: [v for p in parts for v in p[k]] for k in parts[0]}


def take(rows: Rows, index: list[int] | np.ndarray) -> Rows:
    return {k: [v[i] for i in index] for k, v in rows.items()}


def write_tsv(path: Path, rows: Rows) -> Path:
    """Criteo ``train.txt`` layout: no header, tab-separated, missing values empty."""
    names = list(CRITEO.column_names)
    lines = ["\t".join("" if v is None else str(v) for v in values)
             for values in zip(*(rows[c] for c in names), strict=True)]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def write_csv(path: Path, rows: Rows) -> Path:
    names = list(CRITEO.column_names)
    lines = [",".join(names)] + [",".join("" if v is None else str(v) for v in values)
                                 for values in zip(*(rows[c] for c in names), strict=True)]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def to_arrow(rows: Rows) -> pa.Table:
    """The rows as a reader would give them: int label, int64 counts, string categories."""
    arrays = {"label": pa.array(rows["label"], pa.int32())}
    arrays.update({c: pa.array(rows[c], pa.int64()) for c in NUMERIC})
    arrays.update({c: pa.array(rows[c], pa.string()) for c in CATEGORICAL})
    return pa.table(arrays)


def write_parquet(path: Path, rows: Rows) -> Path:
    pq.write_table(to_arrow(rows), path)
    return path


# -- references ----------------------------------------------------------------------------
def _key(rows: Rows, columns: tuple[str, ...], i: int) -> tuple:
    """A row's key as stored in the tables: numeric columns as floats, missing as None."""
    out = []
    for c in columns:
        v = rows[c][i]
        out.append(float(v) if c in NUMERIC and v is not None else v)
    return tuple(out)


def reference_table(cand: Candidate, rows: Rows) -> dict[tuple, float]:
    """``cand`` aggregated over ``rows`` in plain Python: key tuple -> value."""
    n = num_rows(rows)
    if cand.is_count:
        return dict(Counter(_key(rows, cand.keys, i) for i in range(n)))
    groups: dict[tuple, list[float]] = defaultdict(list)
    for i in range(n):
        value = rows[cand.value_column][i]
        key = _key(rows, cand.keys, i)
        groups.setdefault(key, [])
        if value is not None:
            groups[key].append(float(value))
    combine = {"max": max, "min": min, "sum": sum,
               "avg": lambda vs: sum(vs) / len(vs)}[cand.agg]
    return {k: combine(vs) for k, vs in groups.items() if vs}


def bucket(count: int) -> str:
    """floor(log2(1 + count)), computed exactly with integers."""
    return str((count + 1).bit_length() - 1)


def reference_feature(cand: Candidate, train: Rows, rows: Rows) -> list:
    """The column ``apply`` should add to ``rows`` for tables computed from ``train``."""
    table = reference_table(cand, train)
    keys = [_key(rows, cand.keys, i) for i in range(num_rows(rows))]
    if cand.is_count:
        return [bucket(int(table.get(k, 0))) for k in keys]
    return [table.get(k) for k in keys]


def stored_table(tables: FeatureTables, name: str) -> dict[tuple, float]:
    """A feature table file read back as key tuple -> value."""
    t = tables[name]
    data = pq.read_table(tables.path(t)).to_pydict()
    keys = zip(*(data[k] for k in t.candidate.keys), strict=True)
    return {tuple(k): v for k, v in zip(keys, data["value"], strict=True)}


def assert_close_with_nulls(got: list, expected: list, where: str = "") -> None:
    """Same NULL positions, and the other values equal to a relative 1e-12 (pytest.approx
    refuses None inside a sequence)."""
    assert [g is None for g in got] == [e is None for e in expected], where
    pairs = [(g, e) for g, e in zip(got, expected, strict=True) if e is not None]
    assert [g for g, _ in pairs] == pytest.approx([e for _, e in pairs], rel=1e-12), where


def assert_features(out: pa.Table, candidates: list[Candidate], train, rows) -> None:
    """Every candidate's column in ``out`` equals the plain-Python reference for ``rows``."""
    for cand in candidates:
        expected = reference_feature(cand, train, rows)
        got = out.column(cand.name).to_pylist()
        if cand.is_count:
            assert got == expected, cand.name
        else:
            assert_close_with_nulls(got, expected, cand.name)
