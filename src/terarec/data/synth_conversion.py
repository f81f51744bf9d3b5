"""Synthetic click-and-conversion logs: a second label planted on top of the click truth.

A conversion can only follow a click, and its probability shares the click truth's
factors plus factors of its own (a second, independent truth of the same shape)::

    click      ~ Bernoulli(sigmoid(logit_click))                 the ``synth`` truth
    cvr_logit  = bias_cvr + SHARED * (logit_click - bias_click)
                          + OWN * (logit_own - bias_own)         own: truth of seed + 1
    conversion = click and Bernoulli(sigmoid(cvr_logit))

So the two tasks share rows (what a multi-task model exploits), the conversion label is
sparse and is only observed after a click (what ESMM models), and both ceilings are
known: the click truth's AUC against the click labels, and
``P(conversion) = pCTR * pCVR`` against the conversion labels (an impression-level
score, as ESMM's pCTCVR).

The file is a CSV with a header (``click,conversion,I1..I13,C1..C26``): train it with
``--format csv --label click,conversion`` and the Criteo column names.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from terarec.data.synth import (
    _CALIBRATION_ROWS,
    NUM_CATEGORICAL,
    NUM_DENSE,
    SynthArrays,
    _AUCHistogram,
    _bias_for_ctr,
    _blocks,
    _draw_features,
    _to_table,
    check_truth,
    ground_truth,
    truth_path,
)
from terarec.io import atomic_open, atomic_write_text

SHARED = 0.8  # weight of the click truth's (centred) logit in the conversion logit
OWN = 0.8  # weight of the conversion's own factors
TARGET_CVR = 0.3  # mean P(conversion | click) over all rows (higher over clicked ones)
LABELS = ("click", "conversion")
NUMERIC = tuple(f"I{j + 1}" for j in range(NUM_DENSE))
CATEGORICAL = tuple(f"C{f + 1}" for f in range(NUM_CATEGORICAL))


@dataclass
class ConversionInfo:
    """What ``generate_conversion`` wrote; saved as ``<path>.truth.json``."""

    rows: int
    ctr: float
    cvr: float  # conversions per click
    conversion_rate: float  # conversions per row
    ceiling_auc: float  # the click truth's AUC on the click labels
    ceiling_logloss: float
    conversion_ceiling_auc: float  # pCTR * pCVR's AUC on the conversion labels
    conversion_ceiling_logloss: float
    path: str | None = None
    model_seed: int = 0
    sample_seed: int = 0
    truth: str = "fm"
    labels: tuple[str, ...] = LABELS


class ConversionTruth:
    """The click truth of ``model_seed`` and the conversion logit built on it."""

    def __init__(self, model_seed: int = 0, exponent: float = 1.1,
                 vocab_scale: float = 1.0, truth: str = "fm") -> None:
        check_truth(truth)
        self.click = ground_truth(model_seed, exponent, vocab_scale, truth)
        self.own = ground_truth(model_seed + 1, exponent, vocab_scale, truth)
        self.vocab = self.click.vocab
        self.exponent = exponent
        dense, cats = _draw_features(_CALIBRATION_ROWS, np.random.default_rng(0xC0417),
                                     self.vocab, exponent)
        self.bias = 0.0
        self.bias = _bias_for_ctr(self.cvr_logits(dense, cats), TARGET_CVR)

    def cvr_logits(self, dense: np.ndarray, categorical: np.ndarray) -> np.ndarray:
        """The logit of a conversion given a click."""
        shared = self.click.logits(dense, categorical) - self.click.bias
        own = self.own.logits(dense, categorical) - self.own.bias
        return self.bias + SHARED * shared + OWN * own

    def draw(self, n: int, rng: np.random.Generator
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(dense, categorical, click, conversion, pCTR, pCTR * pCVR) for ``n`` rows."""
        dense, cats = _draw_features(n, rng, self.vocab, self.exponent)
        p_click = self.click.probabilities(dense, cats)
        p_cvr = 1.0 / (1.0 + np.exp(-self.cvr_logits(dense, cats)))
        click = rng.random(n) < p_click
        conversion = click & (rng.random(n) < p_cvr)
        return dense, cats, click, conversion, p_click, p_click * p_cvr


def generate_conversion(path: str | Path, rows: int, *, model_seed: int = 0,
                        sample_seed: int = 0, exponent: float = 1.1,
                        vocab_scale: float = 1.0, truth: str = "fm") -> ConversionInfo:
    """Write ``rows`` click-and-conversion rows to ``path`` (CSV with a header,
    atomically), plus ``<path>.truth.json`` with both labels' rates and ceilings. Files
    of one ``model_seed`` share the truth; ``sample_seed`` draws their rows."""
    if rows <= 0:
        raise ValueError(f"rows must be positive, got {rows}")
    model = ConversionTruth(model_seed, exponent, vocab_scale, truth)
    click_score, conv_score = _AUCHistogram(), _AUCHistogram()
    clicks = conversions = 0.0
    options = pa_csv.WriteOptions(include_header=False, delimiter=",", quoting_style="none")
    path = Path(path)
    with atomic_open(path, "wb") as fh:
        fh.write((",".join((*LABELS, *NUMERIC, *CATEGORICAL)) + "\n").encode())
        for n, rng in _blocks(rows, sample_seed):
            dense, cats, click, conversion, p_click, p_conv = model.draw(n, rng)
            click_score.add(p_click, click)
            conv_score.add(p_conv, conversion)
            clicks += float(click.sum())
            conversions += float(conversion.sum())
            table = _to_table(SynthArrays(dense, cats, click.astype(np.float32), p_click))
            table = table.rename_columns(["click", *table.column_names[1:]])
            table = table.add_column(1, "conversion", pa.array(conversion.astype(np.int8)))
            pa_csv.write_csv(table, fh, options)
    info = ConversionInfo(
        rows=rows, ctr=clicks / rows, cvr=conversions / max(clicks, 1.0),
        conversion_rate=conversions / rows, ceiling_auc=click_score.auc(),
        ceiling_logloss=float(click_score.logloss()), conversion_ceiling_auc=conv_score.auc(),
        conversion_ceiling_logloss=float(conv_score.logloss()), path=str(path),
        model_seed=model_seed, sample_seed=sample_seed, truth=truth)
    atomic_write_text(truth_path(path), json.dumps(asdict(info), indent=2))
    return info

