"""Numeric column statistics: the standardisation every numeric field gets by default.

Raw numeric columns span anything from 0/1 flags to timestamps (Avazu's ``hour`` is
about 1.4e7): fed as they are, one large column swamps the first layer and training
collapses. So before training, the first ``max_rows`` rows are read once and each numeric
field's (transformed) mean and standard deviation are stored in its ``FieldSpec``;
``table_to_batch`` then feeds ``(t(x) - mean) / std`` with missing values at 0 (the
mean). The statistics live in ``schema.json``, so eval, predict and serving apply
exactly the transform training used; schemas without them feed ``t(x)`` as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from terarec.types import FeatureSchema

DEFAULT_STATS_ROWS = 200_000
# A column whose sampled values are (nearly) constant is centred but not scaled up: its
# rare later deviations would otherwise become huge inputs.
_MIN_STD = 1e-6


def transform_values(x: np.ndarray, transform: str) -> np.ndarray:
    """The per-value transform of a numeric field (float64 in, float64 out)."""
    if transform == "log1p":
        return np.sign(x) * np.log1p(np.abs(x))
    return x


# Per numeric field: (count, sum, sum of squares) of the values minus ``shift``.
Moments = dict[str, tuple[float, float, float, float]]  # name -> (n, sum, sum sq, shift)


def with_numeric_stats(schema: FeatureSchema, paths: Sequence[str | Path], *,
                       max_rows: int = DEFAULT_STATS_ROWS, on_bad_row: str = "error",
                       rank: int = 0, world: int = 1,
                       gather: Callable[[Moments], list[Moments]] | None = None,
                       ) -> FeatureSchema:
    """``schema`` with each numeric field's mean and std over the first ``max_rows`` rows
    of ``paths`` (bad rows skipped or raised as the reader does). Fields with no value
    in the sample keep no statistics (fed untransformed by standardisation).

    On ``world`` ranks each rank reads its share of those rows (every ``world``-th
    block, ``data.split``) and ``gather`` (an all-gather over the ranks) brings every
    rank's sums together, so no rank parses the whole sample; the result agrees with
    one process's to float rounding (bad rows aside: a rank counts lines, not clean
    rows, towards ``max_rows``)."""
    if not schema.numeric or not paths:
        return schema
    if world == 1:
        return _with_moments(schema, [_moments(schema, paths, max_rows, on_bad_row)])
    if gather is None:
        raise ValueError("numeric statistics on several ranks need a gather")
    return _with_moments(schema, gather(_rank_moments(schema, paths, max_rows, on_bad_row,
                                                      rank, world)))


def _accumulate(schema: FeatureSchema, table, acc: dict[str, np.ndarray],
                shift: dict[str, float]) -> None:
    for spec in schema.numeric:
        x = table.column(spec.name).to_numpy()
        x = transform_values(x[~np.isnan(x)], spec.transform)
        if len(x):
            # Sums are taken about the first value seen: squares of large, nearly equal
            # numbers (timestamps) would otherwise lose every digit that matters.
            d = x - shift.setdefault(spec.name, float(x[0]))
            acc[spec.name] += (len(d), d.sum(), np.square(d).sum())


def _result(acc: dict[str, np.ndarray], shift: dict[str, float]) -> Moments:
    return {name: (float(n), float(s), float(ss), shift.get(name, 0.0))
            for name, (n, s, ss) in acc.items()}


def _moments(schema: FeatureSchema, paths: Sequence[str | Path], max_rows: int,
             on_bad_row: str) -> Moments:
    """One process: the first ``max_rows`` clean rows."""
    from terarec.data.readers import ReadStats, iter_tables

    acc = {f.name: np.zeros(3) for f in schema.numeric}
    shift: dict[str, float] = {}
    rows = 0
    for path in paths:
        for table in iter_tables(path, schema, min(max_rows, 65_536),
                                 on_bad_row=on_bad_row,  # type: ignore[arg-type]
                                 stats=ReadStats()):
            table = table.slice(0, max_rows - rows)
            _accumulate(schema, table, acc, shift)
            rows += table.num_rows
            if rows >= max_rows:
                break
        if rows >= max_rows:
            break
    return _result(acc, shift)


def _rank_moments(schema: FeatureSchema, paths: Sequence[str | Path], max_rows: int,
                  on_bad_row: str, rank: int, world: int) -> Moments:
    """One rank: its local blocks of the first ``max_rows`` rows (lines)."""
    from terarec.data.readers import ReadStats
    from terarec.data.split import iter_rank_tables

    acc = {f.name: np.zeros(3) for f in schema.numeric}
    shift: dict[str, float] = {}
    local = max(1, min(max_rows, 65_536) // world)
    lines = 0  # rows of all ranks so far: the same count on every rank
    for path in paths:
        for table, step_rows in iter_rank_tables(
                path, schema, local, rank, world,
                on_bad_row=on_bad_row,  # type: ignore[arg-type]
                stats=ReadStats(), max_lines=max_rows - lines):
            if table is not None:
                _accumulate(schema, table, acc, shift)
            lines += step_rows
        if lines >= max_rows:
            break
    return _result(acc, shift)


def _with_moments(schema: FeatureSchema, parts: list[Moments]) -> FeatureSchema:
    """``schema`` with the mean and std the sums of ``parts`` (one per rank) give."""
    fields = []
    for spec in schema.fields:
        got = [p[spec.name] for p in parts if spec.name in p and p[spec.name][0] > 0]
        if not got:
            fields.append(spec)
            continue
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
        fields.append(replace(spec, mean=float(mean), std=std if std > _MIN_STD else 1.0))
    return replace(schema, fields=tuple(fields))
