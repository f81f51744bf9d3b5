"""Materialised feature tables: one Parquet file per candidate plus a JSON manifest.

A directory of them travels with an exported model, so serving joins the very numbers
training joined. The manifest is written last and atomically: a reader sees either the
previous complete set or the new one.

    <dir>/manifest.json            {"version": 1, "tables": [{"name": "count(C3)", ...}]}
    <dir>/000-count_C3.parquet     C3 VARCHAR | value BIGINT
    <dir>/001-max_I5_by_C3.parquet C3 VARCHAR | value DOUBLE
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from terarec.autofeature.candidates import AutoFeatureError, Candidate
from terarec.io import atomic_open, atomic_write_text
from terarec.types import FeatureSchema, FieldSpec

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
VALUE_COLUMN = "value"


def table_file_name(index: int, candidate: Candidate) -> str:
    """A file-system-safe, ordered file name for a candidate's table."""
    return f"{index:03d}-{re.sub(r'[^A-Za-z0-9]+', '_', candidate.name).strip('_')}.parquet"


@dataclass(frozen=True)
class FeatureTable:
    """One candidate's aggregate: ``keys`` columns of ``key_types`` and a ``value`` column."""

    candidate: Candidate
    file: str
    key_types: tuple[str, ...]
    rows: int
    value_min: float | None
    value_max: float | None

    @property
    def name(self) -> str:
        return self.candidate.name

    def field_spec(self, source_transform: str = "none") -> FieldSpec:
        """The field this table adds: a categorical count bucket or a numeric aggregate.

        Aggregates keep their source field's ``source_transform`` (log1p); a sum of
        non-negative values grows with the group size, so it gets log1p as well. Negative
        values rule log1p out.
        """
        if self.candidate.is_count:
            return FieldSpec(self.name, "categorical")
        non_negative = self.value_min is not None and self.value_min >= 0
        wants_log = source_transform == "log1p" or self.candidate.agg == "sum"
        return FieldSpec(self.name, "numeric",
                         transform="log1p" if non_negative and wants_log else "none")

    def to_dict(self) -> dict:
        return {"name": self.name, **self.candidate.to_dict(), "file": self.file,
                "key_types": list(self.key_types), "rows": self.rows,
                "value_min": self.value_min, "value_max": self.value_max}

    @classmethod
    def from_dict(cls, d: dict) -> FeatureTable:
        cand = Candidate.from_dict(d)
        if d.get("name", cand.name) != cand.name:
            raise AutoFeatureError(f"manifest entry {d['name']!r} does not match {cand.name!r}")
        return cls(cand, d["file"], tuple(d["key_types"]), int(d["rows"]), d["value_min"],
                   d["value_max"])


@dataclass(frozen=True)
class FeatureTables:
    """The feature tables computed from one training range, stored under ``directory``."""

    directory: Path
    tables: tuple[FeatureTable, ...]
    train_paths: tuple[str, ...] = ()
    train_rows: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tables)

    def __len__(self) -> int:
        return len(self.tables)

    def __getitem__(self, name: str) -> FeatureTable:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"no feature table {name!r}; have {', '.join(self.names)}")

    def path(self, table: FeatureTable) -> Path:
        return self.directory / table.file

    def select(self, names: Iterable[str]) -> FeatureTables:
        """The subset named (e.g. those kept by validation), same files, same order."""
        wanted = list(names)
        unknown = [n for n in wanted if n not in self.names]
        if unknown:
            raise AutoFeatureError(f"unknown feature tables {unknown}; have {list(self.names)}")
        keep = set(wanted)
        return replace(self, tables=tuple(t for t in self.tables if t.name in keep))

    # -- persistence --------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"version": MANIFEST_VERSION, "train_paths": list(self.train_paths),
                "train_rows": self.train_rows, "tables": [t.to_dict() for t in self.tables]}

    def save(self, directory: str | os.PathLike | None = None) -> FeatureTables:
        """Write the manifest (and, for another directory, copies of the tables) atomically.

        Returns the tables as stored in ``directory``.
        """
        target = Path(directory) if directory is not None else self.directory
        target.mkdir(parents=True, exist_ok=True)
        if target.resolve() != self.directory.resolve():
            for t in self.tables:
                with open(self.path(t), "rb") as src, atomic_open(target / t.file) as dst:
                    shutil.copyfileobj(src, dst, length=1 << 20)
        atomic_write_text(target / MANIFEST, json.dumps(self.to_dict(), indent=2))
        return replace(self, directory=target)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> FeatureTables:
        directory = Path(directory)
        manifest = directory / MANIFEST
        try:
            with open(manifest) as fh:
                d = json.load(fh)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no feature tables at {directory}: {MANIFEST} missing") from None
        except json.JSONDecodeError as exc:
            raise AutoFeatureError(f"{manifest}: not valid JSON ({exc})") from exc
        if d.get("version") != MANIFEST_VERSION:
            raise AutoFeatureError(
                f"{manifest}: version {d.get('version')!r}, expected {MANIFEST_VERSION}"
            )
        tables = tuple(FeatureTable.from_dict(t) for t in d["tables"])
        for t in tables:
            if not (directory / t.file).is_file():
                raise FileNotFoundError(f"{manifest}: table {t.name} file {t.file} is missing")
        return cls(directory, tables, tuple(d.get("train_paths", ())),
                   int(d.get("train_rows", 0)))


def extend_schema(schema: FeatureSchema, tables: FeatureTables | Sequence[FeatureTable]
                  ) -> FeatureSchema:
    """``schema`` plus the fields ``tables`` add, describing the Parquet ``apply_file`` writes."""
    transforms = {f.name: f.transform for f in schema.fields}
    specs = tuple(t.field_spec(transforms.get(t.candidate.value_column or "", "none"))
                  for t in (tables.tables if isinstance(tables, FeatureTables) else tables))
    taken = {f.name for f in schema.fields} | set(schema.column_names) | {schema.label}
    clash = [s.name for s in specs if s.name in taken]
    if clash:
        raise AutoFeatureError(f"feature names {clash} already name columns of the schema")
    column_names = schema.column_names + tuple(s.name for s in specs) if schema.column_names \
        else ()
    return replace(schema.with_fields(specs), format="parquet", column_names=column_names,
                   has_header=True)
