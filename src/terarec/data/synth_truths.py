"""Planted truths of other shapes than the low-rank FM, so that defaults chosen on
synthetic data are not chosen for FM-like data alone.

Each truth is a sum of terms, every one with a set spread in the logit over the drawn rows:

- ``linear``: first-order field weights and the numeric term, nothing else; one-hot
  logistic regression nears its ceiling as the rows cover the values.
- ``deep``: a random two-layer tanh MLP over the concatenated field embeddings and the
  standardised counts, and nothing else.
- ``cross``: a weaker first-order and numeric part plus crosses of 3 and 4 fields: a
  random weight per tuple of the fields' hot values (the rest of a field shares one
  bucket), centred so that no field or pair of fields alone carries any of it; only a
  model that crosses three fields at once can learn it.
- ``mixed``: moderate amounts of every term, the FM truth's low-rank pairs included.

The first-order, numeric and pairwise terms are the FM truth's own (same ``model_seed``),
and every new weight is again a pure function of ``(model_seed, field, value id)`` or of
the seed alone, so train and validation files share one truth.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from terarec.data.synth import (
    _CALIBRATION_ROWS,
    DENSE_MU,
    DENSE_SIGMA,
    RANK_DECAY,
    TARGET_CTR,
    GroundTruth,
    _bias_for_ctr,
    _draw_features,
    _hash_normal,
    _stream_key,
    ground_truth,
)
from terarec.kernels import GOLDEN_GAMMA, splitmix64


@dataclass(frozen=True)
class Shape:
    """Spread of each term in the logit: ``first``, ``numeric`` and ``pairwise`` multiply
    the FM truth's terms (std about 1.0, 0.45 and 0.45), ``deep`` and ``cross`` are stds."""

    first: float = 0.0
    numeric: float = 0.0
    pairwise: float = 0.0
    deep: float = 0.0
    cross: float = 0.0


# Scaled so that each truth's ceiling AUC is close to the FM truth's (about 0.78).
SHAPES = {
    "linear": Shape(first=1.1, numeric=1.1),
    "deep": Shape(deep=1.25),
    "cross": Shape(first=0.75, numeric=0.75, cross=0.85),
    "mixed": Shape(first=0.7, numeric=0.7, pairwise=0.8, deep=0.6, cross=0.5),
}

EMBED_DIM = 4             # per field, input of the deep truth's MLP
HIDDEN = (32, 16)
TANH_GAIN = 2.0           # std of every hidden pre-activation: well into tanh's bend
CROSS_ORDERS = (3, 3, 3, 3, 3, 3, 4, 4)
CROSS_BUCKETS = 6         # hot values of a field with their own cross weights


@numba.njit(cache=True, nogil=True)
def _hash_normal_rows(key: np.uint64, rows: int, dim: int, decay: float) -> np.ndarray:
    """``[rows, dim]`` standard normals fixed by ``key`` (Box-Muller on hashed uniforms),
    row ``i`` scaled by ``1 / sqrt(1 + i / decay)``; the last row (a missing value) by 1."""
    out = np.empty((rows, dim), dtype=np.float32)
    gamma = np.uint64(GOLDEN_GAMMA)
    for i in range(rows):
        scale = 1.0 if i == rows - 1 else 1.0 / np.sqrt(1.0 + i / decay)
        for d in range(dim):
            base = splitmix64((np.uint64(i * dim + d) * gamma) ^ key)
            u1 = (float(splitmix64(base) >> np.uint64(11)) + 1.0) * 2.0 ** -53
            u2 = float(splitmix64(base ^ np.uint64(0xD1B54A32D192ED03)) >> np.uint64(11)) \
                * 2.0 ** -53
            out[i, d] = scale * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
    return out


def _standard_numerics(dense: np.ndarray) -> np.ndarray:
    """Clipped z-scores of ``log1p(count)`` (0 when missing) and the missing indicators."""
    missing = np.isnan(dense)
    z = np.clip((np.log1p(np.where(missing, 0.0, dense)) - np.asarray(DENSE_MU))
                / np.asarray(DENSE_SIGMA), -3, 3)
    return np.concatenate([np.where(missing, 0.0, z), missing.astype(np.float64)], axis=1)


class RandomMLP:
    """The deep truth's term: ``tanh`` layers of random weights over the field embeddings
    and the counts, each pre-activation centred and scaled to ``TANH_GAIN`` on the
    calibration rows, the output scaled to std ``std``."""

    def __init__(self, model_seed: int, vocab: tuple[int, ...], dense: np.ndarray,
                 categorical: np.ndarray, std: float) -> None:
        self.tables = [_hash_normal_rows(_stream_key(model_seed, f, 0xDEE9), v + 1,
                                         EMBED_DIM, RANK_DECAY) for f, v in enumerate(vocab)]
        rng = np.random.default_rng([model_seed, 0xDEE9])
        x = self._inputs(dense, categorical)
        self.layers: list[tuple[np.ndarray, np.ndarray]] = []
        for width in HIDDEN:
            w = rng.standard_normal((x.shape[1], width))
            pre = x @ w
            w *= TANH_GAIN / pre.std(0)
            b = -pre.mean(0) * TANH_GAIN / pre.std(0)
            self.layers.append((w, b))
            x = np.tanh(x @ w + b)
        out = rng.standard_normal(x.shape[1])
        y = x @ out
        self.out = out * (std / y.std())

    def _inputs(self, dense: np.ndarray, categorical: np.ndarray) -> np.ndarray:
        parts = [t[c] for t, c in zip(self.tables, categorical.T, strict=True)]
        parts.append(_standard_numerics(dense))
        return np.concatenate(parts, axis=1, dtype=np.float64)

    def __call__(self, dense: np.ndarray, categorical: np.ndarray) -> np.ndarray:
        x = self._inputs(dense, categorical)
        for w, b in self.layers:
            x = np.tanh(x @ w + b)
        return x @ self.out


class Crosses:
    """The cross truth's term: per group of 3-4 random fields, a random weight on every
    tuple of their buckets (a field's ``CROSS_BUCKETS`` hottest values, then one bucket
    for the rest and missing cells). Each table is centred along every field under that
    field's bucket shares; fields are drawn independently, so the term has zero mean given
    any proper subset of its fields and lies outside what pairwise models can express."""

    def __init__(self, model_seed: int, vocab: tuple[int, ...], shares: list[np.ndarray],
                 categorical: np.ndarray, std: float) -> None:
        rng = np.random.default_rng([model_seed, 0xC4055])
        self.groups: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for g, order in enumerate(CROSS_ORDERS):
            fields = np.sort(rng.choice(len(vocab), order, replace=False))
            hot = np.array([min(CROSS_BUCKETS, vocab[f]) for f in fields])
            table = _hash_normal(_stream_key(model_seed, 0xC4055, g),
                                np.arange(int(np.prod(hot + 1)))).reshape(tuple(hot + 1))
            for axis, f in enumerate(fields):
                p = np.append(shares[f][:hot[axis]], 1.0 - shares[f][:hot[axis]].sum())
                mean = np.tensordot(table, p, axes=([axis], [0]))
                table = table - np.expand_dims(mean, axis)
            flat = table.ravel()
            flat /= self._lookup(fields, hot, flat, categorical).std()
            self.groups.append((fields, hot, flat * (std / np.sqrt(len(CROSS_ORDERS)))))

    @staticmethod
    def _lookup(fields: np.ndarray, hot: np.ndarray, flat: np.ndarray,
                categorical: np.ndarray) -> np.ndarray:
        index = np.zeros(categorical.shape[0], dtype=np.int64)
        for f, h in zip(fields, hot, strict=True):
            c = categorical[:, f]
            index = index * (h + 1) + np.where((c >= 0) & (c < h), c, h)
        return flat[index]

    def __call__(self, categorical: np.ndarray) -> np.ndarray:
        total = np.zeros(categorical.shape[0])
        for fields, hot, flat in self.groups:
            total += self._lookup(fields, hot, flat, categorical)
        return total


class ShapedTruth:
    """A planted truth named in ``SHAPES``: the FM truth's terms, a random MLP and
    high-order crosses, each scaled as the shape says, on the calibration rows the FM
    truth uses, with the bias that gives the target click rate."""

    def __init__(self, name: str, model_seed: int = 0, exponent: float = 1.1,
                 vocab_scale: float = 1.0) -> None:
        self.name = name
        self.shape = SHAPES[name]
        self.model_seed = model_seed
        base = ground_truth(model_seed, exponent, vocab_scale)  # the cached FM truth
        assert isinstance(base, GroundTruth)
        self.base = base
        self.vocab = self.base.vocab
        dense, cats = _draw_features(_CALIBRATION_ROWS, np.random.default_rng(0xCA11B),
                                     self.vocab, exponent)
        self.mlp = (RandomMLP(model_seed, self.vocab, dense, cats, self.shape.deep)
                    if self.shape.deep else None)
        shares = [self.base._value_shares(f, exponent) for f in range(len(self.vocab))]
        self.crosses = (Crosses(model_seed, self.vocab, shares, cats, self.shape.cross)
                        if self.shape.cross else None)
        self.bias = 0.0
        self.bias = _bias_for_ctr(self.logits(dense, cats), TARGET_CTR)

    def logits(self, dense: np.ndarray, categorical: np.ndarray) -> np.ndarray:
        shape, base = self.shape, self.base
        logit = np.full(categorical.shape[0], self.bias)
        if shape.first:
            for f, table in enumerate(base._first):
                logit += shape.first * table[categorical[:, f]]
        if shape.numeric:
            logit += shape.numeric * base._numeric(dense)
        if shape.pairwise:
            logit += shape.pairwise * base._pairwise(categorical)
        if self.mlp is not None:
            logit += self.mlp(dense, categorical)
        if self.crosses is not None:
            logit += self.crosses(categorical)
        return logit

    def probabilities(self, dense: np.ndarray, categorical: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self.logits(dense, categorical)))
