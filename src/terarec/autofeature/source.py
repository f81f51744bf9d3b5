"""Raw input files as a DuckDB table expression, for each format a ``FeatureSchema`` names.

Categorical fields are always read as VARCHAR and numeric ones as numbers, whatever the
file's own type guess would be, so that a key such as ``"0123"`` stays a string and the
same key compares equal in training and in serving.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path

from terarec.autofeature.candidates import AutoFeatureError
from terarec.data.readers import DataError, iter_tables
from terarec.types import FeatureSchema

PathSpec = str | os.PathLike | Sequence[str | os.PathLike]
#: The files a statement reads (expanded) and their schema: what ``first_bad_row`` checks.
Inputs = tuple[Sequence[str], FeatureSchema]

#: Key column types in the feature tables: categorical keys compare as strings, numeric
#: keys as doubles, so ``5``, ``5.0`` and ``"5"`` in a numeric field are the same key.
CATEGORICAL_KEY_TYPE = "VARCHAR"
NUMERIC_KEY_TYPE = "DOUBLE"


def ident(name: str) -> str:
    """A SQL identifier, quoted (field names such as ``count(C3)`` need it)."""
    return '"' + name.replace('"', '""') + '"'


def literal(text: str) -> str:
    """A SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def expand_paths(paths: PathSpec, what: str = "training range") -> list[str]:
    """Resolve files and glob patterns to a sorted, de-duplicated list of files.

    An empty list, a pattern matching nothing or a missing file is an error here rather
    than an empty aggregate later: features computed from no rows would silently be all
    defaults.
    """
    specs = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not specs:
        raise AutoFeatureError(f"{what} is empty: no paths given")
    files: list[str] = []
    for spec in specs:
        spec = os.fspath(spec)
        if glob.has_magic(spec):
            matched = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not matched:
                raise AutoFeatureError(f"{what} is empty: no file matches {spec!r}")
            files += matched
        elif os.path.isfile(spec):
            files.append(spec)
        else:
            raise FileNotFoundError(f"{what}: no such file {spec!r}")
    return list(dict.fromkeys(os.path.abspath(f) for f in files))


def column_types(schema: FeatureSchema) -> dict[str, str]:
    """DuckDB types for the schema's fields; other columns are left to the reader."""
    numeric = "BIGINT" if schema.format == "criteo" else "DOUBLE"
    return {f.name: CATEGORICAL_KEY_TYPE if f.kind == "categorical" else numeric
            for f in schema.fields}


def _struct(mapping: dict[str, str]) -> str:
    return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in mapping.items()) + "}"


def source_sql(paths: Sequence[str], schema: FeatureSchema) -> str:
    """A table expression reading ``paths`` (already expanded) as ``schema`` describes."""
    fmt = schema.format
    if fmt == "parquet":
        return f"read_parquet([{', '.join(literal(str(p)) for p in paths)}])"
    if fmt not in ("criteo", "csv", "tsv"):
        raise AutoFeatureError(
            f"unsupported input format {fmt!r}; AutoFeature reads criteo, csv, tsv and parquet"
        )
    delimiter = "\t" if fmt in ("criteo", "tsv") else schema.delimiter
    options = [f"delim={literal(delimiter)}"]
    if fmt == "criteo":
        # Criteo lines are raw tab-separated values: a quote character is data.
        options += ["quote=''", "escape=''"]
    if schema.has_header and fmt != "criteo":
        # The header names the columns, so DuckDB sniffs the files; a zero-byte file has no
        # header to sniff (and no rows), so it is left out.
        non_empty = [p for p in paths if os.path.getsize(p) > 0]
        if not non_empty:
            raise AutoFeatureError(f"{display(paths)} holds no rows")
        paths = non_empty
        options += ["header=true", f"types={_struct(column_types(schema))}"]
    else:
        if not schema.column_names:
            raise AutoFeatureError(
                f"a {fmt} schema without a header needs column_names to name the columns"
            )
        types = column_types(schema)
        label_type = "INTEGER" if fmt == "criteo" else "DOUBLE"
        columns = {name: types.get(name, label_type if name == schema.label else "VARCHAR")
                   for name in schema.column_names}
        # Every column is declared: no sniffing, which also reads empty files as no rows.
        options += ["header=false", "auto_detect=false", f"columns={_struct(columns)}"]
    return f"read_csv([{', '.join(literal(str(p)) for p in paths)}], {', '.join(options)})"


def first_bad_row(paths: Sequence[str], schema: FeatureSchema) -> DataError | None:
    """The first bad row of ``paths`` as terarec's reader reports it (file, line, field,
    what is wrong), or None. Run once DuckDB has failed on the files: its CSV errors are
    long sniffer reports or name the row by a line count of its own, and ``train`` on
    the same files says it this way."""
    for path in paths:
        try:
            for _ in iter_tables(path, schema, 1 << 16):
                pass
        except DataError as exc:
            return exc
    return None


def key_type(schema: FeatureSchema, column: str) -> str:
    kind = next(f.kind for f in schema.fields if f.name == column)
    return CATEGORICAL_KEY_TYPE if kind == "categorical" else NUMERIC_KEY_TYPE


def key_expr(column_sql: str, target_type: str, source_type: str) -> str:
    """``column_sql`` (of DuckDB type ``source_type``) as a join key of ``target_type``.

    Numeric keys arriving as text (a serving request, an all-varchar read) treat the empty
    string as missing, as the CSV reader does.
    """
    if source_type == target_type:
        return column_sql
    if target_type == NUMERIC_KEY_TYPE and source_type == "VARCHAR":
        return f"CAST(NULLIF(TRIM({column_sql}), '') AS {target_type})"
    return f"CAST({column_sql} AS {target_type})"


def display(paths: Sequence[str], limit: int = 3) -> str:
    """Short description of a file list for error messages."""
    shown = ", ".join(str(Path(p)) for p in paths[:limit])
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return shown + more
