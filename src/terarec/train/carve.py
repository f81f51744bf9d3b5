"""Validation rows carved from the training input when none are given.

On small data the settings that differ between data sets (the epoch count under
patience, Adagrad's starting accumulator, the refit) are settled by validation rows; a
run given none takes the last ``DEFAULT_VALID_SPLIT`` (1/8) of its training rows, in
input order, as validation rows, selects on them, and refits on all of them below
``SMALL_DATA_ROWS`` as a run given ``--valid`` does. The last rows, not a random draw:
logs are in time order, and the rows after the fit rows are the ones that resemble
what the model will score.

The cut falls inside at most one file: files before it are trained as they are, files
after it validate as they are, and only the file it falls in is written again as two
copies (its fit rows and its validation rows, each with the file's header) in a
scratch folder of the model directory, removed when the run ends. Compressed text is
copied decompressed. Text files are cut by lines, so a CSV file with a quoted value
that spans lines cannot be carved (the run says so and trains without validation, or
fails when a split was asked for).
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa

from terarec.data.readers import check_file
from terarec.types import FeatureSchema

DEFAULT_VALID_SPLIT = 0.125  # the share of training rows carved when none is given
MAX_VALID_SPLIT = 0.5  # beyond it validation would hold more rows than training
CARVED_DIR = "carved"  # in the model directory while a run trains on carved copies
_CHUNK = 1 << 20
_COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")


class CarveError(ValueError):
    """The training input cannot be cut by rows (said with the file and why)."""


def check_valid_split(value: float | None, flag: str = "--valid-split") -> None:
    """A share to carve must be a number in [0, ``MAX_VALID_SPLIT``] (0: carve none)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not 0 <= value <= MAX_VALID_SPLIT:
        raise ValueError(f"{flag} {value!r}: must be a share of the training rows in "
                         f"[0, {MAX_VALID_SPLIT:g}] (0 turns carving off)")


@dataclass(frozen=True)
class Piece:
    """Rows ``first`` to ``end`` (end excluded, counted from the file's first data row)
    of input file ``source``, read from ``path`` (the file itself, or a copy of those
    rows)."""

    source: Path
    first: int
    end: int
    path: Path

    def summary(self) -> dict[str, Any]:
        return {"file": os.path.abspath(self.source), "rows": [self.first, self.end]}


@dataclass(frozen=True)
class Carved:
    """The training input cut in two: ``fit`` rows train, ``valid`` rows select."""

    fraction: float
    header: int = 0  # lines before the data rows in every text file (and its copies)
    fit: list[Piece] = field(default_factory=list)
    valid: list[Piece] = field(default_factory=list)

    def name_sources(self, text: str) -> str:
        """``text`` (an error, a skipped row's message) naming the input files the
        copies were cut from, and their lines (or Parquet rows) as counted there."""
        for piece in (p for p in [*self.fit, *self.valid] if p.path != p.source):
            def source(match: re.Match[str], piece: Piece = piece) -> str:
                if match.group(1) is None:  # the file named without a line
                    return str(piece.source)
                n = int(match.group(2))  # a copy's header lines are the file's
                return f"{piece.source}: {match.group(1)} " \
                       f"{n if n <= self.header else n + piece.first}"
            text = re.sub(re.escape(str(piece.path)) + r"(?:: (line|row) (\d+))?", source,
                          text)
        return text

    @property
    def fit_rows(self) -> int:
        return sum(p.end - p.first for p in self.fit)

    @property
    def valid_rows(self) -> int:
        return sum(p.end - p.first for p in self.valid)

    def summary(self) -> dict[str, Any]:
        """What metrics.json says under ``validation``: which rows validated."""
        return {"carved": True, "fraction": self.fraction, "rows": self.valid_rows,
                "fit_rows": self.fit_rows, "valid_files": [p.summary() for p in self.valid],
                "fit_files": [p.summary() for p in self.fit]}

    def describe(self) -> str:
        """The one line a run logs."""
        where = ", ".join(f"{p.source} rows {p.first}-{p.end - 1}" for p in self.valid)
        return (f"validation: last {self.fraction:.1%} of training rows carved "
                f"({self.valid_rows:,} of {self.valid_rows + self.fit_rows:,}: {where}); "
                "--valid-split 0 (valid_split=0) turns it off")


def data_rows(path: Path, schema: FeatureSchema) -> int:
    """Data rows of ``path``: Parquet by its metadata, text by its lines less the
    header (a CarveError for a CSV file with a value spanning lines)."""
    check_file(path)
    if schema.format == "parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    header = _header_lines(schema)
    if path.suffix.lower() not in _COMPRESSED:
        from terarec.data.split import line_index

        index = line_index(path, 1 << 62, header_lines=header,
                           quoted=schema.format == "csv")
        if index is None:
            raise CarveError(f"{path}: cannot be cut by lines (a carriage return inside a "
                             "line, or a quoted value spanning lines)")
        return index.lines
    lines, last = 0, b"\n"
    with pa.input_stream(str(path)) as stream:
        while chunk := stream.read(_CHUNK):
            lines, last = lines + chunk.count(b"\n"), chunk
    return max(lines + (0 if last.endswith(b"\n") else 1) - header, 0)


def carve(paths: Sequence[Path], schema: FeatureSchema, fraction: float,
          folder: Path) -> Carved | None:
    """The last ``fraction`` of the data rows of ``paths`` (in order) as validation
    rows, at least one, leaving at least one to fit; the file the cut falls in is
    copied in two under ``folder`` (emptied first). None when fewer than two rows."""
    rows = [data_rows(Path(p), schema) for p in paths]
    total = sum(rows)
    if total < 2 or fraction <= 0:
        return None
    valid_rows = min(max(1, math.floor(total * fraction)), total - 1)
    cut = total - valid_rows  # rows before it fit, from it on validate
    shutil.rmtree(folder, ignore_errors=True)
    carved = Carved(fraction, 0 if schema.format == "parquet" else _header_lines(schema))
    seen = 0
    for path, n in zip(map(Path, paths), rows, strict=True):
        lo, hi = seen, seen + n
        seen = hi
        if n == 0:
            continue
        if hi <= cut:
            carved.fit.append(Piece(path, 0, n, path))
        elif lo >= cut:
            carved.valid.append(Piece(path, 0, n, path))
        else:
            at = cut - lo
            folder.mkdir(parents=True, exist_ok=True)
            fit_copy, valid_copy = _split_file(path, schema, at, folder)
            carved.fit.append(Piece(path, 0, at, fit_copy))
            carved.valid.append(Piece(path, at, n, valid_copy))
    return carved


def _header_lines(schema: FeatureSchema) -> int:
    return 1 if schema.has_header and schema.format != "criteo" else 0


def _split_file(path: Path, schema: FeatureSchema, at: int,
                folder: Path) -> tuple[Path, Path]:
    """``path``'s first ``at`` data rows and the rest, as two files under ``folder``."""
    name = path.name
    for suffix in _COMPRESSED:
        name = name.removesuffix(suffix)  # the copies are written decompressed
    fit, valid = folder / f"fit-{name}", folder / f"valid-{name}"
    if schema.format == "parquet":
        _split_parquet(path, at, fit, valid)
    else:
        with pa.input_stream(str(path)) as stream, open(fit, "wb") as a, \
                open(valid, "wb") as b:
            _split_lines(stream, _header_lines(schema), at, a, b)
    return fit, valid


def _split_lines(stream: Any, header: int, at: int, fit: BinaryIO, valid: BinaryIO) -> None:
    """The ``header`` lines to both, the next ``at`` lines to ``fit``, the rest to
    ``valid``, streamed in chunks (a whole chunk at a time away from the two cuts)."""
    head = bytearray()
    line = 0  # newlines passed
    cut = header + at  # from this many newlines on, rows validate
    while chunk := stream.read(_CHUNK):
        pos = 0
        while pos < len(chunk):
            if line >= cut:
                valid.write(chunk[pos:])
                break
            ahead = chunk.count(b"\n", pos)
            if line >= header and line + ahead < cut:
                fit.write(chunk[pos:])  # the cut is beyond this chunk
                line += ahead
                break
            nl = chunk.find(b"\n", pos)
            end = len(chunk) if nl < 0 else nl + 1
            if line < header:
                head += chunk[pos:end]
            else:
                fit.write(chunk[pos:end])
            if nl >= 0:
                line += 1
                if line == header:
                    fit.write(head)
                    valid.write(head)
            pos = end
    if line < header:  # a file of no data rows past its header
        fit.write(head)
        valid.write(head)


def _split_parquet(path: Path, at: int, fit: Path, valid: Path) -> None:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    with pq.ParquetWriter(fit, pf.schema_arrow) as a, \
            pq.ParquetWriter(valid, pf.schema_arrow) as b:
        row = 0
        for batch in pf.iter_batches(batch_size=65536):
            n = batch.num_rows
            if row + n <= at:
                a.write_batch(batch)
            elif row >= at:
                b.write_batch(batch)
            else:
                a.write_batch(batch.slice(0, at - row))
                b.write_batch(batch.slice(at - row))
            row += n
