"""``DataSpec``: how a training or scoring file's columns are read, as one typed value.

The command line's format flags (``--format``, ``--label``, ``--numeric`` ...) and the
Python API's keywords both build a ``DataSpec``; the schema a model trains with comes
from it in one place, so the two cannot read the same file differently.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from terarec.data.numeric import DEFAULT_STATS_ROWS, with_numeric_stats
from terarec.data.sequences import parse_sequence
from terarec.types import FeatureSchema, NumericTransform

Format = Literal["criteo", "csv", "parquet"]
FORMATS: tuple[Format, ...] = ("criteo", "csv", "parquet")
Buckets = int | Literal["log", "tested"]


def names(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """Column names given as ``"a,b"`` or ``["a", "b"]``."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(str(c).strip() for c in items if str(c).strip())


@dataclass(frozen=True)
class DataSpec:
    """The columns of the input files and how numeric ones are prepared.

    ``format`` None means "not said": Criteo for a new model, the model's own format
    when scoring. ``multi_valued`` and ``log1p`` None mean "not given" (every
    categorical column is multi-valued when ``multi_sep`` is set; every numeric column
    gets ``numeric_transform``)."""

    format: Format | None = None
    label: str | None = None
    numeric: tuple[str, ...] = ()
    categorical: tuple[str, ...] = ()
    delimiter: str | None = None
    multi_sep: str | None = None
    multi_valued: tuple[str, ...] | None = None
    log1p: tuple[str, ...] | None = None
    numeric_transform: NumericTransform | None = None
    standardize: bool = True
    stats_rows: int = DEFAULT_STATS_ROWS
    numeric_buckets: Buckets | None = None
    # ``COL[:max_len]`` sequence columns and ``FIELD=TABLE`` shared tables
    # (``terarec.data.sequences``).
    sequences: tuple[str, ...] = ()
    share_tables: tuple[str, ...] = ()
    label_weights: tuple[float, ...] | None = None

    @classmethod
    def of(cls, **given: Any) -> DataSpec:
        """A spec from keywords as a user writes them (column lists as ``"a,b"`` or a
        list); an unknown keyword is a TypeError naming it."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(given) - known)
        if unknown:
            raise TypeError(f"unknown data setting(s) {', '.join(unknown)}; known: "
                            f"{', '.join(sorted(known))}")
        for key in ("numeric", "categorical", "sequences", "share_tables"):
            if key in given:
                given[key] = names(given[key])
        for key in ("multi_valued", "log1p"):
            if given.get(key) is not None:
                given[key] = names(given[key])
        if given.get("label") is not None and not isinstance(given["label"], str):
            given["label"] = ",".join(str(c) for c in given["label"])
        if given.get("label_weights") is not None:
            given["label_weights"] = tuple(float(w) for w in given["label_weights"])
        if given.get("format") is not None and given["format"] not in FORMATS:
            raise ValueError(f"format {given['format']!r} is not one of {', '.join(FORMATS)}")
        return cls(**given)

    def describes_columns(self) -> bool:
        """Whether any format or column setting was given (a resumed run compares them
        with the model's own)."""
        return any(v not in (None, (), "") for v in (
            self.format, self.label, self.numeric, self.categorical, self.delimiter,
            self.multi_sep, self.multi_valued, self.log1p, self.numeric_transform,
            self.sequences, self.share_tables))

    def labels(self) -> tuple[tuple[str, ...], tuple[float, ...]]:
        """The label columns and their loss weights (empty: 1 each): ``--label`` is one
        column, or several as ``click:1,conversion:0.5`` (one task each, weight 1 where
        none is written); ``label_weights`` gives the weights as a list instead."""
        return parse_labels(self.label, self.label_weights)

    # -- the schema of a new model --------------------------------------------------
    def schema(self) -> FeatureSchema:
        """The schema these columns make, before numeric statistics; a contradictory or
        missing setting is a ValueError naming its flag."""
        fmt = self.format or "criteo"
        if fmt == "criteo":
            return self._criteo_schema()
        if not self.label or not (self.numeric or self.categorical):
            raise ValueError(f"--format {fmt} needs --label and --numeric and/or --categorical")
        check_delimiter_for(self.delimiter, fmt)
        default: NumericTransform = self.numeric_transform or "log1p"
        transform: dict[str, NumericTransform] = {c: default for c in self.numeric}
        if self.log1p is not None:  # an explicit list: those columns, and no others
            if self.numeric_transform is not None:
                raise ValueError("--log1p and --numeric-transform both say how to transform "
                                 "numeric columns; give one of them")
            unknown = sorted(set(self.log1p) - set(self.numeric))
            if unknown:
                raise ValueError(f"--log1p names columns that are not --numeric: {unknown}")
            transform = {c: ("log1p" if c in self.log1p else "none") for c in self.numeric}
        labels, weights = self.labels()
        _check_columns(list(labels), list(self.numeric), list(self.categorical),
                       self.multi_valued)
        from terarec.data.readers import csv_schema  # pyarrow: not for --help
        from terarec.data.sequences import with_sequences

        seq_cols = [c for c, _ in map(parse_sequence, self.sequences)]
        categorical = (*self.categorical, *(c for c in seq_cols if c not in self.categorical))
        multi = self.multi_valued
        if multi is not None or (self.sequences and self.multi_sep is None):
            multi = (*(multi or ()), *(c for c in seq_cols if c not in (multi or ())))
        schema = csv_schema(labels[0], self.numeric, categorical,
                          delimiter=self.delimiter if self.delimiter is not None else ",",
                          separator=self.multi_sep,
                          multi_valued=list(multi) if multi is not None else None,
                          transform=transform, format=fmt)
        schema = with_sequences(schema, self.sequences, self.share_tables)
        if len(labels) == 1:
            return schema
        return replace(schema, extra_labels=labels[1:], label_weights=weights)

    def _criteo_schema(self) -> FeatureSchema:
        """The Criteo schema; its columns are fixed, so a setting naming columns is an
        error rather than ignored. ``numeric_transform`` applies to its I1-I13."""
        if given := self._column_settings(with_delimiter=True):
            raise ValueError(f"{', '.join(given)}: only for --format csv or parquet; the "
                             "Criteo format's columns are fixed (label, I1-I13, C1-C26)")
        schema = FeatureSchema.criteo()
        if self.numeric_transform is None:
            return schema
        return replace(schema, fields=tuple(
            replace(f, transform=self.numeric_transform) if f.kind == "numeric" else f
            for f in schema.fields))

    def _column_settings(self, *, with_delimiter: bool) -> list[str]:
        """The flags of the column settings given (each names columns or their split)."""
        given = [("--label", self.label is not None), ("--numeric", bool(self.numeric)),
                 ("--categorical", bool(self.categorical)),
                 ("--delimiter", with_delimiter and self.delimiter is not None),
                 ("--multi-sep", self.multi_sep is not None),
                 ("--multi-valued", self.multi_valued is not None),
                 ("--log1p", self.log1p is not None),
                 ("--sequence", bool(self.sequences)),
                 ("--share-table", bool(self.share_tables))]
        return [flag for flag, set_ in given if set_]

    def train_schema(self, files: Sequence[str | Path], base: FeatureSchema | None = None,
                     *, rank: int = 0, world: int = 1,
                     gather: Callable[[Any], list[Any]] | None = None) -> FeatureSchema:
        """The schema a new training run uses: ``base`` (default ``self.schema()``) with
        numeric statistics and bucket edges from the first ``stats_rows`` rows of
        ``files``. Bad rows are left out of the statistics; training reads them again and
        reports or skips them. On one of ``world`` ranks (``gather`` their collective),
        each rank reads its share of those rows."""
        schema = base if base is not None else self.schema()
        if self.stats_rows <= 0:
            raise ValueError(f"--stats-rows must be positive, got {self.stats_rows}")
        buckets = self.numeric_buckets
        if isinstance(buckets, int) and (buckets < 0 or buckets == 1):
            raise ValueError(f"--numeric-buckets {buckets}: must be 0 (off) or at least 2")
        if world > 1:
            return with_numeric_stats(schema, list(files), max_rows=self.stats_rows,
                                      on_bad_row="skip", standardize=self.standardize,
                                      buckets=buckets, rank=rank, world=world, gather=gather)
        return with_numeric_stats(schema, list(files), max_rows=self.stats_rows,
                                  on_bad_row="skip", standardize=self.standardize,
                                  buckets=buckets)

    # -- reading files with a trained model's schema --------------------------------
    def for_model(self, model_schema: FeatureSchema) -> FeatureSchema:
        """The model's schema, read with another container format if ``format`` says so
        and another csv delimiter if ``delimiter`` does. The schema fixes the columns and
        their transforms: a setting naming them is an error rather than ignored."""
        given = self._column_settings(with_delimiter=False)
        if self.numeric_transform is not None:
            given.append("--numeric-transform")
        if given:
            raise ValueError(f"{', '.join(given)}: the model's schema fixes its columns and "
                             "their transforms; leave them out (--format and --delimiter "
                             "say how the file is written)")
        fmt = self.format or model_schema.format
        check_delimiter_for(self.delimiter, fmt)
        if fmt == model_schema.format:
            return model_schema if self.delimiter is None else replace(
                model_schema, delimiter=self.delimiter)
        if fmt == "criteo":
            raise ValueError("--format criteo only fits models trained on Criteo data")
        return replace(model_schema, format=fmt,
                       delimiter=(self.delimiter or ",") if fmt == "csv"
                       else model_schema.delimiter,
                       has_header=True, column_names=())


def check_delimiter_for(delimiter: str | None, fmt: str) -> None:
    """``--delimiter``: one character, and only where it is read (csv); elsewhere it
    would be ignored, and a longer one failed deep in the reader with a traceback."""
    if delimiter is None:
        return
    if fmt != "csv":
        raise ValueError(f"--delimiter: only for csv data; this data is {fmt}")
    from terarec.data.readers import check_delimiter

    problem = check_delimiter(delimiter)
    if problem:
        raise ValueError(f"--delimiter {delimiter!r}: {problem}")


def parse_labels(label: str | None, weights: Sequence[float] | None = None
                 ) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """``click:1,conversion:0.5`` -> ((click, conversion), (1.0, 0.5)); one column
    without a weight -> ((click,), ()). A weight that is no finite number >= 0, weights
    all 0, or ``weights`` of another length are ValueErrors naming ``--label``."""
    if not label:
        return (), ()
    columns: list[str] = []
    given: list[float | None] = []
    for part in label.split(","):
        name, sep, weight = part.strip().partition(":")
        if not name.strip():
            raise ValueError(f"--label {label!r}: an empty column name")
        columns.append(name.strip())
        if not sep:
            given.append(None)
            continue
        try:
            given.append(float(weight))
        except ValueError:
            raise ValueError(f"--label {label!r}: weight {weight!r} of {name!r} is not a "
                             "number") from None
    if weights is not None:
        if any(g is not None for g in given):
            raise ValueError(f"--label {label!r} carries weights and label_weights gives "
                             "them again; give them once")
        if len(weights) != len(columns):
            raise ValueError(f"label_weights: {len(weights)} weights for {len(columns)} "
                             f"labels {columns}")
        given = [float(w) for w in weights]
    out = () if all(g is None for g in given) else tuple(1.0 if g is None else g
                                                         for g in given)
    if any(not math.isfinite(w) or w < 0 for w in out) or (out and not any(out)):
        raise ValueError(f"--label {label!r}: weights must be finite numbers >= 0, not all "
                         f"0, got {list(out)}")
    if len(columns) == 1:  # one task: its weight scales nothing
        out = ()
    return tuple(columns), out


def _check_columns(labels: list[str], numeric: list[str], categorical: list[str],
                   multi: tuple[str, ...] | None) -> None:
    """A column named twice across label / numeric / categorical, or a multi-valued one
    that is not categorical: said with the flags (the schema's own check names fields)."""
    lists = (("--label", labels), ("--numeric", numeric),
             ("--categorical", categorical))
    for i, (flag, cols) in enumerate(lists):
        repeated = sorted({n for n in cols if cols.count(n) > 1})
        if repeated:
            raise ValueError(f"{flag} names {', '.join(map(repr, repeated))} twice")
        for other, others in lists[i + 1:]:
            both = [n for n in cols if n in others]
            if both:
                raise ValueError(f"{flag} and {other} both name {', '.join(map(repr, both))}:"
                                 " a column is one of label, numeric or categorical")
    stray = [n for n in multi or () if n not in categorical]
    if stray:
        raise ValueError(f"--multi-valued names {', '.join(map(repr, stray))}, not among "
                         "--categorical: only categorical columns hold several values")
