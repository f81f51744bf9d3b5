"""Streaming readers: Criteo TSV, CSV and Parquet files -> ``Batch`` of ``batch_size`` rows.

Files are never loaded whole: pyarrow parses one block at a time, each block is checked
and converted column-wise, and the cleaned blocks are re-cut into batches::

    file ──> pyarrow blocks ──> _Cleaner (label 0/1, numbers parsed, bad rows located)
         ──> clean blocks (label f32, numeric f64 + nulls, categorical as read)
         ──> re-cut to batch_size ──> table_to_batch (dense transform, hashing) ──> Batch

``batch_from_records`` builds the same clean block from request dicts and goes through
the same ``table_to_batch``, so serving gets exactly the keys and dense values training got.

Every value of a text file is read as a string and converted here, so a bad value is
reported with its file, 1-based line number and field instead of a bare parse error.
"""

from __future__ import annotations

import codecs
import csv
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import torch

from terarec.data.hashing import hash_column
from terarec.data.numeric import bucket_index, transform_values
from terarec.data.sequences import slot_keys
from terarec.types import (
    Batch,
    FeatureSchema,
    FieldSpec,
    KeyedIds,
    NumericTransform,
    Pooling,
    as_int64_tensor,
    per_schema,
)

OnBadRow = Literal["error", "skip"]
FORMATS = ("criteo", "csv", "parquet")

_NUMBER_RE = r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$"
_BLOCK_BYTES = 4 << 20
# Dense features are float32: a value beyond its range would become an infinity there.
FLOAT32_MAX = float(np.finfo(np.float32).max)
# Standardised values are clipped here: a value this many standard deviations out says
# nothing more than one at the bound, and must not become an infinity in float32.
MAX_STANDARDISED = 1e4
_MAX_BLOCK_BYTES = 1 << 30  # one row may be at most this long


class DataError(ValueError):
    """Bad input data; the message names the file, the 1-based line (or row) and the field."""


@dataclass
class ReadStats:
    """What a read saw: rows delivered, bad rows skipped, and the first few reasons."""

    rows: int = 0
    skipped: int = 0
    examples: list[str] = field(default_factory=list)
    max_examples: int = 5
    # Given a list, where each skipped row was, as its message names it: its line in a
    # text file, its 1-based row in a Parquet file (predict leaves a line empty there).
    skipped_at: list[int] | None = None

    def skip(self, message: str, at: int | None = None) -> None:
        self.skipped += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(message)
        if self.skipped_at is not None and at is not None:
            self.skipped_at.append(at)


# -- schema builders ----------------------------------------------------------------------

def csv_schema(
    label: str,
    numeric: Sequence[str],
    categorical: Sequence[str],
    *,
    delimiter: str = ",",
    separator: str | None = None,
    multi_valued: Sequence[str] | None = None,
    transform: NumericTransform | Mapping[str, NumericTransform] = "none",
    pooling: Pooling = "sum",
    hash_salt: str = "terarec-v1",
    missing_flags: bool = True,
    has_header: bool = True,
    column_names: Sequence[str] = (),
    format: str = "csv",
) -> FeatureSchema:
    """A schema for a delimited file (or, with ``format="parquet"``, a Parquet file).

    Multi-valued categorical fields hold several keys per cell, split on ``separator``
    (Parquet list columns need no splitting but must still be declared here, so that
    serving knows the field is multi-valued). ``multi_valued`` names those fields; when it
    is omitted and ``separator`` is given, every categorical field is multi-valued.
    ``transform`` is one transform for every numeric field or a per-field mapping.
    """
    names = [label, *numeric, *categorical]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"columns listed twice (label, numeric, categorical): {dupes}")
    if format not in FORMATS:
        raise ValueError(f"format {format!r} is not one of {FORMATS}")
    if (problem := check_delimiter(delimiter)) is not None:
        raise ValueError(f"delimiter {delimiter!r}: {problem}")
    if multi_valued is None:
        multi = set(categorical) if separator is not None else set()
    else:
        multi = set(multi_valued)
        not_cat = sorted(multi - set(categorical))
        if not_cat:
            raise ValueError(f"multi_valued fields {not_cat} are not categorical fields")
    sep = separator if separator is not None else "|"
    if multi and (sep == "" or sep == delimiter):
        raise ValueError(f"separator {sep!r} must be non-empty and differ from the delimiter")
    if isinstance(transform, Mapping):
        unknown = sorted(set(transform) - set(numeric))
        if unknown:
            raise ValueError(f"transform given for non-numeric fields {unknown}")
        transforms = {n: transform.get(n, "none") for n in numeric}
    else:
        transforms = {n: transform for n in numeric}
    for name, t in transforms.items():
        if t not in ("none", "log1p"):
            raise ValueError(f"field {name!r}: unknown transform {t!r} (none, log1p)")
    fields = tuple(FieldSpec(n, "numeric", transform=transforms[n]) for n in numeric) + tuple(
        FieldSpec(n, "categorical", separator=sep if n in multi else None, pooling=pooling)
        for n in categorical
    )
    return FeatureSchema(label=label, fields=fields, hash_salt=hash_salt,
                         missing_flags=missing_flags, format=format, delimiter=delimiter,
                         has_header=has_header, column_names=tuple(column_names))


def check_delimiter(delimiter: str) -> str | None:
    """What is wrong with ``delimiter`` as a csv delimiter, or None: the readers take one
    character that is neither a line break nor the quote character."""
    if len(delimiter) != 1:
        hint = " (for a tab, pass a tab character: $'\\t' in bash)" if delimiter == "\\t" \
            else ""
        return f"must be exactly one character, got {len(delimiter)}{hint}"
    if delimiter in ('"', "\n", "\r"):
        return "a quote or a line break cannot separate fields"
    return None


def parquet_schema(label: str, numeric: Sequence[str], categorical: Sequence[str], *,
                   multi_valued: Sequence[str] = (), **kwargs: Any) -> FeatureSchema:
    """``csv_schema`` for Parquet: list columns are the fields named in ``multi_valued``."""
    return csv_schema(label, numeric, categorical, multi_valued=multi_valued,
                      format="parquet", **kwargs)


# -- public entry points ------------------------------------------------------------------

def iter_batches(path: str | Path, schema: FeatureSchema, batch_size: int, *,
                 on_bad_row: OnBadRow = "error", stats: ReadStats | None = None,
                 with_label: bool = True) -> Iterator[Batch]:
    """Stream ``path`` as Batches of ``batch_size`` rows (the last one may be shorter).

    ``on_bad_row="skip"`` drops rows with a wrong column count, a non-numeric value in a
    numeric column or a label other than 0/1, counting them in ``stats``; an empty or
    missing file, or columns the file lacks, are always errors. ``with_label=False``
    (scoring new rows) never reads the label: the file may lack it (a headerless file
    then has one column fewer) and the batches' labels are 0.
    """
    for table in iter_tables(path, schema, batch_size, on_bad_row=on_bad_row, stats=stats,
                             with_label=with_label):
        yield table_to_batch(table, schema)


def iter_tables(path: str | Path, schema: FeatureSchema, batch_size: int, *,
                on_bad_row: OnBadRow = "error", stats: ReadStats | None = None,
                with_label: bool = True) -> Iterator[pa.Table]:
    """``iter_batches`` one step short: parsed and checked tables of ``batch_size`` rows,
    not yet hashed. Hashing is most of the work of reading, so a torchrun rank, which
    must see every row to cut the same batches as the others, converts only its own
    (``table_to_batch``)."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    path = check_file(path)
    stats = stats if stats is not None else ReadStats()
    if schema.format in ("criteo", "csv"):
        blocks = _text_blocks(path, schema, on_bad_row, stats, with_label)
    elif schema.format == "parquet":
        blocks = _parquet_blocks(path, schema, on_bad_row, stats, with_label)
    else:
        raise ValueError(f"schema format {schema.format!r} is not one of {FORMATS}")
    produced = 0
    for table in rebatch_blocks(blocks, batch_size):
        produced += table.num_rows
        stats.rows += table.num_rows
        yield table
    if produced == 0 and stats.skipped == 0:
        raise DataError(f"{path}: no data rows")


def check_file(path: str | Path) -> Path:
    """``path`` as a Path, or a DataError if it is missing, a directory or empty."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if path.is_dir():
        raise DataError(f"{path}: is a directory, expected a file")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file")
    return path


def no_data_rows(path: Path, schema: FeatureSchema) -> bool:
    """Whether ``path`` holds no data row: zero bytes, a header line only, or a Parquet
    file of no rows. A followed source's writer leaves such files for a period without
    events (an empty partition's part file), and they are trained as zero rows there,
    while an input named on the command line must hold rows."""
    if path.stat().st_size == 0:
        return True
    if schema.format == "parquet":
        import pyarrow.parquet as pq

        return bool(pq.ParquetFile(path).metadata.num_rows == 0)
    skip = 1 if schema.has_header and schema.format != "criteo" else 0
    head = b""
    with pa.input_stream(str(path), compression="detect") as stream:
        while chunk := stream.read(1 << 16):
            head += chunk
            if any(line.strip() for line in head.splitlines()[skip:]):
                return False
    return True


def batch_from_records(records: Sequence[Mapping[str, Any]], schema: FeatureSchema) -> Batch:
    """A Batch from raw column -> value dicts (a JSON request), keyed exactly like a file.

    Missing columns and ``None`` are missing values; the label is optional (0 when absent).
    Integers and their decimal strings give the same keys; multi-valued fields take a list
    or a ``separator``-joined string.
    """
    if not records:
        raise DataError("no records")
    columns: dict[str, pa.Array] = {}
    columns[schema.label] = pa.array([_label_text(r.get(schema.label)) for r in records],
                                     type=pa.string())
    for spec in schema.numeric:
        columns[spec.name] = _texts(spec.name, [r.get(spec.name) for r in records])
    for spec in schema.categorical:
        values = [r.get(spec.name) for r in records]
        if spec.separator is not None:
            columns[spec.name] = _record_lists(spec, values)
        else:
            columns[spec.name] = _texts(spec.name, values, categorical=True)
    return _raw_block_to_batch(columns, schema)


def batch_from_columns(columns: Mapping[str, pa.Array], n: int,
                       schema: FeatureSchema) -> Batch:
    """``batch_from_records`` for ``n`` rows whose values already sit in Arrow columns
    (a decoded JSON request, binary tensors): the same keys, dense values and errors,
    converted a column at a time. An absent column is all missing; a column of a type
    no text file could hold (floats for a categorical field, nested values, non-finite
    numbers) goes through the record path's per-value checks, which name the record."""
    out: dict[str, pa.Array] = {schema.label: pa.nulls(n, pa.string()).fill_null("0")}
    for spec in schema.numeric:
        out[spec.name] = _numeric_column(spec.name, columns.get(spec.name), n)
    for spec in schema.categorical:
        out[spec.name] = _categorical_column(spec, columns.get(spec.name), n)
    return _raw_block_to_batch(out, schema)


def _numeric_column(name: str, col: pa.Array | None, n: int) -> pa.Array:
    if col is None or pa.types.is_null(col.type):
        return pa.nulls(n, pa.float64())
    t = col.type
    if pa.types.is_integer(t):  # as the record path does, through a rounding float64
        return pc.cast(col, pa.float64(), safe=False)
    if pa.types.is_boolean(t) or pa.types.is_string(t) or pa.types.is_large_string(t):
        return col
    if pa.types.is_floating(t) and pc.all(pc.is_finite(col)).as_py() is not False:
        return col
    return _texts(name, col.to_pylist())


def _categorical_column(spec: FieldSpec, col: pa.Array | None, n: int) -> pa.Array:
    if col is None or pa.types.is_null(col.type):
        return pa.nulls(n, pa.string())
    t = col.type
    text = (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t))
    if spec.separator is None:
        if text or pa.types.is_integer(t) or pa.types.is_dictionary(t):
            return col
        return _texts(spec.name, col.to_pylist(), categorical=True)
    if text:
        return col
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and (
            pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type)
            or pa.types.is_integer(t.value_type) or pa.types.is_null(t.value_type)):
        return col
    return _record_lists(spec, col.to_pylist())


def _record_lists(spec: FieldSpec, values: list[Any]) -> pa.Array:
    return pa.array([_record_list(spec, v, i) for i, v in enumerate(values)],
                    type=pa.list_(pa.string()))


def _raw_block_to_batch(columns: dict[str, pa.Array], schema: FeatureSchema) -> Batch:
    """Raw request columns (label first) -> checked, converted and hashed Batch."""
    cleaner = _Cleaner(schema, lambda i: f"record {i}", "error", ReadStats())
    block = pa.RecordBatch.from_pydict(columns)
    clean = cleaner.clean(block, 0)
    return table_to_batch(pa.Table.from_batches([clean]), schema)


# -- cleaning: parse labels and numbers, locate bad rows ------------------------------------

class _Cleaner:
    """Turns a raw block into a clean one: label float32 in {0,1}, numeric float64 with
    nulls for missing. ``where(i)`` names the location of stream row ``i`` for messages."""

    def __init__(self, schema: FeatureSchema, where: Callable[[int], str], on_bad_row: OnBadRow,
                 stats: ReadStats, number: Callable[[int], int] | None = None) -> None:
        self.schema = schema
        self.where = where
        self.number = number  # stream row -> the line / row number ``where`` names
        self.on_bad_row = on_bad_row
        self.stats = stats

    def label(self, col: pa.Array, first_row: int, name: str | None = None) -> pa.Array:
        """Labels as float32, null where the value is not 0 or 1."""
        t = col.type
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            ok = pc.is_in(col, value_set=pa.array(["0", "1"], t))
            values = pc.cast(pc.equal(col, "1"), pa.float32())
        elif pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
            values = pc.cast(col, pa.float32())
            ok = pc.is_in(values, value_set=pa.array([0.0, 1.0], pa.float32()))
        else:
            raise DataError(f"{self.where(first_row)}: field {name or self.schema.label!r}: label "
                            f"column has type {t}, expected 0/1 integers or strings")
        return pc.if_else(pc.fill_null(ok, False), values, pa.scalar(None, pa.float32()))

    def numeric(self, col: pa.Array, name: str) -> pa.Array:
        """float64 with nulls for missing; unparseable, non-finite or beyond-float32
        entries become NaN so ``clean`` can find them (NaN never comes out of a valid
        cell)."""
        x = self._numeric(col, name)
        return pc.if_else(pc.greater(pc.abs(x), FLOAT32_MAX), pa.scalar(float("nan")), x)

    def _numeric(self, col: pa.Array, name: str) -> pa.Array:
        t = col.type
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            col = pc.if_else(pc.equal(col, ""), pa.scalar(None, t), col)
            try:
                x = pc.cast(col, pa.float64())
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                ok = pc.match_substring_regex(col, _NUMBER_RE)
                x = pc.cast(pc.if_else(ok, col, pa.scalar("nan", t)), pa.float64())
            # Text like "nan" or "inf" parses but is no usable value: flag it as bad.
            return pc.if_else(pc.is_finite(x), x, pa.scalar(float("nan")))
        if pa.types.is_integer(t) or pa.types.is_boolean(t):
            return pc.cast(col, pa.float64())
        if pa.types.is_floating(t):
            x = pc.cast(col, pa.float64())
            # In binary files NaN is how many writers spell "missing"; infinities are bad.
            x = pc.if_else(pc.is_nan(x), pa.scalar(None, pa.float64()), x)
            return pc.if_else(pc.is_inf(x), pa.scalar(float("nan")), x)
        raise DataError(f"{self.where(0)}: field {name!r}: numeric column has type {t}")

    def clean(self, block: pa.RecordBatch, first_row: int) -> pa.RecordBatch:
        """Check and convert one raw block whose first row is stream row ``first_row``."""
        schema = self.schema
        columns: dict[str, pa.Array] = {}
        bad: list[tuple[str, np.ndarray, pa.Array]] = []  # (field, bad mask, raw column)
        for name in schema.task_names:
            if name not in block.schema.names:  # scoring new rows: no label read
                raw_label = labels = pa.nulls(block.num_rows, pa.float32()).fill_null(0.0)
            else:
                raw_label = block.column(name)
                labels = self.label(raw_label, first_row, name)
            columns[name] = labels
            if labels.null_count:
                bad.append((name, labels.is_null().to_numpy(zero_copy_only=False),
                            raw_label))
        for spec in schema.numeric:
            raw = block.column(spec.name)
            x = self.numeric(raw, spec.name)
            columns[spec.name] = x
            nan = pc.fill_null(pc.is_nan(x), False)
            if pc.any(nan).as_py():
                bad.append((spec.name, nan.to_numpy(zero_copy_only=False), raw))
        for spec in schema.categorical:
            columns[spec.name] = block.column(spec.name)
        clean = pa.RecordBatch.from_pydict(columns)
        if not bad:
            return clean
        any_bad = np.logical_or.reduce([mask for _, mask, _ in bad])
        rows = np.flatnonzero(any_bad)
        if self.on_bad_row == "error":
            rows = rows[:1]
        for i in rows:
            name, _, raw = next(b for b in bad if b[1][i])
            value = raw[int(i)].as_py()
            what = ("label must be 0 or 1" if name in schema.task_names
                    else _numeric_problem(value))
            message = (f"{self.where(first_row + int(i))}: field {name!r}: {what}, "
                       f"got {'an empty value' if value in (None, '') else repr(value)}")
            if self.on_bad_row == "error":
                raise DataError(message)
            at = self.number(first_row + int(i)) if self.number is not None else None
            self.stats.skip(message, at)
        return clean.filter(pa.array(~any_bad))


# A number as the columnar parser reads one; Python's float() is looser (it takes '1_000'
# and ' 3'), so it cannot tell why the parser refused a cell.
_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _numeric_problem(value: Any) -> str:
    """Why a numeric cell was refused, in the words a user can act on."""
    if isinstance(value, str):
        if value.strip() != value and value.strip():
            return "not a number (it has spaces around it)"
        if not _DECIMAL.fullmatch(value):
            return "not a finite number"
    try:
        x = float(value)
    except (TypeError, ValueError):
        return "not a finite number"
    if x != x or abs(x) == float("inf"):
        return "not a finite number"
    return f"outside the float32 range (|x| > {FLOAT32_MAX:.4g})"


def _texts(name: str, values: list[Any], *, categorical: bool = False,
           record: int | None = None) -> pa.Array:
    """Request values as strings, formatted the way they would appear in a text file.
    ``record`` is the record all values come from (a list cell), else value ``i`` is
    record ``i``."""
    out: list[str | None] = []
    for j, v in enumerate(values):
        i = j if record is None else record
        if v is None or isinstance(v, str):
            out.append(v)
        elif isinstance(v, (bool, np.bool_)):
            if categorical:
                raise DataError(f"record {i}: field {name!r}: boolean is no categorical "
                                "value; send a string or an integer")
            out.append(str(int(v)))
        elif isinstance(v, (int, np.integer)):
            out.append(str(int(v)))
        elif isinstance(v, (float, np.floating)):
            if categorical:
                raise DataError(f"record {i}: field {name!r}: {v!r} is a float; "
                                "categorical values must be strings or integers")
            if not np.isfinite(v):  # JSON NaN / Infinity: no value a file could hold
                raise DataError(f"record {i}: field {name!r}: not a finite number, got "
                                f"{float(v)!r}; send null for a missing value")
            out.append(repr(float(v)))
        else:
            raise DataError(f"record {i}: field {name!r}: unsupported value {v!r} "
                            f"({type(v).__name__})")
    return pa.array(out, type=pa.string())


def _label_text(value: Any) -> str:
    """A request label as the text a file would hold; absent means 0."""
    if value is None:
        return "0"
    if not isinstance(value, str) and value in (0, 1):  # 0, 1, 0.0, 1.0, False, True
        return str(int(value))
    return str(value)


def _record_list(spec: FieldSpec, value: Any, record: int) -> list[str | None] | None:
    """A multi-valued request cell as a list, split like the file reader splits it."""
    if value is None:
        return None
    if isinstance(value, str):
        return list(value.split(spec.separator))
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return _texts(spec.name, items, categorical=True, record=record).to_pylist()


# -- sources --------------------------------------------------------------------------------

def _text_blocks(path: Path, schema: FeatureSchema, on_bad_row: OnBadRow,
                 stats: ReadStats, with_label: bool = True) -> Iterator[pa.RecordBatch]:
    """Clean blocks of a Criteo TSV or a delimited file, tracking exact line numbers."""
    try:
        check_text(path)
        names, header_lines = text_columns(path, schema, with_label)
        yield from parse_text(path, schema, names, path, on_bad_row, stats,
                              header_in_source=header_lines > 0, with_label=with_label)
    except OSError as exc:
        # pyarrow decompresses by extension and says only what failed ("Truncated
        # compressed stream", "zlib inflate failed"), as a traceback: name the file.
        raise DataError(f"{path}: cannot read it{_as_compressed(path)}: {exc}") from None


# The extensions pyarrow's input_stream(compression="detect") decompresses.
_COMPRESSED_SUFFIXES = (".gz", ".bz2", ".zst", ".lz4")


def _as_compressed(path: Path) -> str:
    """`` as .gz compressed data ...`` when pyarrow decompresses ``path``, else nothing."""
    if path.suffix.lower() not in _COMPRESSED_SUFFIXES:
        return ""
    return f" as {path.suffix} compressed data (decompressed by its extension)"


_SNIFF_BYTES = 1 << 16


def check_text(path: Path) -> None:
    """A DataError naming the first offending byte when the start of ``path`` (after
    decompression, by extension) is not UTF-8 text: a binary file given as input is
    refused at once, and its bytes never reach a message."""
    with pa.input_stream(str(path), compression="detect") as stream:
        head = stream.read(_SNIFF_BYTES)
    bad = head.find(b"\0")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as exc:
        bad = exc.start if bad < 0 else min(bad, exc.start)
    if bad >= 0:
        line = head.count(b"\n", 0, bad) + 1
        raise DataError(f"{path}: line {line}: not text (byte "
                        f"0x{head[bad]:02x} at offset {bad}); expected UTF-8 delimited text "
                        "(.gz / .bz2 / .zst by extension) or Parquet (.parquet)")


def _printable(text: str) -> bool:
    return "\ufffd" not in text and all(c.isprintable() or c in "\t" for c in text)


class _QuietUndecodableRows:
    """pyarrow decodes a bad row's text as UTF-8 before calling the handler; binary bytes
    make that raise inside pyarrow, which prints it as "Exception ignored" and then stops
    the read (reported by ``parse_text``). This ``sys.unraisablehook`` silences only that
    exception and hands every other one to the hook it replaced."""

    def __init__(self) -> None:
        self.previous: Callable[[Any], Any] = sys.unraisablehook

    def install(self) -> None:
        if sys.unraisablehook is not self:
            self.previous, sys.unraisablehook = sys.unraisablehook, self

    def __call__(self, unraisable: Any) -> None:
        where = getattr(unraisable.object, "__qualname__", "")
        if not (isinstance(unraisable.exc_value, UnicodeDecodeError)
                and where.endswith("parse_text.<locals>.on_invalid")):
            self.previous(unraisable)


_quiet_undecodable_rows = _QuietUndecodableRows()


def _needed(schema: FeatureSchema, with_label: bool = True) -> list[str]:
    """The columns a read takes: the label (unless scoring new rows) and every field."""
    fields = [f.name for f in schema.fields]
    return [*schema.task_names, *fields] if with_label else fields


def _roles(schema: FeatureSchema, names: list[str]) -> str:
    """``field(s) ['a' (label), 'b' (numeric)]``: what each missing column was to be, so
    that the flag or schema entry that named it is found."""
    kinds = {f.name: f.kind for f in schema.fields}
    shown = [f"{n!r} ({'label' if n in schema.task_names else kinds.get(n, 'column')})"
             for n in names]
    return f"field(s) [{', '.join(shown)}]"


def text_columns(path: Path, schema: FeatureSchema,
                 with_label: bool = True) -> tuple[list[str], int]:
    """The column names of a Criteo TSV or delimited file and how many header lines
    precede its data (0 or 1); a DataError if a field the schema needs is missing.
    Without a header and ``with_label=False``, a first line one column short of the
    schema's columns means the file has no label column (as Criteo's test files)."""
    criteo = schema.format == "criteo"
    needed = _needed(schema, with_label)
    if schema.has_header and not criteo:
        names, header_lines = _read_header(path, schema.delimiter), 1
    else:
        names, header_lines = list(schema.column_names) or _needed(schema), 0
        if not with_label and len(_read_header(path, schema.delimiter)) \
                == len(names) - schema.num_tasks:
            names = [n for n in names if n not in schema.task_names]
    where = f"{path}: line 1" if header_lines else f"{path}"
    missing = [n for n in needed if n not in names]
    if missing:
        raise DataError(f"{where}: {_roles(schema, missing)} are not among the file's columns "
                        f"{names}")
    for name in needed:  # which of two same-named columns is the field's? say, not guess
        columns = [i + 1 for i, n in enumerate(names) if n == name]
        if len(columns) > 1:
            raise DataError(f"{where}: field {name!r} names columns "
                            f"{', '.join(map(str, columns))}; rename one")
    return names, header_lines


def parse_text(path: Path, schema: FeatureSchema, names: list[str], source: Any,
               on_bad_row: OnBadRow, stats: ReadStats, *, header_in_source: bool = False,
               lines_before: int = 0, with_label: bool = True) -> Iterator[pa.RecordBatch]:
    """Clean blocks of delimited text read from ``source`` (``path`` itself, or a buffer
    holding whole lines of it), whose columns are ``names``. Messages name lines of
    ``path``: ``lines_before`` is how many of its lines precede ``source``'s first, and
    ``header_in_source`` says whether that first line is the header."""
    criteo = schema.format == "criteo"
    needed = _needed(schema, with_label)
    skip = 1 if header_in_source else 0
    column_names = None if header_in_source else names

    # Rows with a wrong column count never reach us as data: pyarrow reports them to this
    # handler (with their line number in ``source``, since parsing is single-threaded)
    # and drops them.
    invalid: list[int] = []
    first_invalid: list[tuple[int, str]] = []  # (row number, message): raised

    def on_invalid(row: Any) -> str:
        if invalid and row.number <= invalid[-1]:
            return "skip"  # seen before the reader restarted with larger blocks
        got, want = row.actual_columns, row.expected_columns
        culprit = names[got] if got < want else names[-1]
        where = f"{path}: line {lines_before + row.number}: field {culprit!r}"
        message = (f"{where}: {got} columns, expected {want}"
                   + (" (missing values from here on)" if got < want
                      else " (extra values after the last field)"))
        invalid.append(row.number)
        spans = len((row.text or "").splitlines())
        if spans > 1:
            # Lines after an unclosed quote were read into this row: skipping it would
            # drop them uncounted, so this is an error even with skip.
            first_invalid.append((row.number, (
                f"{path}: line {lines_before + row.number}: a quoted value runs over "
                f"{spans} lines, leaving {got} columns, expected {want} (an unclosed "
                "'\"'?)")))
            return "skip"
        if on_bad_row == "skip":
            stats.skip(message, lines_before + row.number)
            return "skip"
        # Dropped here too, and raised once the rows before it in its block are checked:
        # a bad value on an earlier line of the same block is the first bad row.
        first_invalid.append((row.number, message))
        return "skip"

    def line_of(stream_row: int) -> int:
        # The k-th delivered row sits after every dropped line that precedes it.
        dropped = np.asarray(invalid, dtype=np.int64) - skip
        t = stream_row + 1
        shift = np.searchsorted(dropped - np.arange(dropped.size), t, side="right")
        return lines_before + skip + t + int(shift)

    _quiet_undecodable_rows.install()
    parse_options = pa_csv.ParseOptions(
        delimiter=schema.delimiter, quote_char=False if criteo else '"',
        invalid_row_handler=on_invalid, ignore_empty_lines=False)
    # A value ending in a line break took the input's last newline: a quote never closed
    # swallowed every line after it. Looked for in the fields and in the last column,
    # where those lines end up when the column count still comes out right.
    read = needed if criteo or names[-1] in needed else [*needed, names[-1]]
    convert_options = pa_csv.ConvertOptions(
        include_columns=read, column_types={n: pa.string() for n in read},
        strings_can_be_null=True, quoted_strings_can_be_null=True, null_values=[""])
    cleaner = _Cleaner(schema, lambda i: f"{path}: line {line_of(i)}", on_bad_row, stats,
                       number=line_of)
    try:
        stream_row = 0
        for block in _csv_blocks(path, source, column_names, parse_options,
                                 convert_options):
            stops = []  # (rows of the block before it, error): the first one is raised
            if first_invalid:  # an invalid row that stops the read (see on_invalid)
                number, message = first_invalid[0]
                dropped = sum(1 for n in invalid if n < number)
                stops.append((number - skip - 1 - dropped - stream_row, message))
            if not criteo and (broken := _unclosed_quote(block)) is not None:
                i, name = broken
                what = "field" if name in needed else "column"
                stops.append((i, f"{path}: line {line_of(stream_row + i)}: {what} {name!r}: "
                                 "a quoted value runs to the end of the input (an unclosed "
                                 "'\"'?)"))
            stop = min(stops, default=None, key=lambda s: s[0])
            if stop is not None and stop[0] < block.num_rows:
                cleaner.clean(block.slice(0, max(stop[0], 0)), stream_row)
                raise DataError(stop[1])
            yield cleaner.clean(block, stream_row)
            stream_row += block.num_rows
        if first_invalid:
            raise DataError(first_invalid[0][1])
    except pa.ArrowInvalid as exc:
        if first_invalid:
            raise DataError(first_invalid[0][1]) from None
        text = str(exc)
        if "out of sync with chunker" in text:  # an unclosed quote ran past a block's end
            last = line_of(stream_row - 1) if stream_row else lines_before + skip
            raise DataError(f"{path}: a line after line {last}: a quoted value runs over "
                            "many lines (an unclosed '\"'?)") from None
        if not _printable(text) or "invalid UTF8" in text:  # say where, not what
            row = re.search(r"Row #(\d+)", text)
            where = f"line {lines_before + int(row.group(1))}" if row else "a row"
            column = re.search(r"column #(\d+)", text)
            if column and int(column.group(1)) < len(names):
                where += f": field {names[int(column.group(1))]!r}"
            raise DataError(f"{path}: {where}: not UTF-8 text (binary data?)") from None
        raise DataError(f"{path}: {exc}") from exc


def _unclosed_quote(block: pa.RecordBatch) -> tuple[int, str] | None:
    """The first row of ``block`` (and its column) with a value ending in a line break:
    a quoted value may hold line breaks, but one that ends in one ran to the end of the
    input."""
    found: tuple[int, str] | None = None
    for name in block.schema.names:
        col = block.column(name)
        data = col.buffers()[2]  # the values' bytes: searched first (the regex is slow)
        raw = data.to_pybytes() if data is not None else b""
        if b"\n" not in raw and b"\r" not in raw:
            continue
        hit = pc.match_substring_regex(col, r"[\r\n]$")
        if pc.any(hit).as_py():
            row = int(pc.index(pc.fill_null(hit, False), True).as_py())
            if found is None or row < found[0]:
                found = (row, name)
    return found


def _csv_blocks(path: Path, source: Any, column_names: list[str] | None,
                parse_options: pa_csv.ParseOptions,
                convert_options: pa_csv.ConvertOptions) -> Iterator[pa.RecordBatch]:
    """pyarrow's CSV blocks of ``source`` (``path`` or a seekable buffer of its lines).
    A row longer than a block (pyarrow: "straddling object straddles two block
    boundaries") restarts the read with 8x larger blocks, up to ``_MAX_BLOCK_BYTES``,
    skipping the rows already delivered."""
    block_bytes, delivered = _BLOCK_BYTES, 0
    while True:
        read_options = pa_csv.ReadOptions(use_threads=False, block_size=block_bytes,
                                          column_names=column_names)
        seen = 0
        reader = None
        try:
            reader = pa_csv.open_csv(source, read_options=read_options,
                                     parse_options=parse_options,
                                     convert_options=convert_options)
            for block in reader:
                start, seen = seen, seen + block.num_rows
                if seen > delivered:
                    yield block.slice(max(0, delivered - start))
                    delivered = seen
            return
        except pa.ArrowInvalid as exc:
            if "straddl" not in str(exc):
                raise
            if block_bytes >= _MAX_BLOCK_BYTES:
                raise DataError(f"{path}: a row after data row {delivered} is longer than "
                                f"{_MAX_BLOCK_BYTES >> 20} MiB, the largest block the "
                                "reader takes; split or shorten that row") from None
            block_bytes = min(block_bytes * 8, _MAX_BLOCK_BYTES)
            if hasattr(source, "seek"):
                source.seek(0)
        finally:
            # closed here, not at interpreter exit: a reader left open after an error
            # aborts the process then ("terminate called without an active exception")
            if reader is not None:
                reader.close()


def _read_header(path: Path, delimiter: str) -> list[str]:
    """The first line's column names; a compressed file (by extension, as pyarrow opens
    it) is decompressed first."""
    head = b""
    with pa.input_stream(str(path), compression="detect") as stream:
        while b"\n" not in head and b"\r" not in head:
            chunk = stream.read(1 << 16)
            if not chunk:
                break
            head += chunk
    try:
        first = head.splitlines()[0].decode("utf-8-sig") if head else ""
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: line 1: header is not UTF-8 text: {exc}") from None
    if not first.strip():
        raise DataError(f"{path}: line 1: empty header line")
    return next(csv.reader([first], delimiter=delimiter))


def _parquet_blocks(path: Path, schema: FeatureSchema, on_bad_row: OnBadRow,
                    stats: ReadStats, with_label: bool = True) -> Iterator[pa.RecordBatch]:
    pf, needed = open_parquet(path, schema, with_label)
    cleaner = parquet_cleaner(path, schema, on_bad_row, stats)
    stream_row = 0
    for block in pf.iter_batches(batch_size=65536, columns=needed):
        yield cleaner.clean(block, stream_row)
        stream_row += block.num_rows


def open_parquet(path: Path, schema: FeatureSchema,
                 with_label: bool = True) -> tuple[Any, list[str]]:
    """A ``pyarrow.parquet.ParquetFile`` whose columns were checked against the schema,
    and the columns to read."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file: {exc}") from exc
    names = pf.schema_arrow.names
    needed = _needed(schema, with_label)
    missing = [n for n in needed if n not in names]
    if missing:
        raise DataError(f"{path}: {_roles(schema, missing)} are not among the file's columns "
                        f"{names}")
    for spec in schema.categorical:
        t = pf.schema_arrow.field(spec.name).type
        is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
        if is_list and spec.separator is None:
            raise DataError(f"{path}: field {spec.name!r}: list column, but the schema "
                            "declares the field single-valued; name it in multi_valued")
        item = t.value_type if is_list else t
        if pa.types.is_dictionary(item):
            item = item.value_type
        if not (pa.types.is_integer(item) or pa.types.is_string(item)
                or pa.types.is_large_string(item) or pa.types.is_binary(item)
                or pa.types.is_large_binary(item) or pa.types.is_null(item)):
            raise DataError(f"{path}: field {spec.name!r}: categorical column has type {t}; "
                            "store categorical values as strings or integers")
    return pf, needed


def parquet_cleaner(path: Path, schema: FeatureSchema, on_bad_row: OnBadRow,
                    stats: ReadStats) -> _Cleaner:
    """The cleaner of a Parquet file's blocks; ``clean(block, first_row)`` names rows
    1-based from the file's first."""
    return _Cleaner(schema, lambda i: f"{path}: row {i + 1}", on_bad_row, stats,
                    number=lambda i: i + 1)


def rebatch_blocks(blocks: Iterator[pa.RecordBatch], batch_size: int) -> Iterator[pa.Table]:
    """Re-cut blocks of any size into tables of exactly ``batch_size`` rows (zero-copy)."""
    pending: list[pa.RecordBatch] = []
    rows = 0
    for block in blocks:
        if block.num_rows == 0:
            continue
        pending.append(block)
        rows += block.num_rows
        while rows >= batch_size:
            table = pa.Table.from_batches(pending)
            yield table.slice(0, batch_size)
            rest = table.slice(batch_size)
            pending, rows = rest.to_batches(), rest.num_rows
    if rows:
        yield pa.Table.from_batches(pending)


# -- conversion: clean table -> Batch -------------------------------------------------------

def table_to_batch(table: pa.Table, schema: FeatureSchema) -> Batch:
    """A clean table (from ``iter_tables``) as a Batch: dense features, hashed keys, labels."""
    n = table.num_rows
    if schema.num_tasks == 1:
        labels = np.array(table.column(schema.label).to_numpy(), dtype=np.float32)  # writable
    else:  # [B, T], one column per task
        labels = np.stack([table.column(t).to_numpy() for t in schema.task_names],
                          axis=1).astype(np.float32)
    # float64, NaN where missing
    numeric = np.empty((len(schema.numeric), n), dtype=np.float64)
    for j, spec in enumerate(schema.numeric):
        numeric[j] = table.column(spec.name).to_numpy()
    dense = dense_features(numeric, schema)
    bucket_keys = numeric_bucket_keys(numeric, schema)
    keys: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    for spec in schema.categorical:
        col = table.column(spec.name)
        if spec.separator is None:
            keys.append(hash_column(spec.key_space, col, schema.hash_salt))
            lengths.append(np.ones(n, dtype=np.int64))
        else:
            k, length = _multi_keys(spec, col, n, schema.hash_salt)
            if spec.max_len is not None:  # spread over its slots, most recent kept
                k, length = slot_keys(k, length, spec.max_len)
            keys.append(k)
            lengths.append(length)
    keys += bucket_keys  # sparse_fields order: categorical, then bucketed numeric
    lengths += [np.ones(n, dtype=np.int64)] * len(bucket_keys)
    values = np.concatenate(keys) if keys else np.empty(0, dtype=np.int64)
    offsets = np.zeros(sum(len(x) for x in lengths) + 1, dtype=np.int64)  # F * n + 1
    np.cumsum(np.concatenate(lengths), out=offsets[1:])
    # Offsets built in numpy: small torch ops pay thread-pool wake-ups on every batch.
    sparse = KeyedIds(schema.sparse_names, as_int64_tensor(values), torch.from_numpy(offsets))
    return Batch(torch.from_numpy(dense), sparse, torch.from_numpy(labels))


class _DensePlan:
    """A schema's per-field constants for ``dense_features``: the fields of each
    transform, and the standardised fields with their means and stds as column arrays.
    Built once per schema, not on every call (a served request is one call)."""

    def __init__(self, schema: FeatureSchema) -> None:
        specs = schema.numeric
        self.groups = tuple(
            (transform, np.array([j for j, s in enumerate(specs) if s.transform == transform],
                                 dtype=np.int64))
            for transform in dict.fromkeys(s.transform for s in specs))
        scaled = [j for j, s in enumerate(specs) if s.std is not None]
        self.scaled = np.array(scaled, dtype=np.int64) if scaled else None
        self.mean = np.array([[specs[j].mean] for j in scaled], dtype=np.float64)
        self.std = np.array([[specs[j].std] for j in scaled], dtype=np.float64)


_dense_plan = per_schema(_DensePlan)


def dense_features(numeric: np.ndarray, schema: FeatureSchema) -> np.ndarray:
    """``Batch.dense`` ``[n, dense_dim]`` float32 from the numeric fields' clean float64
    values ``[fields, n]`` (NaN where missing): transformed, standardised, missing as
    0, then the missing flags. Whole rows of fields at a time."""
    n = numeric.shape[1]
    dense = np.zeros((n, schema.dense_dim), dtype=np.float32)
    num = len(schema.numeric)
    if not num:
        return dense
    plan = _dense_plan(schema)
    missing = np.isnan(numeric)
    x = numeric.copy()
    for transform, rows in plan.groups:
        x[rows] = transform_values(x[rows], transform)
    if plan.scaled is not None:
        x[plan.scaled] = np.clip((x[plan.scaled] - plan.mean) / plan.std,
                                 -MAX_STANDARDISED, MAX_STANDARDISED)
    dense[:, :num] = np.where(missing, 0.0, x).T
    if schema.missing_flags:
        dense[:, num:2 * num] = missing.T
    return dense


def numeric_bucket_keys(numeric: np.ndarray, schema: FeatureSchema) -> list[np.ndarray]:
    """The keys of every bucketed numeric field (``schema.sparse_fields`` order) from the
    clean float64 values ``[fields, n]`` (NaN where missing)."""
    return [_bucket_keys(spec, transform_values(numeric[j], spec.transform),
                         np.isnan(numeric[j]), schema.hash_salt)
            for j, spec in enumerate(schema.numeric) if spec.buckets is not None]

def _bucket_keys(spec: FieldSpec, t: np.ndarray, missing: np.ndarray,
                 salt: str) -> np.ndarray:
    """Keys of a bucketed numeric field: its bucket index hashed like a categorical
    value of the field (``"0"``, ``"1"`` ...); a missing value gets the field's missing
    key."""
    assert spec.buckets is not None
    index = pa.array(bucket_index(t, spec.buckets), mask=missing)
    return hash_column(spec.name, index, salt)


def _multi_keys(spec: FieldSpec, col: pa.ChunkedArray, n: int,
                salt: str) -> tuple[np.ndarray, np.ndarray]:
    """Keys and per-row key counts of a multi-valued column; empty items are dropped, so
    an empty or missing cell holds no keys (it pools to zero)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        if pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
            arr = pc.cast(arr, pa.string())
        arr = pc.split_pattern(arr, spec.separator)
    flat = pc.list_flatten(arr)
    parents = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)
    keep = flat.is_valid()
    if pa.types.is_string(flat.type) or pa.types.is_large_string(flat.type) \
            or pa.types.is_binary(flat.type):
        keep = pc.and_(keep, pc.fill_null(pc.greater(pc.binary_length(flat), 0), False))
    keep_np = keep.to_numpy(zero_copy_only=False)
    if not keep_np.all():
        flat = flat.filter(keep)
        parents = parents[keep_np]
    keys = hash_column(spec.key_space, flat, salt)
    return keys, np.bincount(parents, minlength=n).astype(np.int64)
