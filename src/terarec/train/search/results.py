"""What a search leaves on disk: each trial's files, the best model and the results.

::

    out/trials/trial-NNN/   each trial's history.json and metrics.json, as train writes
    out/best/               the best trial as an ordinary model directory
    out/results.json        one row per trial, best first (also results.csv)
    out/report.html         per-trial validation curves, importances, the results table
"""

from __future__ import annotations

import csv
import io
import math
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from terarec.config import TrainConfig
from terarec.io import atomic_write_text, finite_json
from terarec.modeldir import LATEST_FILE, best_checkpoint, write_train_config
from terarec.train.search.trials import SearchResult, SearchTrial

if TYPE_CHECKING:
    from optuna import Study


def write_trial_files(t: SearchTrial) -> None:
    """history.json and metrics.json of a trial, as train writes them."""
    t.model_dir.mkdir(parents=True, exist_ok=True)
    history = [*t.history[:-1], {**t.history[-1], "stop_reason": t.stop_reason}] \
        if t.history else []
    atomic_write_text(t.model_dir / "history.json", finite_json(history, indent=2))
    row = t.row()
    metrics = {"auc": row["valid_auc"], "logloss": row["valid_logloss"],
               "evaluated_on": "valid", "checkpoint": f"pass-{row['best_pass']:06d}"
               if row["best_pass"] else None, "passes": row["passes"],
               "stop_reason": row["stop_reason"], "model": t.config.model.name,
               "trial": t.number, "params": t.params, "state": t.state,
               "seconds": t.seconds, **t.selection.summary(),
               **({"continued_from": t.continued_from} if t.continued_from else {})}
    atomic_write_text(t.model_dir / "metrics.json", finite_json(metrics, indent=2))


def write_best(best: SearchTrial, out_dir: Path, base: TrainConfig) -> Path:
    """Copy the best trial's directory (less its live store folder) to ``out/best``. Its
    configuration keeps base's store budget and folder, not the trial's share of the
    budget and folder under trials/: ``out/best`` is an ordinary model directory, which
    a refit, ``train --resume`` or ``eval`` uses alone. Of its checkpoints only the one
    ``BEST`` names is copied (and is ``LATEST`` there): the trial's later passes lost."""
    target = out_dir / "best"
    tmp = out_dir / ".best.tmp"
    chosen = best_checkpoint(best.model_dir)

    def skipped(folder: str, names: list[str]) -> list[str]:
        if chosen is not None and Path(folder).name == "checkpoints":
            return [n for n in names if n != chosen]
        return [n for n in names if n == "store"]  # the live disk tier

    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(best.model_dir, tmp, ignore=skipped)
    if chosen is not None:
        atomic_write_text(tmp / LATEST_FILE, chosen)
    store = replace(best.config.store, memory_budget=base.store.memory_budget,
                    disk_path=base.store.disk_path)
    write_train_config(tmp, replace(best.config, store=store))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def write_results(result: SearchResult, out_dir: str | Path) -> tuple[Path, Path]:
    """results.json and results.csv: one row per trial, best first."""
    out_dir = Path(out_dir)
    rows = result.rows()
    best = result.best.number if result.best else None
    sign = -1.0 if result.best is not None and result.best.selection.maximize else 1.0
    # best first, then every scored trial by its value, then the unscored ones
    rows.sort(key=lambda r: (r["trial"] != best, r["value"] is None,
                             sign * r["value"] if r["value"] is not None else 0.0,
                             r["trial"]))
    payload = {"best_trial": best, "best_dir": str(result.best_dir) if result.best_dir
               else None, "seconds": result.seconds, "trials": rows}
    json_path = out_dir / "results.json"
    atomic_write_text(json_path, finite_json(payload, indent=2))
    columns = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    csv_path = out_dir / "results.csv"
    atomic_write_text(csv_path, buf.getvalue())
    return json_path, csv_path


def param_importances(study: Study | None) -> dict[str, float]:
    """optuna's parameter importances (fANOVA), or {} when too few trials finished or no
    parameter varied."""
    import optuna

    if study is None:
        return {}
    complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    if len(complete) < 2:
        return {}
    try:
        return dict(optuna.importance.get_param_importances(study))
    except (RuntimeError, ValueError, ZeroDivisionError):
        return {}


def write_search_report(result: SearchResult, out_dir: str | Path) -> Path:
    """The HTML report: per-trial validation curves, importances, the results table."""
    from terarec.report import write_search_report as write_page

    metric = result.trials[0].selection.select_by if result.trials else "logloss"
    curves = {}
    for t in result.trials:
        points = [(h["pass_id"] + 1, h[f"valid_{metric}"]) for h in t.history
                  if math.isfinite(h.get(f"valid_{metric}", math.nan))]
        curves[f"trial {t.number}{' (pruned)' if t.state == 'pruned' else ''}"] = (
            [x for x, _ in points], [y for _, y in points])
    best = result.best
    summary = {"trials": len(result.trials),
               "pruned": sum(t.state == "pruned" for t in result.trials),
               "best trial": best.number if best else None,
               f"best validation {metric}": best.selection.best_value if best else None,
               "best model directory": str(result.best_dir) if result.best_dir else None,
               "seconds": result.seconds,
               **({f"best {k}": v for k, v in best.params.items()} if best else {})}
    rows = sorted(result.rows(), key=lambda r: (best is None or r["trial"] != best.number,
                                                r["state"] != "complete"))
    return write_page(out_dir, rows, curves, param_importances(result.study), metric,
                      summary)
