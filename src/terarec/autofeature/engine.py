"""DuckDB runs every AutoFeature query: aggregates over the training files, joins back.

DuckDB is given a memory limit and a spill directory, so a GROUP BY over files far larger
than that limit spills partitions to disk instead of failing or swapping; its CSV and
Parquet readers stream the files.

    training files ──read_csv/read_parquet──> GROUP BY keys ──COPY──> <out>/NNN-name.parquet
                                   (one scan per distinct key set: count(C3) and
                                    max(I5)_by(C3) share the scan grouped by C3)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import uuid
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import duckdb

from terarec.autofeature.candidates import AutoFeatureError, Candidate, validate_candidates
from terarec.autofeature.source import (
    Inputs,
    PathSpec,
    display,
    expand_paths,
    first_bad_row,
    ident,
    key_type,
    literal,
    source_sql,
)
from terarec.autofeature.tables import (
    VALUE_COLUMN,
    FeatureTable,
    FeatureTables,
    table_file_name,
)
from terarec.io import atomic_path
from terarec.types import FeatureSchema

DuckDBConfig = dict[str, str | bool | int | float | list[str]]


class AutoFeatureEngine:
    """A configured DuckDB database for AutoFeature queries.

    ``memory_limit`` (DuckDB syntax, e.g. ``"256MB"``; None: DuckDB's default of 80 % of
    RAM) bounds what DuckDB holds in memory; beyond it, operators spill to ``temp_dir``
    (None: a private directory under the system temp dir, removed by ``close``).
    ``threads`` None lets DuckDB use every core. ``joins_per_query`` bounds how many
    feature tables one query joins: every join holds a hash table (a few MB even for tiny
    tables), so many tables are applied in several rounds.

    Safe to share between threads: each call works on its own cursor.
    """

    def __init__(self, *, memory_limit: str | None = None,
                 temp_dir: str | os.PathLike | None = None, threads: int | None = None,
                 joins_per_query: int = 24, stage_text: bool = True,
                 progress: bool = False) -> None:
        if joins_per_query < 1:
            raise ValueError(f"joins_per_query must be >= 1, got {joins_per_query}")
        self.memory_limit = memory_limit
        self.threads = threads
        self.joins_per_query = joins_per_query
        self.stage_text = stage_text
        self.progress = progress
        self._cleanup: weakref.finalize | None = None
        self.temp_dir = Path(temp_dir) if temp_dir is not None else None
        self._con: duckdb.DuckDBPyConnection | None = None
        self._lock = threading.Lock()
        self._loaded: dict[str, str] = {}

    def duckdb_config(self) -> DuckDBConfig:
        """The settings every connection of this engine is opened with."""
        config: DuckDBConfig = {"temp_directory": str(self.scratch_dir()),
                                "preserve_insertion_order": True}
        if self.memory_limit is not None:
            config["memory_limit"] = self.memory_limit
        if self.threads is not None:
            config["threads"] = self.threads
        return config

    def scratch_dir(self) -> Path:
        """Where intermediate files go: DuckDB's spill directory, which is sized for them."""
        if self.temp_dir is None:
            self.temp_dir = Path(tempfile.mkdtemp(prefix="terarec-duckdb-"))
            # Removed by close(), or at exit for engines never closed (the default one).
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.temp_dir, True)
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        return self.temp_dir

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A handle on the engine's database for one thread's queries."""
        with self._lock:
            if self._con is None:
                self._con = duckdb.connect(":memory:", config=self.duckdb_config())
            cursor = self._con.cursor()
        # a per-connection setting (DuckDB refuses it in the database's config)
        bar = "true" if self.progress and _stdout_is_tty() else "false"
        cursor.execute(f"SET enable_progress_bar = {bar}")
        return cursor

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None
            self._loaded.clear()
            if self._cleanup is not None:
                self._cleanup()
                self._cleanup = None
                self.temp_dir = None

    def __enter__(self) -> AutoFeatureEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- queries --------------------------------------------------------------------------
    @contextlib.contextmanager
    def errors(self, what: str, inputs: Inputs | None = None) -> Iterator[None]:
        """Turn DuckDB errors into ones that say what was being done, keeping DuckDB's
        line, column and file. ``inputs``: the files (and their schema) the statement
        reads; when DuckDB fails on them, terarec's reader finds the bad row and says
        which file, line and field, as ``train`` would."""
        try:
            yield
        except duckdb.OutOfMemoryException as exc:
            raise MemoryError(
                f"{what}: DuckDB ran out of memory (memory_limit={self.memory_limit}, "
                f"temp_dir={self.temp_dir}): {_first_line(exc)}"
            ) from exc
        except duckdb.IOException as exc:
            raise OSError(f"{what}: {_summary(exc)}") from exc
        except duckdb.Error as exc:
            if inputs is not None and (bad := first_bad_row(*inputs)) is not None:
                raise bad from exc
            raise AutoFeatureError(f"{what}: {_summary(exc)}") from exc

    def run(self, con: duckdb.DuckDBPyConnection, sql: str, what: str,
            inputs: Inputs | None = None) -> duckdb.DuckDBPyConnection:
        """Execute ``sql`` on ``con``, errors translated by ``errors``."""
        with self.errors(what, inputs):
            return con.execute(sql)

    def cardinalities(self, train_paths: PathSpec, schema: FeatureSchema,
                      columns: Iterable[str] | None = None) -> dict[str, int]:
        """Approximate distinct non-missing values per column (default: categorical fields),
        measured in one scan with HyperLogLog, for ``enumerate_candidates``."""
        files = expand_paths(train_paths)
        names = list(columns) if columns is not None else list(schema.sparse_names)
        if not names:
            return {}
        known = {f.name for f in schema.fields}
        unknown = [c for c in names if c not in known]
        if unknown:
            raise AutoFeatureError(f"unknown columns {unknown}; the schema's fields are "
                                   f"{', '.join(known)}")
        select = ", ".join(f"approx_count_distinct({ident(c)})" for c in names)
        row = _one(self.run(self.cursor(), f"SELECT {select} FROM {source_sql(files, schema)}",
                            f"measuring cardinalities over {display(files)}", (files, schema)))
        return dict(zip(names, (int(v) for v in row), strict=True))

    def loaded_table(self, tables: FeatureTables, table: FeatureTable) -> str:
        """Name of an in-database copy of ``table``, loaded once and reused by ``apply``.

        Keyed by the file's path, size and mtime, so a rewritten file is loaded afresh.
        """
        path = tables.path(table).resolve()
        stat = path.stat()
        token = hashlib.sha1(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
        con = self.cursor()
        with self._lock:
            if token not in self._loaded:
                name = f"autofeature_{token[:20]}"
                self.run(con, f"CREATE OR REPLACE TABLE {name} AS "
                         f"SELECT * FROM read_parquet({literal(str(path))})",
                         f"loading feature table {table.name} from {path}")
                self._loaded[token] = name
            return self._loaded[token]


def _stdout_is_tty() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


_default_engine: AutoFeatureEngine | None = None
_default_lock = threading.Lock()


def default_engine() -> AutoFeatureEngine:
    """A process-wide engine with DuckDB's default memory limit."""
    global _default_engine
    with _default_lock:
        if _default_engine is None:
            _default_engine = AutoFeatureEngine()
        return _default_engine


def compute_tables(candidates: Sequence[Candidate], train_paths: PathSpec,
                   schema: FeatureSchema, out_dir: str | os.PathLike, *,
                   engine: AutoFeatureEngine | None = None) -> FeatureTables:
    """Aggregate every candidate over the training files only and write its table.

    Only the training range is read, so a feature value never reflects validation or
    serving rows (no leakage). Candidates sharing key columns share one scan. Returns the
    saved ``FeatureTables`` (manifest written last).
    """
    engine = engine or default_engine()
    candidates = validate_candidates(candidates, schema)
    files = expand_paths(train_paths)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = source_sql(files, schema)
    where = display(files)
    by_keys: dict[tuple[str, ...], list[tuple[int, Candidate]]] = {}
    for i, cand in enumerate(candidates):
        by_keys.setdefault(cand.keys, []).append((i, cand))

    con = engine.cursor()
    staged: Path | None = None
    written: dict[int, FeatureTable] = {}
    try:
        if engine.run(con, f"SELECT 1 FROM {source} LIMIT 1",
                      f"reading {where}", (files, schema)).fetchone() is None:
            raise AutoFeatureError(f"training range is empty: {where} holds no rows")
        if len(by_keys) > 1 and schema.format != "parquet" and engine.stage_text:
            # Parsing text dominates a scan: parse once into a columnar copy of just the
            # used columns, which every key set then scans at a fraction of the cost.
            used = list(dict.fromkeys(c for cand in candidates for c in cand.columns))
            staged = engine.scratch_dir() / f"stage-{uuid.uuid4().hex}.parquet"
            engine.run(con, f"COPY (SELECT {', '.join(ident(c) for c in used)} FROM {source})"
                            f" TO {literal(str(staged))} (FORMAT parquet)", f"reading {where}",
                       (files, schema))
            source = f"read_parquet({literal(str(staged))})"
        for keys, group in by_keys.items():
            train_rows, computed = _compute_key_set(
                engine, con, source, keys, group, schema, out, f"over {where}",
                None if staged is not None else (files, schema))
            written.update(computed)
    finally:
        con.close()
        if staged is not None:
            staged.unlink(missing_ok=True)

    tables = FeatureTables(out, tuple(written[i] for i in range(len(candidates))),
                           tuple(files), train_rows)
    return tables.save()


def _compute_key_set(engine: AutoFeatureEngine, con: duckdb.DuckDBPyConnection, source: str,
                     keys: tuple[str, ...], group: list[tuple[int, Candidate]],
                     schema: FeatureSchema, out: Path, where: str,
                     inputs: Inputs | None = None) -> tuple[int, dict[int, FeatureTable]]:
    """One scan grouped by ``keys`` computing every candidate of ``group``; one file each.

    Returns the number of rows scanned and the written tables by candidate index.
    """
    key_types = tuple(key_type(schema, k) for k in keys)
    key_select = ", ".join(f"CAST({ident(k)} AS {t}) AS {ident(k)}"
                           for k, t in zip(keys, key_types, strict=True))
    aggregates = ", ".join(f"{_aggregate_sql(c)} AS v{i}" for i, c in group)
    engine.run(con, f"CREATE OR REPLACE TEMP TABLE autofeature_agg AS "
                    f"SELECT {key_select}, count(*) AS n, {aggregates} "
                    f"FROM {source} GROUP BY ALL",
               f"computing {', '.join(c.name for _, c in group)} {where}", inputs)
    rows_scanned = int(_one(con.execute("SELECT sum(n) FROM autofeature_agg"))[0])
    key_cols = ", ".join(ident(k) for k in keys)
    written = {}
    for i, cand in group:
        file = table_file_name(i, cand)
        # Groups whose values were all missing have no aggregate: leave them out, so they
        # join like unseen keys.
        present = f"FROM autofeature_agg WHERE v{i} IS NOT NULL"
        copy_to_parquet(engine, con, f"SELECT {key_cols}, v{i} AS {VALUE_COLUMN} {present}",
                        out / file, f"writing {cand.name}")
        rows, vmin, vmax = _one(con.execute(f"SELECT count(*), min(v{i}), max(v{i}) {present}"))
        written[i] = FeatureTable(cand, file, key_types, int(rows),
                                  None if vmin is None else float(vmin),
                                  None if vmax is None else float(vmax))
    con.execute("DROP TABLE autofeature_agg")
    return rows_scanned, written


def _one(cursor: duckdb.DuckDBPyConnection) -> tuple[Any, ...]:
    """The one row an aggregate query returns."""
    row = cursor.fetchone()
    if row is None:
        raise AutoFeatureError("an aggregate query returned no row")
    return row


def _aggregate_sql(cand: Candidate) -> str:
    if cand.is_count:
        return "count(*)"
    if cand.value_column is None:
        raise AutoFeatureError(f"{cand.name}: no value column to aggregate")
    # Doubles throughout: a BIGINT sum would be HUGEINT, which Parquet does not hold.
    return f"CAST({cand.agg}({ident(cand.value_column)}) AS DOUBLE)"


def copy_to_parquet(engine: AutoFeatureEngine, con: duckdb.DuckDBPyConnection, query: str,
                    path: Path, what: str, inputs: Inputs | None = None) -> None:
    """COPY ``query`` to Parquet at ``path`` via a temp file, fsync and rename."""
    with atomic_path(path) as tmp:
        engine.run(con, f"COPY ({query}) TO {literal(str(tmp))} (FORMAT parquet)", what,
                   inputs)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _summary(exc: BaseException) -> str:
    """DuckDB's message without its long advice and echoed SQL: the error, the line and
    the file."""
    lines = [ln.strip() for ln in str(exc).splitlines()
             if ln.strip().strip("^") and not ln.startswith("LINE ")]
    keep = lines[:3]
    keep += [ln for ln in lines[3:] if ln.startswith("file =")]
    return "; ".join(keep)
