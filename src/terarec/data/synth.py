"""Synthetic Criteo-format click logs with a known, learnable ground truth.

Rows look like Criteo Kaggle ``train.txt`` (label, 13 counts, 26 hex categoricals, tab
separated, empty cells for missing values). Categorical values are bounded-Zipf per
field, so a few values are hot and most are rare, as in real logs. Labels are drawn from
a known model::

    logit = bias + Σ_f w_f[value_f]                      first order, every field
                 + Σ_j β_j · z_j                         z_j = standardised log1p(count_j)
                 + Σ_{f<g in FM_FIELDS} <v_f[value_f], v_g[value_g]>   low-rank pairs

Every weight is a pure function of ``(model_seed, field, value id)`` (a counter-based
hash, no RNG state) times per-field scales fixed by the settings (``exponent``,
``vocab_scale``), so a train file and a validation file made with the same settings and
``model_seed`` but different ``sample_seed`` share one ground truth. The weight scale
decays with a value's rank, which keeps most of the signal on values frequent enough to
be learned from ~10^5-10^6 rows; the truth's own AUC is the ceiling a model can reach.

That is the default truth, ``fm``; ``truth=`` picks one of another shape (``deep``,
``cross``, ``linear``, ``mixed``: ``synth_truths``), so that what is tuned on synthetic
data is not tuned for FM-like data alone.

Rows are generated in fixed blocks of ``BLOCK_ROWS``, each with its own RNG stream, so
the output does not depend on how it is chunked to disk, and ``generate_arrays`` returns
exactly the rows ``generate`` writes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numba
import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from terarec.data.truths import TRUTHS
from terarec.io import atomic_open, atomic_write_text
from terarec.kernels import GOLDEN_GAMMA, splitmix64_array, splitmix64_int

NUM_DENSE = 13
NUM_CATEGORICAL = 26
BLOCK_ROWS = 1 << 16

# Vocabulary sizes shaped like Criteo Kaggle's (a few fields with 1e5-1e6 values, many
# with tens to thousands), capped at 1e6 so the default stays laptop-sized.
DEFAULT_VOCAB = (
    1460, 583, 1_000_000, 500_000, 305, 24, 12_517, 633, 3, 93_145, 5683, 800_000, 3194,
    27, 14_992, 600_000, 10, 5652, 2173, 4, 700_000, 18, 15, 286_181, 105, 142_572,
)
# Share of empty cells per field, again roughly Criteo's.
CATEGORICAL_MISSING = (
    0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.03, 0.0, 0.0, 0.0, 0.03,
    0.0, 0.0, 0.44, 0.44, 0.0, 0.76, 0.0, 0.03, 0.44, 0.44,
)
DENSE_MISSING = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.76, 0.22)
# Counts are floor(exp(N(mu, sigma))): heavy-tailed, mostly small, like Criteo's I1..I13.
DENSE_MU = (0.5, 1.5, 2.0, 1.5, 8.0, 4.0, 1.5, 2.5, 3.5, 0.3, 1.0, 0.2, 1.5)
DENSE_SIGMA = (1.0, 1.5, 1.3, 1.0, 1.8, 1.7, 1.3, 1.0, 1.3, 0.6, 0.8, 0.8, 1.0)

FM_FIELDS = (1, 5, 8, 13, 16, 19, 22)  # C2, C6, C9, C14, C17, C20, C23: small vocabularies
FM_RANK = 4
TARGET_CTR = 0.225
FIRST_ORDER_STD = 0.27     # std of a typical informative field's term in the logit
NUMERIC_STD = 0.45         # std of the 13 numeric fields' summed term
PAIRWISE_STD = 0.45        # std of the pairwise (FM) term
RANK_DECAY = 300.0         # weight scale halves around rank 3 * RANK_DECAY
_CALIBRATION_ROWS = 100_000

_M64 = 0xFFFFFFFFFFFFFFFF



def check_truth(name: str) -> str:
    if name not in TRUTHS:
        raise ValueError(f"truth must be one of {', '.join(TRUTHS)}; got {name!r}")
    return name


class ClickModel(Protocol):
    """What rows are labelled by: a truth's vocabulary, bias and probabilities."""

    vocab: tuple[int, ...]
    bias: float

    def logits(self, dense: np.ndarray, categorical: np.ndarray) -> np.ndarray: ...

    def probabilities(self, dense: np.ndarray, categorical: np.ndarray) -> np.ndarray: ...


@dataclass
class SynthInfo:
    """What ``generate`` wrote; saved as ``<path>.truth.json`` next to the data."""

    rows: int
    ctr: float
    ceiling_auc: float
    ceiling_logloss: float
    path: str | None = None
    model_seed: int = 0
    sample_seed: int = 0
    exponent: float = 1.1
    vocab_scale: float = 1.0
    hour: int | None = None  # ``generate_hourly``: the file's hour and the drift angle
    drift_angle: float | None = None
    truth: str = "fm"  # the planted truth's shape (``TRUTHS``)


@dataclass
class SynthArrays:
    """Rows in memory: ``dense`` raw counts ``[N, 13]`` (NaN = missing), ``categorical``
    value ids ``[N, 26]`` (rank order, 0 = most frequent, -1 = missing), ``labels`` 0/1
    float32 and the ground-truth click ``probs``."""

    dense: np.ndarray
    categorical: np.ndarray
    labels: np.ndarray
    probs: np.ndarray


# -- counter-based hashing: weights as pure functions of (seed, field, id) -----------------

def _stream_key(*parts: int) -> np.uint64:
    """One 64-bit key per tuple of small ints (e.g. seed, field, component)."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = splitmix64_int(h ^ (p & _M64))
    return np.uint64(h)


def _hash_normal(key: np.uint64, ids: np.ndarray) -> np.ndarray:
    """A standard normal per id, fixed by ``key`` (Box-Muller on two hashed uniforms)."""
    base = splitmix64_array(ids.astype(np.uint64) * np.uint64(GOLDEN_GAMMA) ^ key)
    u1 = ((splitmix64_array(base) >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53
    u2 = (splitmix64_array(base ^ np.uint64(0xD1B54A32D192ED03)) >> np.uint64(11)) * 2.0 ** -53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def vocab_sizes(vocab_scale: float = 1.0) -> tuple[int, ...]:
    return tuple(max(2, int(round(v * vocab_scale))) for v in DEFAULT_VOCAB)


@lru_cache(maxsize=64)
def _zipf_table(vocab: int, exponent: float) -> tuple[np.ndarray, np.ndarray]:
    """Bounded Zipf CDF over ranks ``0..vocab-1`` and a guide table into it: ``guide[j]``
    is the first rank whose CDF exceeds ``j / vocab``, so a draw starts at most a step or
    two before its answer instead of binary-searching a megabyte-sized array."""
    weights = np.arange(1, vocab + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    guide = np.searchsorted(cdf, np.arange(vocab) / vocab, side="right")
    return cdf, guide


@numba.njit(cache=True, nogil=True)
def _inverse_cdf(cdf: np.ndarray, guide: np.ndarray, u: np.ndarray,
                 out: np.ndarray) -> None:
    """``out[t]`` = first rank ``i`` with ``cdf[i] > u[t]`` (``np.searchsorted`` 'right')."""
    g = guide.shape[0]
    for t in range(u.shape[0]):
        i = guide[int(u[t] * g)]
        while cdf[i] <= u[t]:
            i += 1
        out[t] = i


class GroundTruth:
    """The click model behind a synthetic data set, fixed by ``model_seed`` (and, through
    the scales and the calibrated bias, by the value distribution the data is drawn from).

    Each term's spread is set, not left to chance: field ``f``'s first-order term has std
    ``field_scale[f]`` and the numeric and pairwise terms have std ``NUMERIC_STD`` and
    ``PAIRWISE_STD`` over the drawn rows, so the ceiling AUC hardly moves with the seed.
    """

    def __init__(self, model_seed: int = 0, exponent: float = 1.1,
                 vocab_scale: float = 1.0) -> None:
        self.model_seed = model_seed
        self.vocab = vocab_sizes(vocab_scale)
        meta = np.random.default_rng([model_seed, 0x5EED])
        # About a quarter of the fields carry almost no signal, like real logs.
        importance = meta.uniform(0.4, 1.0, NUM_CATEGORICAL)
        importance[meta.permutation(NUM_CATEGORICAL)[:6]] = 0.08
        importance *= np.sqrt(0.52 * NUM_CATEGORICAL / np.sum(importance**2))
        self.field_scale = FIRST_ORDER_STD * importance
        self._first = []
        for f in range(NUM_CATEGORICAL):
            raw = self._table(f, 0)
            share = self._value_shares(f, exponent)
            std = np.sqrt(np.sum(share * raw**2) - np.sum(share * raw) ** 2)
            self._first.append(raw * (self.field_scale[f] / std))
        self.beta = meta.standard_normal(NUM_DENSE)
        self.beta_missing = meta.standard_normal(NUM_DENSE)
        self._latent = {f: np.stack([self._table(f, 1 + d) for d in range(FM_RANK)], axis=1)
                        for f in FM_FIELDS}
        # One fixed sample (a function of the settings alone) sets the scales and the bias.
        dense, cats = _draw_features(_CALIBRATION_ROWS, np.random.default_rng(0xCA11B),
                                     self.vocab, exponent)
        numeric_scale = NUMERIC_STD / self._numeric(dense).std()
        self.beta *= numeric_scale
        self.beta_missing *= numeric_scale
        latent_scale = np.sqrt(PAIRWISE_STD / self._pairwise(cats).std())
        for f in FM_FIELDS:
            self._latent[f] *= latent_scale
        self.bias = 0.0
        self.bias = _bias_for_ctr(self.logits(dense, cats), TARGET_CTR)

    def _table(self, field: int, component: int) -> np.ndarray:
        """Weights for ids ``0..V-1`` plus the missing value at index ``V`` (= ``[-1]``);
        rare values get smaller weights, so most signal sits where data can find it."""
        vocab = self.vocab[field]
        ids = np.arange(vocab + 1, dtype=np.int64)
        decay = 1.0 / np.sqrt(1.0 + ids / RANK_DECAY)
        decay[-1] = 1.0
        return _hash_normal(_stream_key(self.model_seed, field, component), ids) * decay

    def _value_shares(self, field: int, exponent: float) -> np.ndarray:
        """Probability of each value id (and, last, of a missing cell) in drawn rows."""
        cdf, _ = _zipf_table(self.vocab[field], exponent)
        miss = CATEGORICAL_MISSING[field]
        return np.append(np.diff(cdf, prepend=0.0) * (1.0 - miss), miss)

    def _numeric(self, dense: np.ndarray) -> np.ndarray:
        missing = np.isnan(dense)
        z = (np.log1p(np.where(missing, 0.0, dense)) - np.asarray(DENSE_MU)) \
            / np.asarray(DENSE_SIGMA)
        return np.where(missing, self.beta_missing, self.beta * np.clip(z, -3, 3)).sum(1)

    def _pairwise(self, categorical: np.ndarray) -> np.ndarray:
        # Σ_{f<g} <v_f, v_g> = (|Σ v|^2 - Σ |v|^2) / 2
        vecs = [self._latent[f][categorical[:, f]] for f in FM_FIELDS]
        total = np.sum(vecs, axis=0)
        return 0.5 * ((total * total).sum(1) - sum((v * v).sum(1) for v in vecs))

    def logits(self, dense: np.ndarray, categorical: np.ndarray) -> np.ndarray:
        """Ground-truth logit per row from raw counts (NaN = missing) and value ids."""
        logit = np.full(categorical.shape[0], self.bias)
        for f in range(NUM_CATEGORICAL):
            logit += self._first[f][categorical[:, f]]
        return logit + self._numeric(dense) + self._pairwise(categorical)

    def probabilities(self, dense: np.ndarray, categorical: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self.logits(dense, categorical)))


class DriftingTruth:
    """A ground truth that drifts: the logit of hour ``h`` rotates from truth A
    (``model_seed``) toward an independent truth B by the angle ``h * step``, with
    ``step = arccos(1 - drift)``::

        logit_h = bias_h + cos(h step) (logit_A - bias_A) + sin(h step) (logit_B - bias_B)

    so the planted logits of consecutive hours correlate ``1 - drift`` (hours ``h`` and
    ``h + k``: ``cos(k step)``), the logit's spread (and the ceiling AUC) stays that of one
    truth, and ``bias_h`` keeps the click rate at the target."""

    def __init__(self, model_seed: int, hour: int, drift: float, exponent: float = 1.1,
                 vocab_scale: float = 1.0, truth: str = "fm") -> None:
        if not 0.0 <= drift <= 1.0:
            raise ValueError(f"drift must be in [0, 1], got {drift}")
        self.name = truth
        self.a = ground_truth(model_seed, exponent, vocab_scale, truth)
        self.b = ground_truth(model_seed + 7919, exponent, vocab_scale, truth)
        self.vocab = self.a.vocab
        self.angle = hour * float(np.arccos(1.0 - drift))
        self.bias = 0.0
        dense, cats = _draw_features(_CALIBRATION_ROWS // 4, np.random.default_rng(0xCA11B),
                                     self.vocab, exponent)
        self.bias = _bias_for_ctr(self.logits(dense, cats), TARGET_CTR)

    def logits(self, dense: np.ndarray, categorical: np.ndarray) -> np.ndarray:
        la = self.a.logits(dense, categorical) - self.a.bias
        lb = self.b.logits(dense, categorical) - self.b.bias
        return self.bias + np.cos(self.angle) * la + np.sin(self.angle) * lb

    def probabilities(self, dense: np.ndarray, categorical: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self.logits(dense, categorical)))


def hourly_name(hour: int, start: str = "2026-12-01T00:00") -> str:
    """The time-partitioned file name of ``hour`` hours after ``start``."""
    from datetime import datetime, timedelta

    when = datetime.fromisoformat(start) + timedelta(hours=hour)
    return when.strftime("%Y-%m-%dT%H-%M") + ".tsv"


def generate_hourly(folder: str | Path, hours: int, rows: int, *, drift: float,
                    model_seed: int = 0, exponent: float = 1.1, vocab_scale: float = 1.0,
                    start: str = "2026-12-01T00:00", first_hour: int = 0,
                    truth: str = "fm") -> list[SynthInfo]:
    """``hours`` files of ``rows`` rows each, named by their hour (``hourly_name``), whose
    ground truth (of shape ``truth``) drifts by ``drift`` per hour (``DriftingTruth``);
    each with its ``.truth.json`` (hour, drift angle, ceiling AUC under that hour's truth)."""
    check_truth(truth)
    if hours <= 0:
        raise ValueError(f"hours must be positive, got {hours}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    infos = []
    for hour in range(first_hour, first_hour + hours):
        drifting = DriftingTruth(model_seed, hour, drift, exponent, vocab_scale, truth)
        info = generate(folder / hourly_name(hour, start), rows, model_seed=model_seed,
                        sample_seed=model_seed * 100_003 + hour, exponent=exponent,
                        vocab_scale=vocab_scale, truth=drifting, hour=hour)
        infos.append(info)
    return infos


def _bias_for_ctr(logits: np.ndarray, ctr: float) -> float:
    """The shift of ``logits`` whose mean sigmoid is ``ctr`` (bisection; it is monotone)."""
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if np.mean(1.0 / (1.0 + np.exp(-(logits + mid)))) < ctr:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def ground_truth(model_seed: int = 0, exponent: float = 1.1, vocab_scale: float = 1.0,
                 truth: str = "fm") -> ClickModel:
    """The (cached) ground truth for these settings; building one takes a few seconds."""
    return _cached_truth(int(model_seed), float(exponent), float(vocab_scale),
                         check_truth(truth))


@lru_cache(maxsize=8)
def _cached_truth(model_seed: int, exponent: float, vocab_scale: float,
                  truth: str) -> ClickModel:
    if truth == "fm":
        return GroundTruth(model_seed, exponent, vocab_scale)
    from terarec.data.synth_truths import ShapedTruth

    return ShapedTruth(truth, model_seed, exponent, vocab_scale)


# -- sampling ------------------------------------------------------------------------------

def _draw_features(n: int, rng: np.random.Generator, vocab: tuple[int, ...],
                   exponent: float) -> tuple[np.ndarray, np.ndarray]:
    u = rng.random((NUM_CATEGORICAL, n))
    ids = np.empty((NUM_CATEGORICAL, n), dtype=np.int64)
    for f, v in enumerate(vocab):
        _inverse_cdf(*_zipf_table(v, exponent), u[f], ids[f])
    for col in np.flatnonzero(CATEGORICAL_MISSING):
        ids[col, rng.random(n) < CATEGORICAL_MISSING[col]] = -1
    z = rng.standard_normal((NUM_DENSE, n))
    dense = np.floor(np.exp(np.asarray(DENSE_MU)[:, None] + np.asarray(DENSE_SIGMA)[:, None] * z))
    for j in np.flatnonzero(DENSE_MISSING):
        dense[j, rng.random(n) < DENSE_MISSING[j]] = np.nan
    return dense.T, ids.T


def _blocks(rows: int, sample_seed: int, start_block: int = 0):
    block = start_block
    while block * BLOCK_ROWS < rows:
        n = min(BLOCK_ROWS, rows - block * BLOCK_ROWS)
        yield n, np.random.default_rng([sample_seed, block, 0xB10C])
        block += 1


def _draw_block(n: int, rng: np.random.Generator, truth: ClickModel,
                exponent: float) -> SynthArrays:
    dense, cats = _draw_features(n, rng, truth.vocab, exponent)
    probs = truth.probabilities(dense, cats)
    labels = (rng.random(n) < probs).astype(np.float32)
    return SynthArrays(dense, cats, labels, probs)


def generate_arrays(rows: int, *, model_seed: int = 0, sample_seed: int = 0,
                    exponent: float = 1.1, vocab_scale: float = 1.0,
                    truth: str = "fm") -> SynthArrays:
    """The rows ``generate`` would write with the same arguments, in memory."""
    model = ground_truth(model_seed, exponent, vocab_scale, truth)
    out = SynthArrays(np.empty((rows, NUM_DENSE)), np.empty((rows, NUM_CATEGORICAL), np.int64),
                      np.empty(rows, np.float32), np.empty(rows))
    start = 0
    for n, rng in _blocks(rows, sample_seed):
        part = _draw_block(n, rng, model, exponent)
        for name in ("dense", "categorical", "labels", "probs"):
            getattr(out, name)[start:start + n] = getattr(part, name)
        start += n
    return out


# -- rendering -----------------------------------------------------------------------------

_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def categorical_strings(field: int, ids: np.ndarray) -> pa.Array:
    """Hex strings for value ids of categorical ``field`` (0-based); -1 gives "" (missing).

    The id -> string map is a bijection on 32 bits (an odd multiply and murmur3's fmix32,
    both invertible), so distinct ids never share a string.
    """
    x = (ids.astype(np.uint64) * np.uint64(0x9E3779B1) + np.uint64(0x7F4A7C15 * (field + 1)))
    x &= np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x85EBCA6B)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(13)
    x = (x * np.uint64(0xC2B2AE35)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    present = ids >= 0
    shifts = np.arange(28, -1, -4, dtype=np.uint64)
    digits = _HEX[((x[present, None] >> shifts) & np.uint64(0xF)).astype(np.intp)]
    lengths = np.where(present, 8, 0).astype(np.int32)
    offsets = np.zeros(ids.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.StringArray.from_buffers(ids.size, pa.py_buffer(offsets),
                                       pa.py_buffer(np.ascontiguousarray(digits)))


def _to_table(part: SynthArrays) -> pa.Table:
    columns: dict[str, pa.Array] = {"label": pa.array(part.labels.astype(np.int8))}
    missing = np.isnan(part.dense)
    counts = np.where(missing, 0, part.dense).astype(np.int64)
    for j in range(NUM_DENSE):
        columns[f"I{j + 1}"] = pa.array(counts[:, j], mask=missing[:, j])
    for f in range(NUM_CATEGORICAL):
        columns[f"C{f + 1}"] = categorical_strings(f, part.categorical[:, f])
    return pa.table(columns)


class _AUCHistogram:
    """Streaming AUC and log loss of known probabilities: counts per probability bin (2^16
    bins, so the AUC is exact to ~1e-5) instead of keeping every row."""

    bins = 1 << 16

    def __init__(self) -> None:
        self.pos = np.zeros(self.bins, dtype=np.int64)
        self.neg = np.zeros(self.bins, dtype=np.int64)
        self.logloss_sum = 0.0

    def add(self, probs: np.ndarray, labels: np.ndarray) -> None:
        idx = np.minimum((probs * self.bins).astype(np.int64), self.bins - 1)
        clicked = labels > 0.5
        self.pos += np.bincount(idx[clicked], minlength=self.bins)
        self.neg += np.bincount(idx[~clicked], minlength=self.bins)
        p = np.clip(probs, 1e-12, 1 - 1e-12)
        self.logloss_sum -= float(np.sum(np.where(clicked, np.log(p), np.log1p(-p))))

    def auc(self) -> float:
        pos, neg = self.pos.sum(), self.neg.sum()
        if pos == 0 or neg == 0:
            return float("nan")
        neg_below = np.cumsum(self.neg) - self.neg
        return float((np.sum(self.pos * neg_below) + 0.5 * np.sum(self.pos * self.neg))
                     / (pos * neg))

    def logloss(self) -> float:
        n = self.pos.sum() + self.neg.sum()
        return self.logloss_sum / n if n else float("nan")


def generate(path: str | Path, rows: int, *, model_seed: int = 0, sample_seed: int = 0,
             exponent: float = 1.1, vocab_scale: float = 1.0,
             chunk_rows: int = 4 * BLOCK_ROWS, truth: str | DriftingTruth = "fm",
             hour: int | None = None) -> SynthInfo:
    """Write ``rows`` Criteo-format rows to ``path`` (atomically), plus ``<path>.truth.json``.

    Memory stays at one chunk; ``chunk_rows`` is rounded up to whole blocks and does not
    change the output. ``truth``: the planted truth's shape (``TRUTHS``), or a drifting
    ground truth instead of ``model_seed``'s (``generate_hourly``).
    """
    if isinstance(truth, str):
        check_truth(truth)
    if rows <= 0:
        raise ValueError(f"rows must be positive, got {rows}")
    if exponent <= 0 or vocab_scale <= 0:
        raise ValueError(f"exponent and vocab_scale must be positive, got "
                         f"{exponent} / {vocab_scale}")
    path = Path(path)
    model = (ground_truth(model_seed, exponent, vocab_scale, truth) if isinstance(truth, str)
             else truth)
    blocks_per_chunk = max(1, -(-chunk_rows // BLOCK_ROWS))
    score = _AUCHistogram()
    clicks = 0.0
    options = pa_csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    with atomic_open(path, "wb") as fh:
        pending: list[SynthArrays] = []
        for n, rng in _blocks(rows, sample_seed):
            part = _draw_block(n, rng, model, exponent)
            score.add(part.probs, part.labels)
            clicks += float(part.labels.sum())
            pending.append(part)
            if len(pending) == blocks_per_chunk:
                pa_csv.write_csv(pa.concat_tables([_to_table(p) for p in pending]), fh, options)
                pending = []
        if pending:
            pa_csv.write_csv(pa.concat_tables([_to_table(p) for p in pending]), fh, options)
    info = SynthInfo(rows=rows, ctr=clicks / rows, ceiling_auc=score.auc(),
                     ceiling_logloss=float(score.logloss()), path=str(path), model_seed=model_seed,
                     sample_seed=sample_seed, exponent=exponent, vocab_scale=vocab_scale,
                     hour=hour, drift_angle=None if isinstance(truth, str) else truth.angle,
                     truth=truth if isinstance(truth, str) else truth.name)
    atomic_write_text(truth_path(path), json.dumps(asdict(info), indent=2))
    return info


def truth_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".truth.json")
