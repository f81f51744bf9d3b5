"""Planted truths of every shape: the default FM truth's output is pinned, and each truth
is deterministic, chunking-independent and scored by its own probabilities."""

from __future__ import annotations

import hashlib
import json

import pytest

from terarec.data import synth

# sha256 of the default (FM) truth's file and its ceiling: data sets, tests and recorded
# benchmark figures are made with these settings, so the default output must not drift.
PINNED = [
    (dict(rows=2000, model_seed=1, sample_seed=2, vocab_scale=0.05),
     "b584a483c812856c5b49a1aef9609700913139a0004821acb3c20b8ed5614bbb", 0.7415978306216103),
    (dict(rows=1000, model_seed=0, sample_seed=0),
     "a25ab3e9b6b1d22e8d9c00af7f97dcc02471c9c5f602028702517eba5470de7a", 0.782152465832692),
]


@pytest.mark.parametrize("settings,digest,ceiling", PINNED)
def test_default_truth_output_is_pinned(tmp_path, settings, digest, ceiling):
    path = tmp_path / "fm.tsv"
    settings = dict(settings)
    info = synth.generate(path, settings.pop("rows"), **settings)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    assert info.ceiling_auc == pytest.approx(ceiling, abs=1e-9)
    assert json.loads(synth.truth_path(path).read_text())["ceiling_auc"] == pytest.approx(
        ceiling, abs=1e-9)
