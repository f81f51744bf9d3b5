"""Synthetic click logs whose labels depend on aggregate features, to test AutoFeature.

Two effects are planted that no per-value weight can learn from a modest sample, but an
aggregate captures at once::

    logit = bias + w[C1]                                  learnable first-order signal
          + COUNT_WEIGHT * z(log count of C3's value)     popularity: most C3 values are
                                                          rare, so their weights cannot be
                                                          learned, but their counts can
          + PAIR_WEIGHT * [(C5, C7) is a popular pair]    a property of the pair, not of
                                                          either value alone

``count(C3)`` and ``cross_count(C5,C7)`` are the features that recover them. Counts are
taken over every generated row (train and validation together), the population that the
training range samples. Written as CSV with a header: ``label,I1,I2,C1..C8``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from terarec.data.readers import csv_schema
from terarec.io import atomic_open
from terarec.types import FeatureSchema

#: Vocabulary size per categorical field; C3 is a long Zipf tail, C5 x C7 hold the pairs.
VOCAB = {"C1": 10, "C2": 20, "C3": 200_000, "C4": 1000, "C5": 40, "C6": 5000, "C7": 40,
         "C8": 100}
PLANTED = ("count(C3)", "cross_count(C5,C7)")
COUNT_WEIGHT = 0.8
PAIR_WEIGHT = 1.2
POPULAR_PAIRS = 60
POPULAR_SHARE = 0.5


@dataclass
class PlantedData:
    """What ``generate_planted`` wrote and which features carry the planted signal."""

    train: Path
    valid: Path
    schema: FeatureSchema
    planted: tuple[str, ...]
    ceiling_auc: float


def planted_schema() -> FeatureSchema:
    return csv_schema("label", ["I1", "I2"], list(VOCAB), transform="log1p")


def generate_planted(train_path: str | Path, valid_path: str | Path, train_rows: int,
                     valid_rows: int, *, seed: int = 0) -> PlantedData:
    """Write ``train_rows`` and ``valid_rows`` rows with the planted effects (same truth)."""
    if train_rows <= 0 or valid_rows <= 0:
        raise ValueError(f"rows must be positive, got {train_rows} / {valid_rows}")
    rng = np.random.default_rng(seed)
    n = train_rows + valid_rows
    ids: dict[str, np.ndarray] = {}
    for name, vocab in VOCAB.items():
        if name == "C3":
            ids[name] = np.minimum(rng.zipf(1.15, n) - 1, vocab - 1)
        else:
            ids[name] = rng.integers(0, vocab, n)
    # Half the rows draw (C5, C7) from a few popular pairs; their marginals stay uniform.
    popular = np.stack([rng.integers(0, VOCAB["C5"], POPULAR_PAIRS),
                        rng.integers(0, VOCAB["C7"], POPULAR_PAIRS)], axis=1)
    from_popular = rng.random(n) < POPULAR_SHARE
    pick = popular[rng.integers(0, POPULAR_PAIRS, n)]
    ids["C5"] = np.where(from_popular, pick[:, 0], ids["C5"])
    ids["C7"] = np.where(from_popular, pick[:, 1], ids["C7"])
    pair_code = ids["C5"] * VOCAB["C7"] + ids["C7"]
    is_popular = np.isin(pair_code, popular[:, 0] * VOCAB["C7"] + popular[:, 1])

    log_count = np.log(np.bincount(ids["C3"], minlength=VOCAB["C3"])[ids["C3"]])
    z = (log_count - log_count.mean()) / log_count.std()
    w_c1 = 0.5 * rng.standard_normal(VOCAB["C1"])
    logit = w_c1[ids["C1"]] + COUNT_WEIGHT * z + PAIR_WEIGHT * (is_popular - is_popular.mean())
    logit += -1.2 - logit.mean()
    probs = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(n) < probs).astype(np.int8)
    dense = np.floor(np.exp(rng.normal(1.5, 1.0, (n, 2)))).astype(np.int64)

    columns = {"label": pa.array(labels), "I1": pa.array(dense[:, 0]),
               "I2": pa.array(dense[:, 1])}
    for name in VOCAB:
        columns[name] = pa.array(ids[name]).cast(pa.string())
    table = pa.table(columns)
    for path, part in ((train_path, table.slice(0, train_rows)),
                       (valid_path, table.slice(train_rows))):
        with atomic_open(Path(path), "wb") as fh:
            pa_csv.write_csv(part, fh, pa_csv.WriteOptions(quoting_style="none"))
    return PlantedData(Path(train_path), Path(valid_path), planted_schema(), PLANTED,
                       _auc(labels[train_rows:], probs[train_rows:]))


def _auc(labels: np.ndarray, probs: np.ndarray) -> float:
    """The planted probabilities' AUC, as ``synth.generate`` measures its ceiling."""
    from terarec.data.synth import _AUCHistogram

    histogram = _AUCHistogram()
    histogram.add(probs, labels)
    return histogram.auc()
