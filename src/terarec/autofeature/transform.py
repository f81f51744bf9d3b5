"""Apply feature tables to raw rows: join on the key columns, add one column per table.

    raw row (C3="a1", I5=7) ──LEFT JOIN count(C3) ON C3──> count(C3) = "4"   (log2 bucket)
                            ──LEFT JOIN max(I5)_by(C3)──> max(I5)_by(C3) = 12.0

Counts become categorical strings ``str(floor(log2(1 + count)))``: the embedding learns
one vector per order of magnitude, and a key never seen in training (count 0) gets "0".
Aggregates become float columns; an unseen key gives NULL, which training treats as missing.
A missing key (NULL) is a key of its own: it gets the count of training rows missing it.

Joins do not keep row order in DuckDB, so rows are numbered on the way in and sorted on
the way out.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from pathlib import Path

import duckdb
import pyarrow as pa

from terarec.autofeature.candidates import AutoFeatureError
from terarec.autofeature.engine import (
    AutoFeatureEngine,
    copy_to_parquet,
    default_engine,
)
from terarec.autofeature.source import (
    Inputs,
    PathSpec,
    display,
    expand_paths,
    ident,
    key_expr,
    literal,
    source_sql,
)
from terarec.autofeature.tables import VALUE_COLUMN, FeatureTable, FeatureTables, extend_schema
from terarec.types import FeatureSchema

__all__ = ["apply", "apply_file", "extend_schema", "count_bucket_sql"]

_ROW_ID = "__terarec_row_id"
_BATCH = "__terarec_batch"


def count_bucket_sql(count_sql: str) -> str:
    """SQL for the categorical bucket of a count: ``floor(log2(1 + count))`` as text."""
    return f"CAST(CAST(floor(log2(1 + coalesce({count_sql}, 0))) AS BIGINT) AS VARCHAR)"


def _joins(tables: Sequence[FeatureTable], table_refs: Sequence[str],
           source_types: dict[str, str]) -> tuple[str, list[str]]:
    """LEFT JOIN clauses onto ``src`` and the select expressions of the new columns."""
    joins, columns = [], []
    for i, (table, ref) in enumerate(zip(tables, table_refs, strict=True)):
        alias = f"t{i}"
        conditions = []
        for key, ktype in zip(table.candidate.keys, table.key_types, strict=True):
            if key not in source_types:
                raise AutoFeatureError(
                    f"feature {table.name} needs column {key!r}, which the rows lack "
                    f"(they have {', '.join(source_types)})"
                )
            conditions.append(
                f"{key_expr('src.' + ident(key), ktype, source_types[key])} "
                f"IS NOT DISTINCT FROM {alias}.{ident(key)}"
            )
        joins.append(f"LEFT JOIN {ref} AS {alias} ON {' AND '.join(conditions)}")
        value = f"{alias}.{VALUE_COLUMN}"
        expr = count_bucket_sql(value) if table.candidate.is_count else \
            f"CAST({value} AS DOUBLE)"
        columns.append(f"{expr} AS {ident(table.name)}")
    return "\n".join(joins), columns


def _rounds(tables: FeatureTables, size: int) -> list[tuple[FeatureTable, ...]]:
    return [tables.tables[i:i + size] for i in range(0, len(tables.tables), size)]


def _check_names(tables: FeatureTables, existing: Sequence[str]) -> None:
    if not tables.tables:
        raise AutoFeatureError("no feature tables to apply")
    clash = [n for n in tables.names if n in existing]
    if clash:
        raise AutoFeatureError(f"the rows already have columns named {clash}")


def _describe(engine: AutoFeatureEngine, con: duckdb.DuckDBPyConnection, relation: str,
              what: str, inputs: Inputs | None = None) -> dict[str, str]:
    rows = engine.run(con, f"DESCRIBE SELECT * FROM {relation}", what, inputs).fetchall()
    return {name: str(dtype) for name, dtype, *_ in rows}


def apply(tables: FeatureTables, batch: pa.Table, *,
          engine: AutoFeatureEngine | None = None) -> pa.Table:
    """``batch`` (raw columns, source names) with one new column per feature table appended.

    Row count and order are kept; the original columns are returned untouched.
    """
    engine = engine or default_engine()
    _check_names(tables, batch.column_names)
    con = engine.cursor()
    out = batch
    try:
        con.register(_BATCH, batch)
        source_types = _describe(engine, con, _BATCH, "reading the batch")
        for group in _rounds(tables, engine.joins_per_query):
            refs = [engine.loaded_table(tables, t) for t in group]
            joins, columns = _joins(group, refs, source_types)
            sql = (f"WITH src AS (SELECT *, row_number() OVER () AS {_ROW_ID} FROM {_BATCH})\n"
                   f"SELECT {', '.join(columns)} FROM src\n{joins}\nORDER BY src.{_ROW_ID}")
            with engine.errors("applying feature tables"):
                added = con.sql(sql).to_arrow_table()
            for name in added.column_names:
                out = out.append_column(name, added.column(name))
    finally:
        con.close()
    return out


def apply_file(tables: FeatureTables, path: PathSpec, schema: FeatureSchema,
               out_path: str | os.PathLike, *,
               engine: AutoFeatureEngine | None = None) -> Path:
    """Stream the rows of ``path`` (read as ``schema`` says) through the feature tables into
    one Parquet file at ``out_path``, whose schema is ``extend_schema(schema, tables)``.

    DuckDB streams the input and spills the joins and the final ordering to its temp dir,
    so the file may be larger than its memory limit. With more tables than
    ``engine.joins_per_query``, each round writes an intermediate Parquet file (row number
    carried along) that the next round reads. The output is written atomically.
    """
    engine = engine or default_engine()
    files = expand_paths(path, what="input")
    where = display(files)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    con = engine.cursor()
    rounds = _rounds(tables, engine.joins_per_query)
    scratch: list[Path] = []
    try:
        source = source_sql(files, schema)
        source_types = _describe(engine, con, source, f"reading {where}", (files, schema))
        _check_names(tables, list(source_types))
        current = f"(SELECT *, row_number() OVER () AS {_ROW_ID} FROM {source})"
        for r, group in enumerate(rounds):
            refs = [f"read_parquet({literal(str(tables.path(t)))})" for t in group]
            joins, columns = _joins(group, refs, source_types)
            query = f"SELECT src.*, {', '.join(columns)} FROM {current} AS src\n{joins}"
            what = f"applying {', '.join(t.name for t in group)} to {where}"
            if r == len(rounds) - 1:
                copy_to_parquet(engine, con, f"SELECT * EXCLUDE ({_ROW_ID}) FROM ({query}) "
                                f"ORDER BY {_ROW_ID}", out, what, (files, schema))
            else:
                step = Path(engine.scratch_dir()) / f"apply-{uuid.uuid4().hex}.parquet"
                scratch.append(step)
                copy_to_parquet(engine, con, query, step, what,
                                (files, schema) if r == 0 else None)
                current = f"read_parquet({literal(str(step))})"
    finally:
        con.close()
        for step in scratch:
            step.unlink(missing_ok=True)
    return out
