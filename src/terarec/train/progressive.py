"""Progressive validation: every pass is scored by the model as it stands before the pass
trains it, the standard online metric of a model trained on a stream (each row is
predicted before the model has seen it, as serving would have predicted it).

Figures go into the pass's history record: ``progressive_rows`` / ``_auc`` /
``_logloss`` for the pass, and ``file_done`` / ``file_rows`` / ``file_auc`` /
``file_logloss`` on the pass that finishes a file (over that file's passes scored by this
process). With several labels each task's figures come too (``progressive_auc_<task>``,
``file_auc_<task>``, ... ``logloss``), the plain ones being the label weights' mean. An
undefined figure (one class only) is recorded as None, never NaN.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from terarec.data.positions import PassInput
from terarec.train.passes import Pass


def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


class ProgressiveScorer:
    """Scores passes before they train and keeps the current file's scores."""

    def __init__(self) -> None:
        self._file: str | None = None
        self._labels: list[np.ndarray] = []
        self._probs: list[np.ndarray] = []
        self._earlier: tuple[int, float | None] = (0, None)

    def score(self, trainer: Any, p: Pass, info: PassInput) -> dict[str, Any]:
        """Score pass ``p`` with ``trainer``'s current model (collective on N ranks: every
        rank gets the figures over all ranks' rows); the history fields it adds."""
        probs = trainer.predict_pass(p)
        labels = (np.concatenate([b.labels.numpy() for b in p.batches]) if p.batches
                  else np.empty(0, np.float32))
        labels, probs = trainer._all_scores(labels, probs)
        record: dict[str, Any] = {"progressive_rows": int(len(labels))}
        if len(labels):
            m = trainer.score_metrics(labels, probs)
            record.update({f"progressive_{k}": finite_or_none(v) for k, v in m.items()
                           if k.startswith(("auc", "logloss"))})
        if len(info.files) != 1:  # a pass over several files: no per-file figure
            self._reset(None)
            return record
        key = info.files[0]
        if key != self._file:
            self._reset(key)
            self._earlier = _earlier_part(trainer.history, Path(key).name)
        self._labels.append(labels)
        self._probs.append(probs)
        if key in info.finished:
            all_labels, all_probs = np.concatenate(self._labels), np.concatenate(self._probs)
            m = trainer.score_metrics(all_labels, all_probs) if len(all_labels) else {}
            n, loss = len(all_labels), finite_or_none(m.get("logloss", math.nan))
            record.update(file_done=Path(key).name, file_rows=n,
                          file_auc=finite_or_none(m.get("auc", math.nan)),
                          file_logloss=loss)
            earlier_rows, earlier_loss = self._earlier
            record.update({f"file_{k}": None if earlier_rows and k.startswith("logloss")
                           else finite_or_none(v) for k, v in m.items()  # several labels
                           if k.startswith(("auc_", "logloss_"))})
            if earlier_rows:  # trained before a restart: rows and log loss add up
                total = n + earlier_rows
                record.update(
                    file_rows=total, file_auc_rows=n,
                    file_logloss=None if loss is None or earlier_loss is None
                    else (loss * n + earlier_loss) / total)
            self._reset(None)
        return record

    def _reset(self, key: str | None) -> None:
        self._file, self._labels, self._probs = key, [], []
        self._earlier = (0, None)


def _earlier_part(history: list[dict], name: str) -> tuple[int, float | None]:
    """(rows, summed log loss; None when a pass has none) of the passes at the end of
    ``history`` that read file ``name`` alone without finishing it: its part trained
    before the run was restarted (empty in a run never restarted, whose last record
    finished the file before)."""
    rows, loss = 0, 0.0
    known = True
    for record in reversed(history):
        if record.get("files") != [name] or "file_done" in record:
            break
        n = int(record.get("progressive_rows", 0))
        rows += n
        if n and record.get("progressive_logloss") is None:
            known = False
        elif n:
            loss += float(record["progressive_logloss"]) * n
    return rows, loss if known else None


def progressive_summary(history: list[dict]) -> dict[str, float | int | None]:
    """Row-weighted means of the per-file progressive figures in ``history``."""
    files = [h for h in history if h.get("file_auc") is not None and h.get("file_rows")]
    rows = sum(h["file_rows"] for h in files)
    if not rows:
        return {"progressive_files": 0, "progressive_auc": None, "progressive_logloss": None}
    mean = {k: sum(h[f"file_{k}"] * h["file_rows"] for h in files
                   if h.get(f"file_{k}") is not None) / rows for k in ("auc", "logloss")}
    out: dict[str, float | int | None] = {
        "progressive_files": len(files), "progressive_auc": mean["auc"],
        "progressive_logloss": mean["logloss"]}
    tasks = dict.fromkeys(k[len("file_"):] for h in files for k in h
                          if k.startswith(("file_auc_", "file_logloss_")) and k != "file_auc_rows")
    for k in tasks:  # several labels: each task's mean over the files that define it
        known = [h for h in files if h.get(f"file_{k}") is not None]
        weight = sum(h["file_rows"] for h in known)
        out[f"progressive_{k}"] = (sum(h[f"file_{k}"] * h["file_rows"] for h in known)
                                   / weight if weight else None)
    return out
