"""``predict --on-bad-row skip``: a skipped row's output line is left empty, so line N
of the scores still answers data row N (it was refused: skipping shifted every score
after a bad row)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from terarec.cli.main import main
from terarec.data.synth_features import generate_planted

SCHEMA = ["--format", "csv", "--label", "label", "--numeric", "I1,I2",
          "--categorical", "C1,C2,C3,C4,C5,C6,C7,C8"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("predict-skip")
    data = generate_planted(root / "t.csv", root / "v.csv", 3000, 600, seed=1)
    out = root / "m"
    assert main(["train", "--train", str(data.train), "--out", str(out), *SCHEMA,
                 "--model", "fm", "--batch-size", "250", "--threads", "1", "--epochs", "1",
                 "--no-progress"]) == 0
    return out, data


def _scores(path: Path) -> list[str]:
    return path.read_text().split("\n")[:-1]  # one line per data row, a final newline


def _same(got: list[str], want: list[str]) -> None:
    """The same scores (to float32 rounding: batches cut at other rows)."""
    assert len(got) == len(want)
    np.testing.assert_allclose(np.array(got, float), np.array(want, float), atol=1e-6)


def test_skipped_rows_leave_their_lines_empty(model, tmp_path, capsys):
    out, data = model
    head, *rows = data.valid.read_text().splitlines()
    names = [n.strip('"') for n in head.split(",")]
    i1 = names.index("I1")
    bad = {3: "value", 4: "columns", 400: "value", len(rows) - 1: "columns"}
    dirty = []
    for n, line in enumerate(rows):
        cells = line.split(",")
        if bad.get(n) == "value":
            cells[i1] = "not-a-number"
        elif bad.get(n) == "columns":
            cells = cells[:-2]
        dirty.append(",".join(cells))
    dirty_path, clean_path = tmp_path / "dirty.csv", tmp_path / "clean.csv"
    dirty_path.write_text("\n".join([head, *dirty]) + "\n")
    clean_path.write_text("\n".join([head, *(r for n, r in enumerate(rows)
                                             if n not in bad)]) + "\n")

    got, want = tmp_path / "got.txt", tmp_path / "want.txt"
    assert main(["predict", "--model", str(out), "--data", str(dirty_path),
                 "--on-bad-row", "skip", "--out", str(got)]) == 0
    assert "skipped 4 bad rows" in capsys.readouterr().err
    assert main(["predict", "--model", str(out), "--data", str(clean_path),
                 "--out", str(want)]) == 0
    lines = _scores(got)
    assert len(lines) == len(rows)
    assert [n for n, line in enumerate(lines) if not line] == sorted(bad)
    _same([x for x in lines if x], _scores(want))

    # Two files: each one's skipped rows keep their places (counted per file).
    twice = tmp_path / "twice.txt"
    assert main(["predict", "--model", str(out), "--data", str(dirty_path), str(dirty_path),
                 "--on-bad-row", "skip", "--out", str(twice)]) == 0
    assert _scores(twice) == lines + lines

    # Parquet: a non-finite numeric value is a bad row there.
    table = pa_csv.read_csv(clean_path)
    values = table.column("I1").to_numpy().astype(np.float64)
    values[[0, 7]] = np.inf
    pq.write_table(table.set_column(table.schema.get_field_index("I1"), "I1",
                                    pa.array(values)), tmp_path / "part.parquet")
    scored = tmp_path / "parquet.txt"
    assert main(["predict", "--model", str(out), "--data", str(tmp_path / "part.parquet"),
                 "--format", "parquet", "--on-bad-row", "skip", "--out", str(scored)]) == 0
    parquet_lines, expected = _scores(scored), _scores(want)
    assert len(parquet_lines) == table.num_rows
    assert parquet_lines[0] == parquet_lines[7] == ""
    _same([x for n, x in enumerate(parquet_lines) if n not in (0, 7)],
          [x for n, x in enumerate(expected) if n not in (0, 7)])
