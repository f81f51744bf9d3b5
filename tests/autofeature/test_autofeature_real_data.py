"""AutoFeature on the real Criteo sample: first 8,000 rows train, last 2,000 validate."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from terarec.autofeature import (
    AutoFeatureEngine,
    apply_file,
    compute_tables,
    enumerate_candidates,
    extend_schema,
)
from terarec.types import FeatureSchema

pytestmark = pytest.mark.real_data

SAMPLE = (Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
          / "criteo-kaggle-sample" / "train-10k.txt")
CRITEO = FeatureSchema.criteo()


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    if not SAMPLE.is_file():
        pytest.skip(f"real data sample not found at {SAMPLE}")
    lines = SAMPLE.read_text().splitlines(keepends=True)
    root = tmp_path_factory.mktemp("criteo")
    (root / "train.txt").write_text("".join(lines[:8000]))
    (root / "valid.txt").write_text("".join(lines[8000:]))
    return root, [ln.rstrip("\n").split("\t") for ln in lines]


def test_criteo_sample_end_to_end(split):
    root, fields = split
    column = {name: i for i, name in enumerate(CRITEO.column_names)}
    train, valid = fields[:8000], fields[8000:]
    with AutoFeatureEngine(memory_limit="256MB", threads=2) as engine:
        card = engine.cardinalities(root / "train.txt", CRITEO)
        # Approximate distinct counts, close to the exact ones.
        for name in ("C3", "C9", "C20"):
            exact = len({row[column[name]] for row in train} - {""})
            assert abs(card[name] - exact) <= max(2, 0.1 * exact), name
        cands = enumerate_candidates(CRITEO, cardinalities=card, max_cross_pairs=4,
                                     max_groupby_keys=1, aggs=("avg",))
        tables = compute_tables(cands, root / "train.txt", CRITEO, root / "features",
                                engine=engine)
        out = apply_file(tables, root / "valid.txt", CRITEO, root / "valid.parquet",
                         engine=engine)
    assert tables.train_rows == 8000
    written = pq.read_table(out)
    assert written.num_rows == 2000
    assert written.column_names == list(extend_schema(CRITEO, tables).column_names)

    # count(C3) on validation rows from training rows alone; empty fields count as missing.
    train_counts = Counter(row[column["C3"]] or None for row in train)
    expected = [str((train_counts.get(row[column["C3"]] or None, 0) + 1).bit_length() - 1)
                for row in valid]
    assert written.column("count(C3)").to_pylist() == expected
    assert "0" in expected  # some validation keys were never seen in training
    assert written.column("C3").to_pylist() == [row[column["C3"]] or None for row in valid]
