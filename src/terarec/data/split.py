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
    rebatch_blocks,
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
               quoted: bool = False, first_line: int = 0,
               max_lines: int | None = None) -> LineIndex | None:
    """Scan ``path`` for newlines and keep the offset of every ``stride``-th data line
    from data line ``first_line`` on (``lines``: the data lines from there); with
    ``max_lines``, of the next ``max_lines`` data lines only (the scan stops there).

    None when the file cannot be cut by newlines (see the module docstring): a carriage
    return not followed by a newline, or (``quoted``: CSV) a line with an odd number of
    quotes. Costs one pass over the bytes and memory for ``_SCAN_BYTES``."""
    if stride <= 0:
        raise ValueError(f"stride must be positive, got {stride}")
    path = Path(path)
    size = path.stat().st_size
    data = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    if first_line < 0:
        raise ValueError(f"first_line must be >= 0, got {first_line}")
    # Data line j starts after newline number header_lines + j - 1 (0-based), or at byte
    # 0 for the first line of a file without a header.
    before = header_lines + first_line  # lines before the first one wanted
    wanted: list[np.ndarray] = [np.zeros(1 if before == 0 else 0, np.int64)]
    newlines = 0  # newlines seen before the current chunk
    quotes = 0  # quotes seen before the current chunk
    next_start = before - 1 if before else stride - 1  # the next wanted newline
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
        if max_lines is not None and newlines + nl.size >= before + max_lines:
            # the last wanted line ends at newline number before + max_lines - 1
            end = int(nl[before + max_lines - 1 - newlines]) + lo + 1
            newlines += nl.size
            break
        newlines += nl.size
    ends_open = size > 0 and data[size - 1] != _NL
    total = newlines + int(ends_open)
    lines = max(total - before, 0)
    if max_lines is not None:
        lines = min(lines, max_lines)
    starts = np.concatenate(wanted)
    starts = starts[:-(-lines // stride)] if lines else starts[:0]
    del data
    return LineIndex(np.append(starts, end), lines, header_lines, stride)


def iter_rank_tables(path: str | Path, schema: FeatureSchema, local_size: int, rank: int,
                     world: int, *, on_bad_row: OnBadRow = "error",
                     stats: ReadStats | None = None, start: int = 0,
                     seek: bool = True, max_lines: int | None = None) -> Iterator[Step]:
    """Every global step of ``path`` from data row ``start`` on (a resumed run; of the
    next ``max_lines`` data rows only, if given): this rank's clean local batch (None
    where the step has fewer local batches than ranks) and the step's rows over all
    ranks. ``seek=False``: ``start`` counts rows kept after bad ones were skipped, not
    lines, so the file is read from its start on every rank.

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
    if not seek:
        yield from _whole_file_steps(path, schema, local_size, rank, world, on_bad_row,
                                     stats, start, max_lines)
        return
    if schema.format == "parquet":
        yield from _parquet_steps(path, schema, local_size, rank, world, on_bad_row, stats,
                                  start, max_lines)
        return
    names, header_lines = text_columns(path, schema)
    index = None if _compressed(path) else line_index(
        path, local_size, header_lines=header_lines, quoted=schema.format == "csv",
        first_line=start, max_lines=max_lines)
    if index is None:
        yield from _whole_file_steps(path, schema, local_size, rank, world, on_bad_row,
                                     stats, start, max_lines)
        return
    if index.lines == 0:
        if start == 0:
            raise DataError(f"{path}: no data rows")
        return
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
                lines_before=header_lines + start + k * local_size))
            table = pa.Table.from_batches(blocks) if blocks else empty_table(schema)
            stats.rows += table.num_rows
            yield table, step_rows


def empty_table(schema: FeatureSchema) -> pa.Table:
    """A clean table with no rows (a rank's share of a step it has no batch in)."""
    columns = {name: pa.array([], pa.float32()) for name in schema.task_names}
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
                   start: int = 0, max_lines: int | None = None) -> Iterator[Step]:
    pf, needed = open_parquet(path, schema)
    cleaner = parquet_cleaner(path, schema, on_bad_row, stats)
    meta = pf.metadata
    bounds = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    n = int(bounds[-1])
    if n == 0:
        raise DataError(f"{path}: no data rows")
    if max_lines is not None:
        n = min(n, start + max_lines)
    batches = -(-max(n - start, 0) // local_size)
    cached: tuple[int, pa.Table] | None = None  # the last row group decoded
    for first in range(0, batches, world):
        k = first + rank
        step_rows = min(start + (first + world) * local_size, n) - start - first * local_size
        if k >= batches:
            yield None, step_rows
            continue
        lo, hi = start + k * local_size, min(start + (k + 1) * local_size, n)
        pieces = []
        for g in range(int(np.searchsorted(bounds, lo, "right")) - 1,
                       int(np.searchsorted(bounds, hi, "left"))):
            if cached is None or cached[0] != g:
                cached = (g, pf.read_row_group(g, columns=needed))
            begin = max(lo, int(bounds[g]))
            pieces.append(cached[1].slice(begin - int(bounds[g]),
                                          min(hi, int(bounds[g + 1])) - begin))
        raw = pa.concat_tables(pieces).combine_chunks().to_batches()[0]
        table = pa.Table.from_batches([cleaner.clean(raw, lo)])
        stats.rows += table.num_rows
        yield table, step_rows


def _whole_file_steps(path: Path, schema: FeatureSchema, local_size: int, rank: int,
                      world: int, on_bad_row: OnBadRow, stats: ReadStats,
                      start: int = 0, max_lines: int | None = None) -> Iterator[Step]:
    """Every rank parses the whole file (up to ``max_lines`` rows after ``start``), cuts
    the same local batches and keeps its own: the path for files that cannot be cut by
    newlines."""
    seen = stats if rank == 0 else ReadStats()
    step: list[pa.Table] = []
    tables = iter_tables(path, schema, local_size, on_bad_row=on_bad_row, stats=seen)
    left = max_lines
    for table in drop_rows(tables, start, local_size):
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


def drop_rows(tables: Iterator[pa.Table], rows: int, size: int) -> Iterator[pa.Table]:
    """``tables`` without their first ``rows`` rows, re-cut into tables of ``size`` rows:
    resuming inside a file that can only be read from its start."""
    if rows == 0:
        yield from tables
        return
    pending: list[pa.Table] = []
    held = 0
    for table in tables:
        if rows >= table.num_rows:
            rows -= table.num_rows
            continue
        pending.append(table.slice(rows))
        held += table.num_rows - rows
        rows = 0
        while held >= size:
            whole = pa.concat_tables(pending)
            yield whole.slice(0, size)
            rest = whole.slice(size)
            pending, held = [rest], rest.num_rows
    if held:
        yield pa.concat_tables(pending)


def iter_tables_from(path: str | Path, schema: FeatureSchema, batch_size: int,
                     start: int = 0, *, seek: bool = True, on_bad_row: OnBadRow = "error",
                     stats: ReadStats | None = None,
                     skipped_before: int = 0) -> Iterator[pa.Table]:
    """``iter_tables`` from data row ``start`` on, cut into ``batch_size`` rows from
    there (a resumed single process). ``seek``: ``start`` counts lines too (no bad row
    was skipped before it), so a text file is read from the byte offset of that line and
    a Parquet file from its row group; otherwise, and for compressed or unsplittable
    text, the rows before ``start`` are read and dropped, and of the bad rows met, those
    after the first ``skipped_before`` (counted when the rows before ``start`` were
    trained) go into ``stats``."""
    if start == 0:
        yield from iter_tables(path, schema, batch_size, on_bad_row=on_bad_row, stats=stats)
        return
    path = check_file(path)
    stats = stats if stats is not None else ReadStats()
    if seek and schema.format == "parquet":
        yield from _rebatch(_parquet_blocks_from(path, schema, start, on_bad_row, stats),
                            batch_size, stats)
        return
    if seek and not _compressed(path):
        names, header_lines = text_columns(path, schema)
        index = line_index(path, 1 << 62, header_lines=header_lines,
                           quoted=schema.format == "csv", first_line=start)
        if index is not None:
            if index.lines == 0:
                return
            lo, hi = int(index.starts[0]), int(index.starts[-1])
            with pa.memory_map(str(path)) as source:
                blocks = parse_text(path, schema, names,
                                    pa.BufferReader(source.read_at(hi - lo, lo)),
                                    on_bad_row, stats, lines_before=header_lines + start)
                yield from _rebatch(blocks, batch_size, stats)
            return
    scratch = ReadStats(max_examples=skipped_before + stats.max_examples)
    counted = skipped_before  # the dropped rows' were counted when they were trained
    for table in drop_rows(iter_tables(path, schema, batch_size, on_bad_row=on_bad_row,
                                       stats=scratch), start, batch_size):
        stats.rows += table.num_rows
        _count_skipped(stats, scratch, counted)
        counted = max(counted, scratch.skipped)
        yield table
    _count_skipped(stats, scratch, counted)


def _count_skipped(stats: ReadStats, scratch: ReadStats, counted: int) -> None:
    """Add to ``stats`` the bad rows ``scratch`` met beyond the first ``counted``."""
    for message in scratch.examples[counted:scratch.skipped]:
        if len(stats.examples) < stats.max_examples:
            stats.examples.append(message)
    stats.skipped += max(0, scratch.skipped - counted)


def _rebatch(blocks: Iterator[pa.RecordBatch], batch_size: int,
             stats: ReadStats) -> Iterator[pa.Table]:
    for table in rebatch_blocks(blocks, batch_size):
        stats.rows += table.num_rows
        yield table


def _parquet_blocks_from(path: Path, schema: FeatureSchema, start: int,
                         on_bad_row: OnBadRow, stats: ReadStats) -> Iterator[pa.RecordBatch]:
    """Clean blocks of a Parquet file from row ``start`` on (rows named from the file's
    first)."""
    pf, needed = open_parquet(path, schema)
    cleaner = parquet_cleaner(path, schema, on_bad_row, stats)
    meta = pf.metadata
    bounds = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    if start >= int(bounds[-1]):
        return
    group = int(np.searchsorted(bounds, start, "right")) - 1
    row = int(bounds[group])
    for block in pf.iter_batches(batch_size=65536, columns=needed,
                                 row_groups=list(range(group, meta.num_row_groups))):
        if row + block.num_rows > start:
            skip = max(start - row, 0)
            yield cleaner.clean(block.slice(skip), row + skip)
        row += block.num_rows
