"""AUC and logloss agree with scikit-learn, ties and one-class input included."""

import numpy as np
import pytest
from scipy.stats import rankdata
from sklearn.metrics import log_loss, roc_auc_score

from terarec.train.metrics import auc, average_ranks, logloss


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_average_ranks_match_scipy_with_ties(n: int) -> None:
    rng = np.random.default_rng(n)
    for values in (rng.normal(size=n), rng.integers(0, 4, n).astype(np.float64),
                   np.full(n, 0.5)):
        np.testing.assert_array_equal(average_ranks(values), rankdata(values))


def test_auc_and_logloss_match_sklearn() -> None:
    rng = np.random.default_rng(0)
    labels = (rng.random(5000) < 0.3).astype(np.float32)
    # rounded scores: many ties, which count one half
    probs = np.round(np.clip(0.3 + 0.2 * (labels - 0.3) + rng.normal(0, 0.2, 5000), 0.01,
                             0.99), 2).astype(np.float32)
    assert auc(labels, probs) == pytest.approx(roc_auc_score(labels, probs), abs=1e-12)
    assert logloss(labels, probs) == pytest.approx(log_loss(labels, probs), rel=1e-6)


def test_auc_is_nan_for_one_class() -> None:
    assert np.isnan(auc(np.ones(4), np.array([0.1, 0.2, 0.3, 0.4])))
    assert np.isnan(auc(np.empty(0), np.empty(0)))
