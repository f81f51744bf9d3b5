"""Numeric statistics on N ranks: each rank parses its share of the first rows, the sums
are gathered, and the schema matches one process's (in-process gloo ranks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ranks import run_ranks

from terarec.data.numeric import with_numeric_stats
from terarec.data.readers import csv_schema
from terarec.data.split import line_index
from terarec.distributed.context import DistContext
from terarec.types import FeatureSchema


def _schema() -> FeatureSchema:
    return csv_schema("y", ["hour", "count"], ["c"], transform={"count": "log1p"})


def _files(tmp_path: Path) -> list[Path]:
    rng = np.random.default_rng(3)
    paths = []
    for part, n in enumerate((700, 500)):
        hours = 14102100 + rng.integers(0, 24, n)  # large, nearly constant
        counts = np.where(rng.random(n) < 0.1, np.nan, rng.exponential(500.0, n).round())
        rows = [f"{int(rng.random() < 0.2)},{h},{'' if np.isnan(c) else c},k{i % 7}"
                for i, (h, c) in enumerate(zip(hours, counts, strict=True))]
        path = tmp_path / f"part-{part}.csv"
        path.write_text("y,hour,count,c\n" + "\n".join(rows) + "\n")
        paths.append(path)
    return paths


MAX_ROWS = (100, 900, 10_000)  # within the first file, across both, every row


def _rank_stats(ctx: DistContext, paths: list[str]) -> list[list[tuple]]:
    out = []
    for max_rows in MAX_ROWS:
        schema = with_numeric_stats(_schema(), paths, max_rows=max_rows, on_bad_row="skip",
                                    rank=ctx.rank, world=ctx.world,
                                    gather=ctx.all_gather_object)
        out.append([(f.name, f.mean, f.std) for f in schema.numeric])
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_gather_the_statistics_one_process_computes(tmp_path, world):
    paths = _files(tmp_path)
    results = run_ranks(_rank_stats, world, [str(p) for p in paths])
    for i, max_rows in enumerate(MAX_ROWS):
        want = [(f.name, f.mean, f.std) for f in with_numeric_stats(
            _schema(), paths, max_rows=max_rows, on_bad_row="skip").numeric]
        for ranks_got in results:  # every rank holds the same schema
            got = ranks_got[i]
            assert got == results[0][i]
            for (name, mean, std), (_, w_mean, w_std) in zip(got, want, strict=True):
                assert mean == pytest.approx(w_mean, rel=1e-12), (name, max_rows)
                assert std == pytest.approx(w_std, rel=1e-9), (name, max_rows)


def test_line_index_stops_after_max_lines(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("y,x\n" + "".join(f"{i % 2},{i}\n" for i in range(1000)))
    full = line_index(path, 64, header_lines=1)
    assert full is not None and full.lines == 1000
    for max_lines in (1, 64, 100, 999, 1000, 5000):
        part = line_index(path, 64, header_lines=1, max_lines=max_lines)
        assert part is not None and part.lines == min(max_lines, 1000)
        blocks = -(-part.lines // 64)
        np.testing.assert_array_equal(part.starts[:-1], full.starts[:blocks])
        text = path.read_bytes()[part.starts[0]:part.starts[-1]].decode()
        assert text.count("\n") == part.lines and text.endswith("\n")
