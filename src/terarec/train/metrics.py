"""Offline metrics: AUC and logloss, guarded against one-class input.

AUC is the Mann-Whitney statistic over average ranks (ties count one half), the value
scikit-learn's ``roc_auc_score`` gives, in a few ms rather than tens: a search scores
every trial after every pass. The ranks are numpy's (one sort): importing scipy's
``rankdata`` alone took about a second of every training run's start-up."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC; NaN when only one class is present (AUC is undefined there)."""
    labels = np.asarray(labels)
    if labels.size == 0 or labels.min() == labels.max():
        return float("nan")
    positive = labels > 0.5
    n_pos = float(positive.sum())
    n_neg = float(labels.size) - n_pos
    ranks = average_ranks(np.asarray(scores, np.float64))
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks of ``values``, ties sharing their average rank (scipy's
    ``rankdata(method="average")``)."""
    order = np.argsort(values, kind="mergesort")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], len(values)]
    ranks = np.empty(len(values), np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def logloss(labels: np.ndarray, probs: np.ndarray) -> float:
    """Mean binary cross-entropy, probabilities clipped to [1e-7, 1 - 1e-7]."""
    if len(labels) == 0:
        return float("nan")
    y = np.asarray(labels, np.float64)
    # Clipped in the scores' own precision (float32 from the model), no closer to 0 or 1
    # than it resolves (as scikit-learn's log_loss does), then summed in float64.
    probs = np.asarray(probs)
    eps = max(1e-7, float(np.finfo(probs.dtype).eps)) if probs.dtype.kind == "f" else 1e-7
    p = np.clip(probs, eps, 1 - eps).astype(np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def evaluate_scores(labels: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    return {"auc": auc(labels, probs), "logloss": logloss(labels, probs),
            "ctr": float(np.mean(labels)) if len(labels) else float("nan"),
            "mean_prediction": float(np.mean(probs)) if len(probs) else float("nan")}


def evaluate_tasks(labels: np.ndarray, probs: np.ndarray, tasks: Sequence[str],
                   weights: Sequence[float]) -> dict[str, float]:
    """``evaluate_scores`` per column of ``[N, T]`` labels and probabilities, as
    ``auc_<task>``, ``logloss_<task>``, ``ctr_<task>`` and ``mean_prediction_<task>``;
    ``auc`` and ``logloss`` are the ``weights``-weighted mean over the tasks where they
    are defined (selection by a weighted sum), ``ctr`` and ``mean_prediction`` the first
    task's."""
    out: dict[str, float] = {}
    per_task = [evaluate_scores(labels[:, t], probs[:, t]) for t in range(len(tasks))]
    for key in ("auc", "logloss"):
        pairs = [(w, m[key]) for w, m in zip(weights, per_task, strict=True)
                 if np.isfinite(m[key]) and w > 0]
        total = sum(w for w, _ in pairs)
        out[key] = float(sum(w * v for w, v in pairs) / total) if total > 0 else float("nan")
    out["ctr"], out["mean_prediction"] = per_task[0]["ctr"], per_task[0]["mean_prediction"]
    for name, m in zip(tasks, per_task, strict=True):
        out.update({f"{key}_{name}": value for key, value in m.items()})
    return out


def offset_shift(labels: np.ndarray, probs: np.ndarray, iterations: int = 100) -> float:
    """The constant added to every logit that makes the mean prediction equal the mean
    label: the root of an increasing function of one variable, found by Newton steps
    kept inside a shrinking bracket (bisection where a step would leave it, as far from
    the answer as a probability of 1 - 1e-7 is); 0 when the labels are of one class."""
    y = np.asarray(labels, np.float64)
    if y.size == 0 or y.min() == y.max():
        return 0.0
    target = float(y.mean())
    p = np.clip(np.asarray(probs, np.float64), 1e-7, 1 - 1e-7)
    logits = np.log(p) - np.log1p(-p)
    low, high = -40.0, 40.0
    shift = 0.0
    for _ in range(iterations):
        q = 0.5 * (1.0 + np.tanh(0.5 * (logits + shift)))  # the sigmoid, overflow-free
        excess = float(q.mean()) - target
        if abs(excess) < 1e-12:
            break
        if excess > 0:
            high = shift
        else:
            low = shift
        slope = float((q * (1.0 - q)).mean())
        step = shift - excess / slope if slope > 0 else np.inf
        shift = step if low < step < high else 0.5 * (low + high)
        if high - low < 1e-12:
            break
    return float(shift)
