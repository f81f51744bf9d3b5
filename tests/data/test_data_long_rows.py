"""Rows longer than the CSV reader's block: the block grows, nothing is lost or counted
twice, and line numbers stay exact."""

from __future__ import annotations

import pytest

from terarec.data import readers
from terarec.data.readers import DataError, ReadStats, iter_batches
from terarec.data.synth import generate
from terarec.types import FeatureSchema

SCHEMA = FeatureSchema.criteo()


def _with_long_row(path, rows: int, long_line: int, bad_lines: tuple[int, ...],
                   value_bytes: int) -> list[str]:
    generate(path, rows, model_seed=0, sample_seed=1, vocab_scale=0.01)
    lines = path.read_text().splitlines(keepends=True)
    cells = lines[long_line - 1].rstrip("\n").split("\t")
    cells[20] = "x" * value_bytes  # a categorical value
    lines[long_line - 1] = "\t".join(cells) + "\n"
    for line in bad_lines:
        lines[line - 1] = "\t".join(lines[line - 1].split("\t")[:5]) + "\n"
    path.write_text("".join(lines))
    return lines


def test_a_10_mb_value_is_read_and_bad_rows_keep_their_line_numbers(tmp_path):
    path = tmp_path / "long.tsv"
    _with_long_row(path, 3000, long_line=1500, bad_lines=(11, 2600), value_bytes=10 << 20)
    stats = ReadStats()
    batches = list(iter_batches(path, SCHEMA, 256, on_bad_row="skip", stats=stats))
    assert sum(len(b) for b in batches) == 2998
    assert stats.skipped == 2
    assert [e.split(": ")[1] for e in stats.examples] == ["line 11", "line 2600"]
    # Without skipping, the first bad row past the long one is named.
    _with_long_row(path, 3000, long_line=1500, bad_lines=(2600,), value_bytes=10 << 20)
    with pytest.raises(DataError, match="line 2600: field 'I5'"):
        list(iter_batches(path, SCHEMA, 256, on_bad_row="error"))


def test_the_same_rows_as_with_a_block_large_enough(tmp_path, monkeypatch):
    path = tmp_path / "long.tsv"
    _with_long_row(path, 1200, long_line=700, bad_lines=(), value_bytes=300_000)
    monkeypatch.setattr(readers, "_BLOCK_BYTES", 64 << 10)  # restarts twice
    small = list(iter_batches(path, SCHEMA, 100))
    monkeypatch.setattr(readers, "_BLOCK_BYTES", 8 << 20)
    large = list(iter_batches(path, SCHEMA, 100))
    assert [len(b) for b in small] == [len(b) for b in large]
    for a, b in zip(small, large, strict=True):
        assert (a.sparse.values == b.sparse.values).all()
        assert (a.dense == b.dense).all() and (a.labels == b.labels).all()


def test_a_row_past_the_largest_block_is_a_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "long.tsv"
    _with_long_row(path, 500, long_line=300, bad_lines=(), value_bytes=600_000)
    monkeypatch.setattr(readers, "_BLOCK_BYTES", 64 << 10)
    monkeypatch.setattr(readers, "_MAX_BLOCK_BYTES", 256 << 10)
    with pytest.raises(DataError, match=r"long\.tsv: a row after data row \d+ is longer "
                                        r"than 0 MiB"):
        list(iter_batches(path, SCHEMA, 100))
