"""Offline metrics: AUC and logloss (scikit-learn), guarded against one-class input.

scikit-learn is imported on first use: it takes most of a second, and commands that never
score (serve, export, synth, inspect) should not wait for it."""

from __future__ import annotations

import numpy as np


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC; NaN when only one class is present (AUC is undefined there)."""
    labels = np.asarray(labels)
    if labels.size == 0 or labels.min() == labels.max():
        return float("nan")
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(labels, scores))


def logloss(labels: np.ndarray, probs: np.ndarray) -> float:
    if len(labels) == 0:
        return float("nan")
    from sklearn.metrics import log_loss

    return float(log_loss(labels, np.clip(probs, 1e-7, 1 - 1e-7), labels=[0, 1]))


def evaluate_scores(labels: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    return {"auc": auc(labels, probs), "logloss": logloss(labels, probs),
            "ctr": float(np.mean(labels)) if len(labels) else float("nan"),
            "mean_prediction": float(np.mean(probs)) if len(probs) else float("nan")}
