"""Synthetic click logs: determinism, shared ground truth, Zipf shape, learnable signal."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from sklearn.linear_model import SGDClassifier
from sklearn.metrics import log_loss, roc_auc_score

from terarec.cli.main import main
from terarec.data import synth
from terarec.data.hashing import hash_column
from terarec.data.readers import iter_batches
from terarec.types import Batch, FeatureSchema

SMALL = 0.05  # vocab_scale for tests that do not need Criteo-sized vocabularies
CRITEO = FeatureSchema.criteo()


def test_file_is_deterministic_and_independent_of_chunking(tmp_path):
    rows = synth.BLOCK_ROWS + 500  # two blocks, so chunking could matter
    a = synth.generate(tmp_path / "a.tsv", rows, vocab_scale=SMALL, chunk_rows=1)
    b = synth.generate(tmp_path / "b.tsv", rows, vocab_scale=SMALL)
    c = synth.generate(tmp_path / "c.tsv", rows, vocab_scale=SMALL, sample_seed=1)
    data = (tmp_path / "a.tsv").read_bytes()
    assert data == (tmp_path / "b.tsv").read_bytes()
    assert data != (tmp_path / "c.tsv").read_bytes()
    assert data.count(b"\n") == rows
    assert (a.ctr, a.ceiling_auc) == (b.ctr, b.ceiling_auc)
    assert a.ctr != c.ctr


def test_file_round_trips_through_the_reader_and_matches_arrays(tmp_path):
    path = tmp_path / "train.tsv"
    info = synth.generate(path, 3000, model_seed=3, sample_seed=4, vocab_scale=SMALL)
    arrays = synth.generate_arrays(3000, model_seed=3, sample_seed=4, vocab_scale=SMALL)
    batch = Batch.concat(list(iter_batches(path, CRITEO, batch_size=1024)))
    assert batch.labels.numpy().tolist() == arrays.labels.tolist()
    missing = np.isnan(arrays.dense)
    counts = np.where(missing, 0.0, arrays.dense)
    np.testing.assert_allclose(batch.dense[:, :13].numpy(), np.log1p(counts), rtol=1e-6)
    assert np.array_equal(batch.dense[:, 13:].numpy(), missing)
    assert missing.any() and (arrays.categorical == -1).any()
    for f, name in enumerate(CRITEO.sparse_names):
        strings = synth.categorical_strings(f, arrays.categorical[:, f])
        expected = hash_column(name, strings, CRITEO.hash_salt)
        assert np.array_equal(batch.sparse.field_values(name).numpy(), expected)
    saved = json.loads(synth.truth_path(path).read_text())
    assert saved["rows"] == 3000 and saved["model_seed"] == 3 and saved["sample_seed"] == 4
    assert saved["ctr"] == pytest.approx(arrays.labels.mean())
    assert saved["ceiling_auc"] == pytest.approx(info.ceiling_auc)


def test_value_strings_are_distinct_hex_and_missing_is_empty():
    ids = np.arange(-1, 200_000)
    strings = synth.categorical_strings(2, ids).to_pylist()
    assert strings[0] == ""
    assert len(set(strings[1:])) == 200_000
    assert all(len(s) == 8 and int(s, 16) >= 0 for s in strings[1:1000])
    other = synth.categorical_strings(3, ids[1:1000]).to_pylist()
    assert other != strings[1:1000]


def test_ground_truth_is_shared_across_sample_seeds():
    a = synth.generate_arrays(20_000, model_seed=5, sample_seed=1, vocab_scale=SMALL)
    b = synth.generate_arrays(20_000, model_seed=5, sample_seed=2, vocab_scale=SMALL)
    fresh = synth.GroundTruth(model_seed=5, vocab_scale=SMALL)  # rebuilt, not cached
    for arrays in (a, b):
        np.testing.assert_allclose(fresh.probabilities(arrays.dense, arrays.categorical),
                                   arrays.probs, rtol=1e-12)
    other = synth.GroundTruth(model_seed=6, vocab_scale=SMALL)
    assert not np.allclose(other.probabilities(b.dense, b.categorical), b.probs, atol=0.01)


def test_value_effects_replicate_across_samples_only_under_the_same_model():
    def value_ctr(arrays: synth.SynthArrays, field: int) -> np.ndarray:
        ids = arrays.categorical[:, field]
        shown = np.bincount(ids[ids >= 0], minlength=20)[:20]
        clicks = np.bincount(ids[ids >= 0], weights=arrays.labels[ids >= 0],
                             minlength=20)[:20]
        return clicks / shown

    truth = synth.ground_truth(0)
    # the most informative field with a small vocabulary: 24 values
    field = 5
    assert truth.vocab[field] == 24 and truth.field_scale[field] > 0.1
    a = synth.generate_arrays(60_000, model_seed=0, sample_seed=1)
    b = synth.generate_arrays(60_000, model_seed=0, sample_seed=2)
    c = synth.generate_arrays(60_000, model_seed=1, sample_seed=2)
    same = np.corrcoef(value_ctr(a, field), value_ctr(b, field))[0, 1]
    different = np.corrcoef(value_ctr(a, field), value_ctr(c, field))[0, 1]
    assert same > 0.8
    assert different < same - 0.3


def test_categorical_values_follow_a_bounded_zipf_law():
    for exponent in (1.1, 1.6):
        arrays = synth.generate_arrays(50_000, exponent=exponent, sample_seed=9)
        ids = arrays.categorical[:, 2]  # C3: a million values
        ids = ids[ids >= 0]
        counts = np.bincount(ids, minlength=30)[:30].astype(float)
        ranks = np.arange(1, 31)
        slope = np.polyfit(np.log(ranks), np.log(counts), 1)[0]
        assert slope == pytest.approx(-exponent, abs=0.15)
        top_share = counts[0] / ids.size
        harmonic = np.sum(np.arange(1, 1_000_001, dtype=float) ** -exponent)
        assert top_share == pytest.approx(1 / harmonic, rel=0.08)


def test_default_settings_give_criteo_like_ctr_and_ceiling():
    arrays = synth.generate_arrays(100_000, sample_seed=3)
    assert 0.20 <= arrays.labels.mean() <= 0.25
    ceiling = roc_auc_score(arrays.labels, arrays.probs)
    assert 0.75 <= ceiling <= 0.81
    # the planted probabilities are calibrated: labels are drawn from them
    assert arrays.probs.mean() == pytest.approx(arrays.labels.mean(), abs=0.01)


def test_logistic_regression_on_hashed_keys_learns_the_signal(tmp_path):
    train = synth.generate(tmp_path / "t.tsv", 20_000, sample_seed=0, vocab_scale=SMALL)
    valid = synth.generate(tmp_path / "v.tsv", 10_000, sample_seed=1, vocab_scale=SMALL)
    tr = Batch.concat(list(iter_batches(train.path, CRITEO, 8192)))
    va = Batch.concat(list(iter_batches(valid.path, CRITEO, 8192)))
    vocab = np.unique(tr.sparse.values.numpy())

    def one_hot(batch: Batch):
        from scipy import sparse

        keys = batch.sparse.values.numpy().reshape(26, -1).T
        col = np.minimum(np.searchsorted(vocab, keys), vocab.size - 1)
        seen = (vocab[col] == keys).astype(float)
        rows = np.repeat(np.arange(len(batch)), 26)
        return sparse.csr_matrix((seen.ravel(), (rows, col.ravel())),
                                 shape=(len(batch), vocab.size))

    model = SGDClassifier(loss="log_loss", alpha=1e-4, max_iter=10, tol=None, average=True,
                          random_state=0).fit(one_hot(tr), tr.labels.numpy())
    auc = roc_auc_score(va.labels.numpy(), model.decision_function(one_hot(va)))
    assert auc > 0.68
    assert auc < valid.ceiling_auc + 0.01


def test_streamed_auc_and_logloss_match_exact_ones():
    arrays = synth.generate_arrays(30_000, sample_seed=5, vocab_scale=SMALL)
    hist = synth._AUCHistogram()
    hist.add(arrays.probs[:10_000], arrays.labels[:10_000])
    hist.add(arrays.probs[10_000:], arrays.labels[10_000:])
    assert hist.auc() == pytest.approx(roc_auc_score(arrays.labels, arrays.probs), abs=2e-4)
    assert hist.logloss() == pytest.approx(log_loss(arrays.labels, arrays.probs), rel=1e-9)


def test_generate_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="rows"):
        synth.generate(tmp_path / "x.tsv", 0)
    with pytest.raises(ValueError, match="exponent"):
        synth.generate(tmp_path / "x.tsv", 10, exponent=0)


def test_cli_writes_train_and_valid_and_reports_the_ceiling(tmp_path, capsys):
    out, valid = tmp_path / "train.tsv", tmp_path / "valid.tsv"
    code = main(["synth", "--rows", "3000", "--out", str(out), "--valid-rows", "1000",
                 "--valid-out", str(valid), "--seed", "2", "--vocab-scale", str(SMALL)])
    assert code == 0
    printed = capsys.readouterr().out
    train_info = json.loads(synth.truth_path(out).read_text())
    valid_info = json.loads(synth.truth_path(valid).read_text())
    assert (train_info["rows"], valid_info["rows"]) == (3000, 1000)
    assert train_info["model_seed"] == valid_info["model_seed"] == 2
    assert train_info["sample_seed"] != valid_info["sample_seed"]
    assert len(Path(valid).read_text().splitlines()) == 1000
    assert f"{train_info['ceiling_auc']:.4f}" in printed
    assert f"{100 * valid_info['ctr']:.2f} %" in printed


def test_cli_rejects_half_given_validation_arguments(tmp_path, capsys):
    code = main(["synth", "--rows", "10", "--out", str(tmp_path / "t.tsv"),
                 "--valid-rows", "5"])
    assert code == 2
    assert "--valid-out" in capsys.readouterr().err
    assert not (tmp_path / "t.tsv").exists()


SYNTH_ERRORS = [
    (["--drift", "0.5"], "--drift applies only with --hourly"),
    (["--users", "5"], "--users applies only with --retrieval"),
    (["--retrieval", "--exponent", "1.2"],
     "--exponent applies only to click logs, not with --retrieval"),
    (["--exponent", "0"], "--exponent must be > 0, got 0.0"),
    (["--out", "DIR"], "--out DIR is a folder; synth writes one file there (a folder only "
                       "with --hourly)"),
    (["--out", "DIR/afile/t.tsv"], "--out DIR/afile/t.tsv: DIR/afile is a file, not a folder"),
]


@pytest.mark.parametrize("extra,message", SYNTH_ERRORS, ids=[" ".join(a) for a, _ in SYNTH_ERRORS])
def test_cli_refuses_flags_of_another_mode_and_unwritable_outs(tmp_path, capsys, extra,
                                                                message):
    """Each was ignored (a flag of another mode) or a traceback (an --out that cannot be
    written, a folder)."""
    (tmp_path / "afile").write_text("")
    argv = ["synth", "--rows", "10", "--out", str(tmp_path / "t.tsv"), *extra]
    argv = [a.replace("DIR", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"terarec synth: error: {message.replace('DIR', str(tmp_path))}"
    assert not (tmp_path / "t.tsv").exists() or "--out" in extra


def test_arrays_have_documented_shapes_and_types():
    arrays = synth.generate_arrays(100, vocab_scale=SMALL)
    assert arrays.dense.shape == (100, 13) and arrays.dense.dtype == np.float64
    assert arrays.categorical.shape == (100, 26) and arrays.categorical.dtype == np.int64
    assert arrays.labels.dtype == np.float32 and set(np.unique(arrays.labels)) <= {0.0, 1.0}
    assert ((arrays.probs > 0) & (arrays.probs < 1)).all()
    vocab = np.asarray(synth.vocab_sizes(SMALL))
    assert (arrays.categorical < vocab).all() and (arrays.categorical >= -1).all()
    assert isinstance(synth.categorical_strings(0, arrays.categorical[:, 0]), pa.StringArray)


def test_hourly_truth_drifts_by_the_planted_amount(tmp_path):
    """Consecutive hours' planted logits correlate 1 - drift, hours k apart cos(k step)."""
    from terarec.data.synth import (
        DriftingTruth,
        _draw_features,
        generate_hourly,
        hourly_name,
    )

    rng = np.random.default_rng(5)
    truths = [DriftingTruth(2, h, 0.1, vocab_scale=0.01) for h in range(4)]
    dense, cats = _draw_features(50_000, rng, truths[0].vocab, 1.1)
    logits = [t.logits(dense, cats) for t in truths]
    step = np.arccos(0.9)
    for k in (1, 3):
        corr = np.corrcoef(logits[0], logits[k])[0, 1]
        assert abs(corr - np.cos(k * step)) < 0.03, (k, corr)
    assert np.std(logits[3]) == pytest.approx(np.std(logits[0]), rel=0.2)
    same = DriftingTruth(2, 5, 0.0, vocab_scale=0.01)  # no drift: hour 0's truth
    np.testing.assert_allclose(same.logits(dense, cats), logits[0], atol=1e-6)
    infos = generate_hourly(tmp_path, 2, 300, drift=0.1, model_seed=2, vocab_scale=0.01,
                            start="2026-12-01T23:00")
    assert [Path(i.path).name for i in infos] == ["2026-12-01T23-00.tsv",
                                                  "2026-12-02T00-00.tsv"]
    assert hourly_name(1, "2026-12-01T23:00") == "2026-12-02T00-00.tsv"
    assert [i.drift_angle for i in infos] == pytest.approx([0.0, step])
    assert all(0.1 < i.ctr < 0.4 for i in infos)
