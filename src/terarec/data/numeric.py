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

from collections.abc import Sequence
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


def with_numeric_stats(schema: FeatureSchema, paths: Sequence[str | Path], *,
                       max_rows: int = DEFAULT_STATS_ROWS, on_bad_row: str = "error",
                       ) -> FeatureSchema:
    """``schema`` with each numeric field's mean and std over the first ``max_rows`` rows
    of ``paths`` (bad rows skipped or raised as the reader does). Fields with no value
    in the sample keep no statistics (fed untransformed by standardisation)."""
    if not schema.numeric or not paths:
        return schema
    from terarec.data.readers import ReadStats, iter_tables

    sums = {f.name: np.zeros(3) for f in schema.numeric}  # count, sum, sum of squares
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
        n, s, ss = totals
        mean_d = s / n
        var = max(ss / n - mean_d * mean_d, 0.0)
        std = float(np.sqrt(var))
        fields.append(replace(spec, mean=float(mean_d + shift[spec.name]),
                              std=std if std > _MIN_STD else 1.0))
    return replace(schema, fields=tuple(fields))

