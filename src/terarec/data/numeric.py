"""Numeric column statistics: the standardisation every numeric field gets by default.

Raw numeric columns span anything from 0/1 flags to timestamps (Avazu's ``hour`` is
about 1.4e7): fed as they are, one large column swamps the first layer and training
collapses. So before training, the first ``max_rows`` rows are read once and each numeric
field's (transformed) mean and standard deviation are stored in its ``FieldSpec``;
``table_to_batch`` then feeds ``(t(x) - mean) / std`` with missing values at 0 (the
mean). The statistics live in ``schema.json``, so eval, predict and serving apply
exactly the transform training used; schemas without them feed ``t(x)`` as before.

The same pass also cuts each numeric field into buckets of ``t(x)``: the bucket index
becomes a categorical key of the field, so the model gets a first-order weight and an
embedding per value range on top of the standardised value, which a linear term (or an
MLP over few inputs) cannot bend into a step or a peak. The edges are stored in the
schema too. By default (``buckets="log"``) integer-valued columns (counts, ages,
durations) are cut at ``sign(x) * floor(log1p(|x|) ** 2)`` (``log_square_edges``), the
discretisation of counts that the Criteo winners and the BARS / FuxiCTR Criteo pipelines
use, on every such column; the other columns get quantile buckets (FuxiCTR / BARS-style)
where a test finds them worth it (``tested_edges``, ``buckets="tested"`` on every
column): about ``ROWS_PER_BUCKET`` sampled values per bucket, at most ``MAX_BUCKETS``,
kept only where the label departs from a linear effect, tested at that count and at
``COARSE_FACTOR`` times fewer. The log rule raised every model on the small Criteo and
Adult samples; on large data it needs Adagrad's damped first steps
(``sparse_optimizer.initial_accumulator``), without which thirteen always-present bucket
keys destabilised DeepFM's first passes (docs/models.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from statistics import NormalDist
from typing import Literal

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
BUCKET_TEST_P = 0.01
# ``tested_edges`` also tries this many times fewer buckets than the data-sized count.
COARSE_FACTOR = 2


def transform_values(x: np.ndarray, transform: str) -> np.ndarray:
    """The per-value transform of a numeric field (float64 in, float64 out)."""
    if transform == "log1p":
        return np.sign(x) * np.log1p(np.abs(x))
    return x


# Per numeric field: (count, sum, sum of squares) of the values minus ``shift``.
Moments = dict[str, tuple[float, float, float, float]]  # name -> (n, sum, sum sq, shift)
# Per numeric field: sampled transformed values and their labels (for bucket edges).
Samples = dict[str, tuple[np.ndarray, np.ndarray]]
Part = tuple[Moments, Samples]  # what one process or rank gathered


def sized_bucket_count(n: int) -> int:
    """The data-sized bucket count of ``n`` sampled values: one per ``ROWS_PER_BUCKET``,
    at most ``MAX_BUCKETS``."""
    return min(MAX_BUCKETS, n // ROWS_PER_BUCKET)


def bucket_edges(values: np.ndarray, max_buckets: int | None = None,
                 ) -> tuple[float, ...] | None:
    """Quantile edges cutting ``values`` (transformed, non-missing) into at most
    ``max_buckets`` buckets (None: one per ``ROWS_PER_BUCKET`` values, at most
    ``MAX_BUCKETS``); None when fewer than two buckets result. Edges are sample values,
    so a value repeated often (a point mass at 0) is a bucket of its own; values below
    the sample's minimum share the lowest bucket."""
    if max_buckets is None:
        max_buckets = sized_bucket_count(len(values))
    if max_buckets < 2 or not len(values):
        return None
    levels = np.arange(1, max_buckets) / max_buckets
    edges = np.unique(np.quantile(values, levels, method="inverted_cdf"))
    edges = edges[edges > values.min()]
    return tuple(float(e) for e in edges) if len(edges) else None


def _raw_values(t: np.ndarray, transform: str) -> np.ndarray:
    """The inverse of ``transform_values``."""
    if transform == "log1p":
        return np.sign(t) * np.expm1(np.abs(t))
    return t


def integer_valued(values: np.ndarray, transform: str) -> bool:
    """Whether every one of ``values`` (transformed) came from an integer."""
    raw = _raw_values(values, transform)
    return bool(len(raw)) and bool(np.all(
        np.abs(raw - np.rint(raw)) <= 1e-6 * np.maximum(1.0, np.abs(raw))))


def log_square_edges(values: np.ndarray, transform: str) -> tuple[float, ...] | None:
    """Edges (in transformed units) that give ``x`` the bucket
    ``sign(x) * floor(log1p(|x|) ** 2)``: raw edges ``±expm1(sqrt(k))``, k = 1, 2, ...,
    within the range of ``values``, at most ``MAX_BUCKETS - 1`` of them (evenly thinned
    beyond); None when they cut the range into fewer than two buckets."""
    if not len(values):
        return None
    u = np.log1p(np.abs(_raw_values(np.array([values.min(), values.max()]), transform)))
    k = np.arange(1, int(np.floor(u.max() ** 2)) + 1, dtype=np.float64)
    raw = np.expm1(np.sqrt(k))
    edges = transform_values(np.concatenate([-raw[::-1], raw]), transform)
    edges = edges[(edges > values.min()) & (edges <= values.max())]
    if len(edges) > MAX_BUCKETS - 1:
        edges = edges[np.linspace(0, len(edges) - 1, MAX_BUCKETS - 1).round().astype(int)]
    return tuple(float(e) for e in edges) if len(edges) else None


def log_or_tested_edges(values: np.ndarray, labels: np.ndarray, transform: str,
                        ) -> tuple[float, ...] | None:
    """A column's buckets under ``--numeric-buckets log`` (the default):
    ``log_square_edges`` for an integer-valued column they cut, else the tested quantile
    buckets."""
    if integer_valued(values, transform):
        edges = log_square_edges(values, transform)
        if edges is not None:
            return edges
    return tested_edges(values, labels)


def bucket_index(t: np.ndarray, edges: Sequence[float]) -> np.ndarray:
    """The bucket of each transformed value ``t`` (int64; NaN lands in the last one and
    is masked out by the caller): the number of edges <= t."""
    return np.searchsorted(np.asarray(edges, np.float64), t, side="right").astype(np.int64)


def _log_likelihood(y: np.ndarray, logit: np.ndarray) -> float:
    return float(np.sum(y * logit - np.logaddexp(0.0, logit)))


def departure_z(values: np.ndarray, labels: np.ndarray, edges: Sequence[float],
                ) -> float | None:
    """How far the label's dependence on ``values`` departs from the logistic-linear one
    the standardised dense input already gives: the likelihood-ratio statistic of one
    rate per bucket against ``logit = a + b * value``, as the standard-normal z its
    chi-square (Wilson-Hilferty) corresponds to, so tests with different bucket counts
    compare; None when the buckets leave no degree of freedom."""
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
        return None
    stat = 2.0 * (per_bucket - linear)
    c = 2.0 / (9.0 * dof)
    return float((np.cbrt(max(stat, 0.0) / dof) - 1.0 + c) / np.sqrt(c))


def departs_from_linear(values: np.ndarray, labels: np.ndarray, edges: Sequence[float],
                        p: float = BUCKET_TEST_P) -> bool:
    """Whether the label's dependence on ``values`` is visibly not linear (``departure_z``
    at significance ``p``). A column whose effect is linear gets no buckets: their
    weights would only add variance."""
    z = departure_z(values, labels, edges)
    return z is not None and z > NormalDist().inv_cdf(1.0 - p)


def tested_edges(values: np.ndarray, labels: np.ndarray) -> tuple[float, ...] | None:
    """The data-sized buckets of a column, or ``COARSE_FACTOR`` times fewer, whichever
    departs from linear more significantly; None when neither passes the test at
    ``BUCKET_TEST_P`` (shared between the counts tried, Bonferroni). On few rows a step
    spread over many buckets has too few rows per bucket to show; fewer, wider ones see
    it (docs/models.md)."""
    sized = bucket_edges(values)
    if sized is None:
        return None
    wanted = sized_bucket_count(len(values)) // COARSE_FACTOR
    coarse = bucket_edges(values, wanted) if wanted >= 2 else None
    tried = [sized] if coarse is None or coarse == sized else [sized, coarse]
    scored = [(z, edges) for edges in tried
              if (z := departure_z(values, labels, edges)) is not None]
    if not scored:
        return None
    z, edges = max(scored, key=lambda t: t[0])
    return edges if z > NormalDist().inv_cdf(1.0 - BUCKET_TEST_P / len(tried)) else None


def with_numeric_stats(schema: FeatureSchema, paths: Sequence[str | Path], *,
                       max_rows: int = DEFAULT_STATS_ROWS, on_bad_row: str = "error",
                       standardize: bool = True,
                       buckets: int | Literal["log", "tested"] | None = None,
                       rank: int = 0, world: int = 1,
                       gather: Callable[[Part], list[Part]] | None = None,
                       ) -> FeatureSchema:
    """``schema`` with each numeric field's mean and std (``standardize``) and bucket
    edges over the first ``max_rows`` rows of ``paths`` (bad rows skipped or raised as
    the reader does). ``buckets``: at most that many per field, 0 for none, None or
    "log" as ``log_or_tested_edges``, "tested" sized by ``bucket_edges`` behind the
    linearity test (``tested_edges``) on every column.
    Fields with no value in the sample keep no statistics (fed untransformed by
    standardisation) and no buckets.

    On ``world`` ranks each rank reads its share of those rows (every ``world``-th
    block, ``data.split``) and ``gather`` (an all-gather over the ranks) brings every
    rank's sums and samples together, so no rank parses the whole sample; the result
    agrees with one process's to float rounding (bad rows aside: a rank counts lines,
    not clean rows, towards ``max_rows``)."""
    if not schema.numeric or not paths or not (standardize or buckets != 0):
        return schema
    cap = _BUCKET_SAMPLE // max(world, 1) if buckets != 0 else 0
    if world == 1:
        parts = [_moments(schema, paths, max_rows, on_bad_row, cap)]
    elif gather is None:
        raise ValueError("numeric statistics on several ranks need a gather")
    else:
        parts = gather(_rank_moments(schema, paths, max_rows, on_bad_row, rank, world, cap))
    return _with_moments(schema, parts, standardize, buckets)


class _Acc:
    """Running sums (about the first value seen: squares of large, nearly equal numbers
    such as timestamps would otherwise lose every digit that matters) and up to ``cap``
    sampled values with their labels, per numeric field."""

    def __init__(self, schema: FeatureSchema, cap: int) -> None:
        self.schema = schema
        self.cap = cap
        self.sums = {f.name: np.zeros(3) for f in schema.numeric}
        self.shift: dict[str, float] = {}
        self.kept: dict[str, list[np.ndarray]] = {f.name: [] for f in schema.numeric}
        self.kept_labels: dict[str, list[np.ndarray]] = {f.name: [] for f in schema.numeric}
        self.kept_rows = dict.fromkeys(self.kept, 0)

    def add(self, table) -> None:
        labels = np.asarray(table.column(self.schema.label).to_numpy(), np.float64)
        for spec in self.schema.numeric:
            x = table.column(spec.name).to_numpy()
            present = ~np.isnan(x)
            x = transform_values(x[present], spec.transform)
            if not len(x):
                continue
            d = x - self.shift.setdefault(spec.name, float(x[0]))
            self.sums[spec.name] += (len(d), d.sum(), np.square(d).sum())
            room = self.cap - self.kept_rows[spec.name]
            if room > 0:
                self.kept[spec.name].append(x[:room])
                self.kept_labels[spec.name].append(labels[present][:room])
                self.kept_rows[spec.name] += min(room, len(x))

    def result(self) -> Part:
        moments = {name: (float(n), float(s), float(ss), self.shift.get(name, 0.0))
                   for name, (n, s, ss) in self.sums.items()}
        samples = {name: (np.concatenate(v) if v else np.zeros(0),
                          np.concatenate(self.kept_labels[name]) if v else np.zeros(0))
                   for name, v in self.kept.items()}
        return moments, samples


def _moments(schema: FeatureSchema, paths: Sequence[str | Path], max_rows: int,
             on_bad_row: str, cap: int) -> Part:
    """One process: the first ``max_rows`` clean rows."""
    from terarec.data.readers import ReadStats, iter_tables

    acc = _Acc(schema, cap)
    rows = 0
    for path in paths:
        for table in iter_tables(path, schema, min(max_rows, 65_536),
                                 on_bad_row=on_bad_row,  # type: ignore[arg-type]
                                 stats=ReadStats()):
            table = table.slice(0, max_rows - rows)
            acc.add(table)
            rows += table.num_rows
            if rows >= max_rows:
                break
        if rows >= max_rows:
            break
    return acc.result()


def _rank_moments(schema: FeatureSchema, paths: Sequence[str | Path], max_rows: int,
                  on_bad_row: str, rank: int, world: int, cap: int) -> Part:
    """One rank: its local blocks of the first ``max_rows`` rows (lines)."""
    from terarec.data.readers import ReadStats
    from terarec.data.split import iter_rank_tables

    acc = _Acc(schema, cap)
    local = max(1, min(max_rows, 65_536) // world)
    lines = 0  # rows of all ranks so far: the same count on every rank
    for path in paths:
        for table, step_rows in iter_rank_tables(
                path, schema, local, rank, world,
                on_bad_row=on_bad_row,  # type: ignore[arg-type]
                stats=ReadStats(), max_lines=max_rows - lines):
            if table is not None:
                acc.add(table)
            lines += step_rows
        if lines >= max_rows:
            break
    return acc.result()


def _with_moments(schema: FeatureSchema, parts: list[Part], standardize: bool,
                  buckets: int | Literal["log", "tested"] | None) -> FeatureSchema:
    """``schema`` with the mean and std the sums of ``parts`` (one per rank) give, and
    bucket edges from their pooled samples."""
    fields = []
    for spec in schema.fields:
        got = [m[spec.name] for m, _ in parts if spec.name in m and m[spec.name][0] > 0]
        if not got:
            fields.append(spec)
            continue
        if buckets != 0:
            values = np.concatenate([s[spec.name][0] for _, s in parts if spec.name in s])
            labels = np.concatenate([s[spec.name][1] for _, s in parts if spec.name in s])
            if buckets == "tested":
                edges = tested_edges(values, labels)
            elif buckets is None or buckets == "log":
                edges = log_or_tested_edges(values, labels, spec.transform)
            else:
                edges = bucket_edges(values, buckets)
            spec = replace(spec, buckets=edges)
        if standardize:
            if len(got) == 1:
                n, s, ss, shift = got[0]
                mean_d = s / n
                mean = mean_d + shift
                var = max(ss / n - mean_d * mean_d, 0.0)
            else:  # each rank's (n, mean, M2) combined (Chan et al.)
                n = sum(g[0] for g in got)
                means = [g[3] + g[1] / g[0] for g in got]
                mean = sum(g[0] * m for g, m in zip(got, means, strict=True)) / n
                m2 = sum(g[2] - g[1] * g[1] / g[0] + g[0] * (m - mean) ** 2
                         for g, m in zip(got, means, strict=True))
                var = max(m2 / n, 0.0)
            std = float(np.sqrt(var))
            spec = replace(spec, mean=float(mean), std=std if std > _MIN_STD else 1.0)
        fields.append(spec)
    return replace(schema, fields=tuple(fields))
