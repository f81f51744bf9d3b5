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
# Data-sized buckets are kept only where the label departs from a linear effect at this
# significance (``departs_from_linear``).
BUCKET_TEST_P = 0.001


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


def _log_likelihood(y: np.ndarray, logit: np.ndarray) -> float:
    return float(np.sum(y * logit - np.logaddexp(0.0, logit)))


def departs_from_linear(values: np.ndarray, labels: np.ndarray, edges: Sequence[float],
                        ) -> bool:
    """Whether the label's dependence on ``values`` is visibly not the logistic-linear
    one the standardised dense input already gives: a likelihood-ratio test of one rate
    per bucket against ``logit = a + b * value``, at ``BUCKET_TEST_P``. A column whose
    effect is linear gets no buckets: their weights would only add variance."""
    y = labels.astype(np.float64)
    z = (values - values.mean()) / (values.std() or 1.0)
    a = b = 0.0
    for _ in range(25):  # Newton's method on the two-parameter logistic fit
        p = 1.0 / (1.0 + np.exp(-(a + b * z)))
        w = p * (1.0 - p) + 1e-12
        grad = np.array([np.sum(y - p), np.sum((y - p) * z)])
        hess = np.array([[w.sum(), (w * z).sum()], [(w * z).sum(), (w * z * z).sum()]])
        try:
            step = np.linalg.solve(hess + 1e-9 * np.eye(2), grad)
        except np.linalg.LinAlgError:
            break
        a, b = a + step[0], b + step[1]
        if np.abs(step).max() < 1e-8:
            break
    linear = _log_likelihood(y, a + b * z)
    index = bucket_index(values, edges)
    shows = np.bincount(index, minlength=len(edges) + 1).astype(np.float64)
    clicks = np.bincount(index, weights=y, minlength=len(edges) + 1)
    rate = np.clip(clicks[index] / shows[index], 1e-9, 1 - 1e-9)
    per_bucket = float(np.sum(y * np.log(rate) + (1 - y) * np.log1p(-rate)))
    dof = int((shows > 0).sum()) - 2
    if dof < 1:
        return False
    return 2.0 * (per_bucket - linear) > _chi2_quantile(1.0 - BUCKET_TEST_P, dof)


def _chi2_quantile(q: float, dof: int) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (no scipy needed)."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(q)
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * np.sqrt(c)) ** 3


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
    kept_labels: dict[str, list[np.ndarray]] = {f.name: [] for f in schema.numeric}
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
            labels = np.asarray(table.column(schema.label).to_numpy(), np.float64)
            for spec in schema.numeric:
                x = table.column(spec.name).to_numpy()
                present = ~np.isnan(x)
                x = transform_values(x[present], spec.transform)
                acc = sums[spec.name]
                if len(x):
                    d = x - shift.setdefault(spec.name, float(x[0]))
                    acc += (len(d), d.sum(), np.square(d).sum())
                    room = _BUCKET_SAMPLE - kept_rows[spec.name]
                    if buckets != 0 and room > 0:
                        kept[spec.name].append(x[:room])
                        kept_labels[spec.name].append(labels[present][:room])
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
            values = np.concatenate(kept[spec.name])
            edges = bucket_edges(values, buckets)
            if buckets is None and edges is not None and not departs_from_linear(
                    values, np.concatenate(kept_labels[spec.name]), edges):
                edges = None
            spec = replace(spec, buckets=edges)
        if standardize:
            n, s, ss = totals
            mean_d = s / n
            var = max(ss / n - mean_d * mean_d, 0.0)
            std = float(np.sqrt(var))
            spec = replace(spec, mean=float(mean_d + shift[spec.name]),
                           std=std if std > _MIN_STD else 1.0)
        fields.append(spec)
    return replace(schema, fields=tuple(fields))

