"""The feature config that training, evaluation and serving all read.

``terarec autofeature`` writes one; ``terarec train --features`` copies it into the model
directory, so a model carries the exact tables it was trained with::

    features.json               {"version": 1, "base_schema": {...}, "tables": "features.tables",
                                 "selected": ["count(C3)", ...], "selection": {...}}
    features.tables/            manifest.json + one Parquet file per selected feature

    model_dir/features/features.json   the same config, "tables": "."
    model_dir/features/*.parquet       the selected tables

Raw rows (files or request records) are read with ``base_schema``, joined with the tables,
and the model sees ``schema`` = the base fields plus one field per table.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from terarec.autofeature.candidates import AutoFeatureError
from terarec.autofeature.engine import AutoFeatureEngine
from terarec.autofeature.tables import FeatureTables, extend_schema
from terarec.autofeature.transform import apply_file
from terarec.data.positions import InputFile, fingerprint, input_key
from terarec.io import atomic_write_text
from terarec.types import FeatureSchema

CONFIG_VERSION = 1
MODEL_FEATURES_DIR = "features"
CONFIG_FILE = "features.json"


@dataclass(frozen=True)
class FeatureConfig:
    """Selected feature tables and the raw schema they are applied to."""

    base_schema: FeatureSchema
    tables: FeatureTables
    selection: dict = field(default_factory=dict)

    @property
    def selected(self) -> tuple[str, ...]:
        return self.tables.names

    @property
    def schema(self) -> FeatureSchema:
        """What the model is trained on: the base fields plus one field per table (read
        from the Parquet that ``augment`` writes), or just the base schema if none."""
        return extend_schema(self.base_schema, self.tables) if self.tables.tables \
            else self.base_schema

    def save(self, path: str | os.PathLike, tables_dir: str | os.PathLike | None = None
             ) -> FeatureConfig:
        """Write the config to ``path`` and the tables to ``tables_dir`` (default: beside
        it, ``<stem>.tables``); returns the config as stored there."""
        path = Path(path)
        target = Path(tables_dir) if tables_dir is not None else \
            path.with_name(path.stem + ".tables")
        stored = self.tables.save(target)
        rel = os.path.relpath(target.resolve(), path.parent.resolve())
        body = {"version": CONFIG_VERSION, "base_schema": self.base_schema.to_dict(),
                "tables": rel, "selected": list(stored.names), "selection": self.selection}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(body, indent=2))
        return FeatureConfig(self.base_schema, stored, self.selection)

    @classmethod
    def load(cls, path: str | os.PathLike) -> FeatureConfig:
        path = Path(path)
        try:
            with open(path) as fh:
                body = json.load(fh)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such feature config") from None
        except json.JSONDecodeError as exc:
            raise AutoFeatureError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(body, dict) or body.get("version") != CONFIG_VERSION:
            raise AutoFeatureError(f"{path}: not a version {CONFIG_VERSION} feature config")
        missing = [k for k in ("base_schema", "tables", "selected") if k not in body]
        if missing:
            raise AutoFeatureError(f"{path}: feature config lacks {missing}")
        tables = FeatureTables.load(path.parent / body["tables"])
        if list(tables.names) != list(body["selected"]):
            raise AutoFeatureError(f"{path}: selected {body['selected']} do not match the "
                                   f"tables in {tables.directory} ({list(tables.names)})")
        try:
            base = FeatureSchema.from_dict(body["base_schema"], f"{path}: base_schema")
        except ValueError as exc:
            raise AutoFeatureError(str(exc)) from None
        return cls(base, tables, body.get("selection", {}))

    def augment(self, paths: Sequence[str | os.PathLike], out_dir: str | os.PathLike, *,
                schema: FeatureSchema | None = None,
                engine: AutoFeatureEngine | None = None) -> list[Path]:
        """Each raw file of ``paths`` (read with ``schema``, default the base schema) joined
        with the tables into a Parquet file under ``out_dir``; the paths, in order."""
        out_dir = Path(out_dir)
        return [self.augment_file(p, out_dir / f"{i:04d}-{Path(p).stem}.parquet",
                                  schema=schema, engine=engine)
                for i, p in enumerate(paths)]

    def augment_file(self, path: str | os.PathLike, out: str | os.PathLike, *,
                     schema: FeatureSchema | None = None,
                     engine: AutoFeatureEngine | None = None) -> Path:
        """One raw file (read with ``schema``, default the base schema) joined with the
        tables into the Parquet file ``out``, its rows in the file's order."""
        return apply_file(self.tables, path, schema or self.base_schema, out, engine=engine)


def install_features(model_dir: str | os.PathLike, config: FeatureConfig) -> FeatureConfig:
    """Copy ``config`` and its tables into ``model_dir/features``; returns the copy."""
    target = Path(model_dir) / MODEL_FEATURES_DIR
    return config.save(target / CONFIG_FILE, tables_dir=target)


def model_features(model_dir: str | os.PathLike) -> FeatureConfig | None:
    """The feature config a model was trained with, or None for a model without one."""
    path = Path(model_dir) / MODEL_FEATURES_DIR / CONFIG_FILE
    return FeatureConfig.load(path) if path.exists() else None


@contextlib.contextmanager
def feature_inputs(config: FeatureConfig | None, paths: Sequence[str | os.PathLike], *,
                   schema: FeatureSchema | None = None,
                   engine: AutoFeatureEngine | None = None) -> Iterator[list[Path]]:
    """``paths`` as the model reads them: augmented copies (removed on exit) when
    ``config`` has tables, else the paths themselves.

    The copies hold every raw column plus the features, so they need about as much disk
    as the inputs; DuckDB streams them and spills to its temp dir, not to memory.
    """
    if config is None or not config.tables.tables or not paths:
        yield [Path(p) for p in paths]
        return
    with tempfile.TemporaryDirectory(prefix="terarec-features-") as tmp:
        yield config.augment(paths, tmp, schema=schema, engine=engine)


def keyed_copies(raws: Sequence[str | os.PathLike], copies: Sequence[Path]
                 ) -> list[InputFile]:
    """Joined ``copies`` as training inputs named by the raw files they were made from:
    checkpoints record each raw file's key and fingerprint, so a resumed run, whose
    copies are made again in another temporary folder, reads on from its row positions
    (keyed by the copies' paths, it found none and trained every row again)."""
    return [InputFile(input_key(Path(raw)), copy, fingerprint=fingerprint(Path(raw)))
            for raw, copy in zip(raws, copies, strict=True)]


@contextlib.contextmanager
def model_inputs(model_dir: str | os.PathLike, model_schema: FeatureSchema,
                 paths: Sequence[str | os.PathLike],
                 read_as: Callable[[FeatureSchema], FeatureSchema] = lambda s: s,
                 ) -> Iterator[tuple[FeatureSchema, list[Path]]]:
    """(schema, paths) to read ``paths`` with for the model in ``model_dir``.

    A model trained with features gets the raw files joined with its own tables (read
    with ``read_as(base schema)``, e.g. another container format), and its own schema;
    any other model gets ``read_as(model_schema)`` and the files themselves.
    """
    features = model_features(model_dir)
    if features is None:
        yield read_as(model_schema), [Path(p) for p in paths]
        return
    with feature_inputs(features, paths, schema=read_as(features.base_schema)) as augmented:
        yield (model_schema if features.tables.tables else read_as(model_schema)), augmented
