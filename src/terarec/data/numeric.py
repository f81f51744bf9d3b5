"""Numeric column statistics: the standardisation every numeric field gets by default.

Raw numeric columns span anything from 0/1 flags to timestamps (Avazu's ``hour`` is
about 1.4e7): fed as they are, one large column swamps the first layer and training
collapses. So before training, the first ``max_rows`` rows are read once and each numeric
field's (transformed) mean and standard deviation are stored in its ``FieldSpec``;
``table_to_batch`` then feeds ``(t(x) - mean) / std`` with missing values at 0 (the
mean). The statistics live in ``schema.json``, so eval, predict and serving apply
exactly the transform training used; schemas without them feed ``t(x)`` as before.

The same pass also cuts each numeric field into quantile buckets of ``t(x)`` (FuxiCTR /
BARS-style discretisation): the bucket index becomes a categorical key of the field, so
the model gets a first-order weight and an embedding per value range on top of the
standardised value, which a linear term (or an MLP over few inputs) cannot bend into a
step or a peak. The edges are stored in the schema too. Their number follows the data:
about ``ROWS_PER_BUCKET`` sampled values per bucket, at most ``MAX_BUCKETS``, so a
bucket has rows enough to fit its weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from terarec.types import FeatureSchema

DEFAULT_STATS_ROWS = 200_000
# A column whose sampled values are (nearly) constant is centred but not scaled up: its
# rare later deviations would otherwise become huge inputs.
_MIN_STD = 1e-6
MAX_BUCKETS = 256
ROWS_PER_BUCKET = 100
# Values kept per field for the quantiles (float64): bounded memory on wide schemas.
_BUCKET_SAMPLE = 100_000


def transform_values(x: np.ndarray, transform: str) -> np.ndarray:
    """The per-value transform of a numeric field (float64 in, float64 out)."""
    if transform == "log1p":
        return np.sign(x) * np.log1p(np.abs(x))
    return x


def bucket_edges(values: np.ndarray, max_buckets: int | None = None,
                 ) -> tuple[float, ...] | None:
    """Quantile edges cutting ``values`` (transformed, non-missing) into at most
    ``max_buckets`` buckets (None: one per ``ROWS_PER_BUCKET`` values, at most
    ``MAX_BUCKETS``); None when fewer than two buckets result. Edges are sample values,
    so a value repeated often (a point mass at 0) is a bucket of its own; values below
    the sample's minimum share the lowest bucket."""
    if max_buckets is None:
        max_buckets = min(MAX_BUCKETS, len(values) // ROWS_PER_BUCKET)
    if max_buckets < 2 or not len(values):
        return None
    levels = np.arange(1, max_buckets) / max_buckets
    edges = np.unique(np.quantile(values, levels, method="inverted_cdf"))
    edges = edges[edges > values.min()]
    return tuple(float(e) for e in edges) if len(edges) else None


def bucket_index(t: np.ndarray, edges: Sequence[float]) -> np.ndarray:
    """The bucket of each transformed value ``t`` (int64; NaN lands in the last one and
    is masked out by the caller): the number of edges <= t."""
    return np.searchsorted(np.asarray(edges, np.float64), t, side="right").astype(np.int64)


def with_numeric_stats(schema: FeatureSchema, paths: Sequence[str | Path], *,
                       max_rows: int = DEFAULT_STATS_ROWS, on_bad_row: str = "error",
                       standardize: bool = True, buckets: int | None = None,
                       ) -> FeatureSchema:
    """``schema`` with each numeric field's mean and std (``standardize``) and bucket
    edges over the first ``max_rows`` rows of ``paths`` (bad rows skipped or raised as
    the reader does). ``buckets``: at most that many per field, 0 for none, None sized
    by ``bucket_edges``. Fields with no value in the sample keep no statistics (fed
    untransformed by standardisation) and no buckets."""
    if not schema.numeric or not paths or not (standardize or buckets != 0):
        return schema
    from terarec.data.readers import ReadStats, iter_tables

    sums = {f.name: np.zeros(3) for f in schema.numeric}  # count, sum, sum of squares
    kept: dict[str, list[np.ndarray]] = {f.name: [] for f in schema.numeric}
    kept_rows = dict.fromkeys(kept, 0)
    # Sums are taken about the first value seen: squares of large, nearly equal numbers
    # (timestamps) would otherwise lose every digit that matters.
    shift: dict[str, float] = {}
    rows = 0
    for path in paths:
        for table in iter_tables(path, schema, min(max_rows, 65_536),
                                 on_bad_row=on_bad_row,  # type: ignore[arg-type]
                                 stats=ReadStats()):
            table = table.slice(0, max_rows - rows)
            for spec in schema.numeric:
                x = table.column(spec.name).to_numpy()
                x = transform_values(x[~np.isnan(x)], spec.transform)
                acc = sums[spec.name]
                if len(x):
                    d = x - shift.setdefault(spec.name, float(x[0]))
                    acc += (len(d), d.sum(), np.square(d).sum())
                    room = _BUCKET_SAMPLE - kept_rows[spec.name]
                    if buckets != 0 and room > 0:
                        kept[spec.name].append(x[:room])
                        kept_rows[spec.name] += min(room, len(x))
            rows += table.num_rows
            if rows >= max_rows:
                break
        if rows >= max_rows:
            break
    fields = []
    for spec in schema.fields:
        totals = sums.get(spec.name)
        if totals is None or totals[0] == 0:
            fields.append(spec)
            continue
        if buckets != 0:
            spec = replace(spec, buckets=bucket_edges(np.concatenate(kept[spec.name]),
                                                      buckets))
        if standardize:
            n, s, ss = totals
            mean_d = s / n
            var = max(ss / n - mean_d * mean_d, 0.0)
            std = float(np.sqrt(var))
            spec = replace(spec, mean=float(mean_d + shift[spec.name]),
                           std=std if std > _MIN_STD else 1.0)
        fields.append(spec)
    return replace(schema, fields=tuple(fields))

