"""One rank's share of a file: the local batches it trains, parsed and checked alone.

Under torchrun the input is cut into *local* batches of ``batch_size / world`` rows and
dealt round-robin (``terarec.distributed.sharding``): rank ``r`` trains local batches
``r, r + world, r + 2 world, ...`` of every file. To parse only those, a rank must know
where each one starts without parsing the others:

* text (Criteo TSV, CSV): a newline scan of a memory map (numpy, chunk by chunk; tens of
  times cheaper than parsing) gives the byte offset of every local batch's first line, so
  a rank hands pyarrow just its own byte ranges and names lines exactly;
* Parquet: the footer gives every row group's size; a rank decodes only the row groups
  that hold its rows and checks only its rows.

Batches are cut by line (or row) index, as a single process cuts them when no row is bad.
A bad row skipped with ``on_bad_row="skip"`` leaves its local batch one row shorter
(a single process would fill the batch from the next rows).

Text files that cannot be cut by newlines fall back to reading the whole file on every
rank (``_whole_file_steps``): compressed files (``.gz``, ``.bz2``, ...: pyarrow
decompresses by extension, and offsets into the compressed bytes mean nothing), files
with a carriage return that does not end a line (pyarrow ends lines there too), and CSV
files where a line holds an odd number of quotes (a quoted value may span lines).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from terarec.data.readers import (
    DataError,
    OnBadRow,
    ReadStats,
    check_file,
    iter_tables,
    open_parquet,
    parquet_cleaner,
    parse_text,
    text_columns,
)
from terarec.types import FeatureSchema

_SCAN_BYTES = 16 << 20  # bytes scanned per numpy step: bounded memory on any file size
_NL, _CR, _QUOTE = 10, 13, 34

# (rank's clean table for this step or None, rows of the step on all ranks together)
Step = tuple[pa.Table | None, int]


@dataclass(frozen=True)
class LineIndex:
    """Where the data lines of a text file start, every ``stride`` lines.

    ``starts[k]`` is the byte offset of data line ``k * stride``; the last entry is the
    end of the data, so local batch ``k`` is bytes ``starts[k]:starts[k + 1]``."""

    starts: np.ndarray
    lines: int
    header_lines: int
    stride: int


def line_index(path: str | Path, stride: int, *, header_lines: int = 0,
               quoted: bool = False, max_lines: int | None = None) -> LineIndex | None:
    """Scan ``path`` for newlines and keep the offset of every ``stride``-th data line;
    with ``max_lines``, of the first ``max_lines`` data lines only (the scan stops there).

    None when the file cannot be cut by newlines (see the module docstring): a carriage
    return not followed by a newline, or (``quoted``: CSV) a line with an odd number of
    quotes. Costs one pass over the bytes and memory for ``_SCAN_BYTES``."""
    if stride <= 0:
        raise ValueError(f"stride must be positive, got {stride}")
    path = Path(path)
    size = path.stat().st_size
    data = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    # Data line j starts after newline number header_lines + j - 1 (0-based), or at byte
    # 0 for the first line of a file without a header.
    wanted: list[np.ndarray] = [np.zeros(1 if header_lines == 0 else 0, np.int64)]
    newlines = 0  # newlines seen before the current chunk
    quotes = 0  # quotes seen before the current chunk
    next_start = header_lines - 1 if header_lines else stride - 1  # the next wanted newline
    end = size  # where the indexed data ends
    for lo in range(0, size, _SCAN_BYTES):
        chunk = data[lo:lo + _SCAN_BYTES]
        nl = np.flatnonzero(chunk == _NL)
        cr = np.flatnonzero(chunk == _CR)
        if cr.size:
            after = cr + lo + 1
            if after[-1] >= size or np.any(data[np.minimum(after, size - 1)] != _NL):
                return None
        if quoted:
            q = np.flatnonzero(chunk == _QUOTE)
            if q.size:
                if np.any((quotes + np.searchsorted(q, nl)) % 2):
                    return None
                quotes += q.size
        if next_start < newlines + nl.size:
            picks = np.arange(next_start, newlines + nl.size, stride) - newlines
            wanted.append(nl[picks].astype(np.int64) + lo + 1)
            next_start = int(picks[-1] + newlines + stride)
        if max_lines is not None and newlines + nl.size >= header_lines + max_lines:
            # data line max_lines - 1 ends at newline number header_lines + max_lines - 1
            end = int(nl[header_lines + max_lines - 1 - newlines]) + lo + 1
            newlines += nl.size
            break
        newlines += nl.size
    ends_open = size > 0 and data[size - 1] != _NL
    total = newlines + int(ends_open)
    lines = max(total - header_lines, 0)
    if max_lines is not None:
        lines = min(lines, max_lines)
    starts = np.concatenate(wanted)
    starts = starts[:-(-lines // stride)] if lines else starts[:0]
    del data
    return LineIndex(np.append(starts, end), lines, header_lines, stride)


def iter_rank_tables(path: str | Path, schema: FeatureSchema, local_size: int, rank: int,
                     world: int, *, on_bad_row: OnBadRow = "error",
                     stats: ReadStats | None = None,
                     max_lines: int | None = None) -> Iterator[Step]:
    """Every global step of ``path`` (of its first ``max_lines`` data rows, if given):
    this rank's clean local batch (None where the step has fewer local batches than
    ranks) and the step's rows over all ranks.

    Every rank yields the same steps with the same row counts; ``stats`` counts the rows
    this rank read and skipped (for a file read whole on every rank, rank 0 counts them,
    so that the counts summed over ranks are the file's)."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if local_size <= 0:
        raise ValueError(f"local batch size must be positive, got {local_size}")
    path = check_file(path)
    stats = stats if stats is not None else ReadStats()
    if max_lines is not None and max_lines <= 0:
        return
    if schema.format == "parquet":
        yield from _parquet_steps(path, schema, local_size, rank, world, on_bad_row, stats,
                                  max_lines)
        return
    names, header_lines = text_columns(path, schema)
    index = None if _compressed(path) else line_index(
        path, local_size, header_lines=header_lines, quoted=schema.format == "csv",
        max_lines=max_lines)
    if index is None:
        yield from _whole_file_steps(path, schema, local_size, rank, world, on_bad_row,
                                     stats, max_lines)
        return
    if index.lines == 0:
        raise DataError(f"{path}: no data rows")
    batches = len(index.starts) - 1
    with pa.memory_map(str(path)) as source:
        for first in range(0, batches, world):
            k = first + rank
            step_rows = min((first + world) * local_size, index.lines) - first * local_size
            if k >= batches:
                yield None, step_rows
                continue
            lo, hi = int(index.starts[k]), int(index.starts[k + 1])
            blocks = list(parse_text(path, schema, names, pa.BufferReader(
                source.read_at(hi - lo, lo)), on_bad_row, stats,
                lines_before=header_lines + k * local_size))
            table = pa.Table.from_batches(blocks) if blocks else empty_table(schema)
            stats.rows += table.num_rows
            yield table, step_rows


def empty_table(schema: FeatureSchema) -> pa.Table:
    """A clean table with no rows (a rank's share of a step it has no batch in)."""
    columns = {schema.label: pa.array([], pa.float32())}
    columns.update({f.name: pa.array([], pa.float64()) for f in schema.numeric})
    columns.update({f.name: pa.array([], pa.string()) for f in schema.categorical})
    return pa.table(columns)


def _compressed(path: Path) -> bool:
    """Whether pyarrow would decompress ``path`` (it goes by the extension)."""
    try:
        pa.Codec.detect(str(path))
    except (TypeError, ValueError):
        return False
    return True


def _parquet_steps(path: Path, schema: FeatureSchema, local_size: int, rank: int,
                   world: int, on_bad_row: OnBadRow, stats: ReadStats,
                   max_lines: int | None = None) -> Iterator[Step]:
    pf, needed = open_parquet(path, schema)
    cleaner = parquet_cleaner(path, schema, on_bad_row, stats)
    meta = pf.metadata
    bounds = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    n = int(bounds[-1])
    if n == 0:
        raise DataError(f"{path}: no data rows")
    if max_lines is not None:
        n = min(n, max_lines)
    batches = -(-n // local_size)
    cached: tuple[int, pa.Table] | None = None  # the last row group decoded
    for first in range(0, batches, world):
        k = first + rank
        step_rows = min((first + world) * local_size, n) - first * local_size
        if k >= batches:
            yield None, step_rows
            continue
        lo, hi = k * local_size, min((k + 1) * local_size, n)
        pieces = []
        for g in range(int(np.searchsorted(bounds, lo, "right")) - 1,
                       int(np.searchsorted(bounds, hi, "left"))):
            if cached is None or cached[0] != g:
                cached = (g, pf.read_row_group(g, columns=needed))
            start = max(lo, int(bounds[g]))
            pieces.append(cached[1].slice(start - int(bounds[g]),
                                          min(hi, int(bounds[g + 1])) - start))
        raw = pa.concat_tables(pieces).combine_chunks().to_batches()[0]
        table = pa.Table.from_batches([cleaner.clean(raw, lo)])
        stats.rows += table.num_rows
        yield table, step_rows


def _whole_file_steps(path: Path, schema: FeatureSchema, local_size: int, rank: int,
                      world: int, on_bad_row: OnBadRow, stats: ReadStats,
                      max_lines: int | None = None) -> Iterator[Step]:
    """Every rank parses the whole file (up to ``max_lines`` rows), cuts the same local
    batches and keeps its own: the path for files that cannot be cut by newlines."""
    seen = stats if rank == 0 else ReadStats()
    step: list[pa.Table] = []
    left = max_lines
    for table in iter_tables(path, schema, local_size, on_bad_row=on_bad_row, stats=seen):
        if left is not None:
            if left <= 0:
                break
            table = table.slice(0, left)
            left -= table.num_rows
        step.append(table)
        if len(step) == world:
            yield step[rank], sum(t.num_rows for t in step)
            step = []
    if step:
        yield (step[rank] if rank < len(step) else None), sum(t.num_rows for t in step)
