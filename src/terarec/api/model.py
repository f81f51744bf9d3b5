"""``Model``: a trained model directory as a Python object (``terarec.load``).

It scores files, pyarrow Tables, pandas DataFrames or dicts of columns with the
schema the model was trained with, evaluates labelled data and exports versions for
serving: what ``terarec predict``, ``eval`` and ``export`` do, as calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from terarec.config import TrainConfig
from terarec.data.readers import ReadStats
from terarec.data.spec import DataSpec
from terarec.io import ScratchDir, file_above
from terarec.types import FeatureSchema

if TYPE_CHECKING:
    from terarec.train.trainer import Trainer

# Where data may come from: file path(s), or an in-memory table with the training
# columns (pyarrow Table, pandas DataFrame, or a dict of column name -> values).
Data = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Any
OnBadRow = Literal["error", "skip"]
SCRATCH_DIR = ".scratch"  # inside a model directory: private folders of scoring runs


class Model:
    """A trained model directory and one of its checkpoints (``best`` by default: the
    validation set's best, else the newest; ``latest``; or ``pass-N``)."""

    def __init__(self, path: str | os.PathLike[str], checkpoint: str = "best") -> None:
        self.path = Path(path)
        self.checkpoint = checkpoint

    @functools.cached_property
    def schema(self) -> FeatureSchema:
        """The feature schema the model was trained with (``schema.json``)."""
        return self._meta[0]

    @property
    def task_names(self) -> tuple[str, ...]:
        """The labels the model scores, one task each (one for most models; the columns
        of ``predict``'s ``[rows, T]`` for a multi-task model)."""
        return self.schema.task_names

    @functools.cached_property
    def config(self) -> TrainConfig:
        """The ``TrainConfig`` the model was trained with (``train_config.json``)."""
        return self._meta[1]

    @functools.cached_property
    def _meta(self) -> tuple[FeatureSchema, TrainConfig]:
        from terarec.modeldir import read_model_meta

        return read_model_meta(self.path)

    def __repr__(self) -> str:
        return (f"Model({str(self.path)!r}, checkpoint={self.checkpoint!r}, "
                f"model={self.config.model.name!r})")

    # -- what the run wrote ------------------------------------------------------------
    @property
    def metrics(self) -> dict[str, Any]:
        """``metrics.json``: the selected pass's validation scores, why training stopped,
        rows, speed (empty before a run finished)."""
        return _read_json(self.path / "metrics.json", {})

    @property
    def history(self) -> list[dict[str, Any]]:
        """``history.json``: one record per evaluated pass."""
        return _read_json(self.path / "history.json", [])

    def trained_on(self, files: Sequence[str | os.PathLike[str]]) -> list[str]:
        """Those of ``files`` whose rows this model trained on (the same content as an
        input recorded in ``inputs.json``, under any path): their scores are in-sample."""
        from terarec.data.positions import fingerprint

        seen = {(f["size"], f["sha256"]) for f in _read_json(
            self.path / "inputs.json", {}).get("files", []) if f.get("trained")}
        return [str(p) for p in files if Path(p).is_file() and fingerprint(Path(p)) in seen]

    # -- scoring -----------------------------------------------------------------------
    def predict(self, data: Data, *, format: str | None = None, delimiter: str | None = None,
                on_bad_row: OnBadRow = "error") -> np.ndarray:
        """Click probabilities, one per row of ``data`` in order (a label column is not
        needed); ``[rows, T]`` for a model of several labels, one column per task in
        ``task_names`` order. With ``on_bad_row="skip"`` a skipped row gets NaN, so row i of the
        result still answers row i of the data."""
        from terarec.finite import check_model_scores

        out: list[np.ndarray] = []
        with self._scoring(data, format, delimiter, on_bad_row) as (trainer, schema, files):
            from terarec.data.readers import iter_batches

            total = ReadStats()
            for path in files:
                stats = ReadStats(skipped_at=[] if on_bad_row == "skip" else None)
                batches = iter_batches(path, schema, trainer.config.batch_size,
                                       on_bad_row=on_bad_row, stats=stats, with_label=False)
                scores = []
                for probs, _ in trainer.predict_stream(batches):
                    check_model_scores(probs, str(self.path))
                    scores.append(probs)
                got = np.concatenate(scores) if scores else np.zeros(0, np.float64)
                out.append(_with_gaps(got, stats, first_data_row(path, schema)))
                total.rows += stats.rows
                total.skipped += stats.skipped
                total.examples += stats.examples[:total.max_examples - len(total.examples)]
            check_rows_scored(files, total)
        return np.concatenate(out)

    def evaluate(self, data: Data, *, format: str | None = None,
                 delimiter: str | None = None, on_bad_row: OnBadRow = "error"
                 ) -> dict[str, Any]:
        """AUC, logloss and rows on labelled ``data`` (``skipped_rows`` too); the AUC is
        None where it is undefined (every label the same class). ``in_sample`` names the
        files the model trained on (a refit trains on the validation files too), whose
        scores say little about new rows; a warning says so."""
        from terarec.train.passes import iter_file_batches

        in_sample = self.trained_on(_paths_of(data))
        if in_sample:
            warnings.warn(in_sample_warning(self.path, in_sample), stacklevel=2)

        with self._scoring(data, format, delimiter, on_bad_row) as (trainer, schema, files):
            stats = ReadStats()
            batches = iter_file_batches(files, schema, trainer.config.batch_size,
                                        on_bad_row=on_bad_row, stats=stats)
            metrics: dict[str, Any] = {**trainer.evaluate(batches)}
            check_rows_scored(files, stats)
        metrics["skipped_rows"] = stats.skipped
        metrics["in_sample"] = in_sample
        for key in [k for k in metrics if k == "auc" or k.startswith("auc_")]:
            auc = metrics[key]  # a task's AUC too, with several labels
            if auc is not None and not math.isfinite(auc):
                metrics[key] = None
        return metrics

    def export(self, uri: str, *, bits: int = 32, codebook: bool = False,
               shard_rows: int | None = None, slice: str | None = None,
               keys_from: Sequence[str | os.PathLike[str]] = (),
               storage_options: dict[str, Any] | None = None,
               delta: bool = False) -> dict[str, Any]:
        """Write this checkpoint as a full version under ``uri`` (a folder or an fsspec
        URL) for ``terarec serve``: rows as fp32, fp16 or 8/4/2/1-bit codes, or only a
        ``slice`` (``user_tower`` / ``item_tower``, ``wide`` / ``deep``, or a field list)
        carrying the keys of ``keys_from`` files. ``delta``: a delta on ``uri``'s newest
        version instead (fp32; the rows new or changed since it, the keys gone, the dense
        weights), which a running server applies live. Returns what was written."""
        from terarec.export.format import DEFAULT_SHARD_ROWS
        from terarec.export.target import check_export_target

        rows = DEFAULT_SHARD_ROWS if shard_rows is None else shard_rows
        if Path(uri).is_file():
            raise ValueError(f"--out {uri} is a file, not an export folder")
        check_export_target(uri, storage_options, "--out")
        if rows < 1:
            raise ValueError(f"--shard-rows {rows}: must be >= 1")
        if delta:
            if slice is not None:
                raise ValueError("--delta: a slice exported again to the same --out is a "
                                 "delta already; leave out --delta")
            if bits != 32 or codebook:
                raise ValueError("--delta writes fp32 rows; leave out --bits / --codebook")
            from terarec.export.delta import export_model_delta

            written = export_model_delta(self.path, uri, storage_options, shard_rows=rows,
                                         checkpoint=self.checkpoint)
            return {"uri": uri, **asdict(written)}
        if slice is not None:
            if bits != 32 or codebook:
                raise ValueError("--slice writes fp32 rows; leave out --bits / --codebook")
            from terarec.retrieval.slices import export_slice

            result = export_slice(self.path, uri, slice, [Path(p) for p in keys_from],
                                  storage_options=storage_options, shard_rows=rows,
                                  checkpoint=self.checkpoint)
            return {"uri": uri, "slice": slice, **asdict(result)}
        if keys_from:
            raise ValueError("--keys-from goes with --slice")
        from terarec.export.compressed import CODEBOOK_BITS, RowCodec
        from terarec.export.writer import export_model_dir

        if bits not in (32, 16, 8, 4, 2, 1):
            raise ValueError(f"--bits {bits}: one of 32, 16, 8, 4, 2, 1")
        if codebook and bits not in CODEBOOK_BITS:
            raise ValueError(f"--codebook takes --bits {', '.join(map(str, CODEBOOK_BITS))}, "
                             f"got --bits {bits}")
        codec = None if bits == 32 and not codebook else RowCodec(bits, codebook)
        written = export_model_dir(self.path, uri, storage_options, shard_rows=rows,
                                   codec=codec, checkpoint=self.checkpoint)
        return {"uri": uri, **asdict(written)}

    @contextlib.contextmanager
    def _scoring(self, data: Data, format: str | None, delimiter: str | None,
                 on_bad_row: str) -> Iterator[tuple[Trainer, FeatureSchema, list[Path]]]:
        """(trainer holding the checkpoint, the schema to read with, the files to read);
        in-memory tables are written to a temporary Parquet file first."""
        if on_bad_row not in ("error", "skip"):
            raise ValueError(f"on_bad_row {on_bad_row!r}: one of error, skip")
        with _as_files(data, format) as (files, fmt), self.scoring_files(
                files, DataSpec.of(format=fmt, delimiter=delimiter), on_bad_row) as scored:
            yield scored

    @contextlib.contextmanager
    def scoring_files(self, files: Sequence[Path], spec: DataSpec, on_bad_row: str
                      ) -> Iterator[tuple[Trainer, FeatureSchema, list[Path]]]:
        """(trainer holding the checkpoint, the schema to read ``files`` with, the files
        to read). Files named ``.parquet`` are read as Parquet unless ``spec`` says
        otherwise. A model trained with AutoFeature tables has them joined onto the raw
        rows first, so new rows get exactly the features training computed."""
        from terarec.autofeature.features import model_features, model_inputs
        from terarec.modeldir import checkpoint_name
        from terarec.train.trainer import Trainer

        if spec.format is None and files and all(
                Path(f).suffix.lower() == ".parquet" for f in files):
            spec = dataclasses.replace(spec, format="parquet")  # the extension says so
        features = model_features(self.path)
        if on_bad_row == "skip" and features and features.tables.tables:
            raise ValueError(f"--on-bad-row skip: {self.path} was trained with AutoFeature "
                             "tables, whose join reads every row first and stops at the "
                             "first bad one; clean the files (the error names the row)")
        with scoring_scratch(self.path) as scratch:
            trainer = Trainer.from_checkpoint(self.path, scratch_dir=scratch,
                                              name=checkpoint_name(self.path, self.checkpoint))
            with model_inputs(self.path, trainer.schema, list(files),
                              spec.for_model) as (schema, read):
                yield trainer, schema, list(read)


def load(path: str | os.PathLike[str], checkpoint: str = "best") -> Model:
    """The model in directory ``path`` (written by ``terarec.fit`` or ``terarec
    train``), at ``checkpoint``: ``best``, ``latest`` or ``pass-N``; a path that is no
    model directory, or a checkpoint it does not hold, is an error here."""
    from terarec.modeldir import checkpoint_name

    model = Model(path, checkpoint)
    model.config  # noqa: B018  (reads schema.json and train_config.json, or says why not)
    checkpoint_name(model.path, checkpoint)
    return model


def in_sample_warning(model_dir: Path, files: Sequence[str]) -> str:
    """The one line said when scored rows are rows the model trained on."""
    return (f"{', '.join(files)}: {model_dir} was trained on these rows (a refit trains "
            "on the validation files too): the scores are in-sample, not a measure of "
            "new data")


def _paths_of(data: Data) -> list[Path]:
    if isinstance(data, str | os.PathLike):
        return [Path(data)]
    if isinstance(data, Sequence) and all(isinstance(p, str | os.PathLike) for p in data):
        return [Path(p) for p in data]
    return []


def check_output_path(out: str | os.PathLike[str] | None) -> None:
    """An output file's path, checked before any row is scored: a folder there (or a
    file above it) failed only once every row was scored."""
    if out is None:
        return
    if Path(out).is_dir():
        raise ValueError(f"--out {out} is a folder, not a file")
    if (above := file_above(Path(out))) is not None:
        raise ValueError(f"--out {out}: {above} is a file, not a folder")


def check_rows_scored(paths: Sequence[Path], stats: ReadStats) -> None:
    """An error naming the files when they held no row to score."""
    if not stats.rows:
        files = ", ".join(str(p) for p in paths)
        if stats.skipped:
            raise ValueError(f"no rows to score in {files}: all {stats.skipped} rows read "
                             f"were bad and skipped (--on-bad-row skip); first: "
                             f"{stats.examples[0]}")
        raise ValueError(f"no rows to score in {files}: the files hold no data rows")


@contextlib.contextmanager
def scoring_scratch(model_dir: Path) -> Iterator[Path]:
    """A private folder for a scoring run's tiered store, inside the model directory so
    that a run killed with -9 leaves nothing elsewhere (the next run removes it); in the
    temp folder when the model directory is read-only. Removed on exit."""
    try:
        if not (model_dir / "schema.json").is_file():  # not a model: leave it untouched
            raise NotADirectoryError(model_dir)
        scratch = ScratchDir(model_dir / SCRATCH_DIR, "store")
    except OSError:
        scratch = ScratchDir(tempfile.gettempdir(), "terarec-store")
    with scratch as path:
        yield path


def first_data_row(path: Path, schema: FeatureSchema) -> int:
    """The number ``ReadStats.skipped_at`` gives a file's first data row: its line (after
    a header line, if any) in a text file, row 1 in a Parquet file."""
    from terarec.data.readers import text_columns

    if schema.format == "parquet":
        return 1
    return 1 + text_columns(path, schema, with_label=False)[1]


def _with_gaps(scores: np.ndarray, stats: ReadStats, first: int) -> np.ndarray:
    """``scores`` with NaN at the places of skipped rows, so row i answers data row i."""
    if not stats.skipped_at:
        return scores
    gaps = np.asarray(sorted(stats.skipped_at), dtype=np.int64) - first
    out = np.full((len(scores) + len(gaps), *scores.shape[1:]), np.nan)
    keep = np.ones(len(out), dtype=bool)
    keep[gaps] = False
    out[keep] = scores
    return out


@contextlib.contextmanager
def _as_files(data: Data, format: str | None) -> Iterator[tuple[list[Path], str | None]]:
    """(files, format) holding ``data``: paths as given, an in-memory table written to
    one temporary Parquet file (removed on exit)."""
    if isinstance(data, str | os.PathLike):
        yield [Path(data)], format
        return
    if isinstance(data, Sequence) and data and all(
            isinstance(p, str | os.PathLike) for p in data):
        yield [Path(p) for p in data], format
        return
    table = _arrow_table(data)
    if format not in (None, "parquet"):
        raise ValueError(f"format {format!r}: an in-memory table is read as its columns; "
                         "leave format out")
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory(prefix="terarec-data-") as tmp:
        path = Path(tmp) / "data.parquet"
        pq.write_table(table, path)
        yield [path], "parquet"


def _arrow_table(data: Any) -> Any:
    """A pyarrow Table from a Table, a pandas DataFrame or a dict of columns."""
    import pyarrow as pa

    if isinstance(data, pa.Table):
        return data
    if isinstance(data, dict):
        return pa.table(data)
    if type(data).__name__ == "DataFrame" and hasattr(data, "to_numpy"):  # pandas
        return pa.Table.from_pandas(data, preserve_index=False)
    raise TypeError(f"data: expected a file path, a list of paths, a pyarrow Table, a "
                    f"pandas DataFrame or a dict of columns, got {type(data).__name__}")


def _read_json(path: Path, empty: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return empty
