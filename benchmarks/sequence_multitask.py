"""Modern ranking models against their references, measured in one run.

Each part is a function returning its keys; ``main`` merges them into one JSON line.

Behaviour sequences (docs/sequences.md):

- ``sequence``: ``terarec synth --history`` rows (``label,user,item,hist``), the click
  probability depending on whether the user's history holds an item of the candidate's
  subtopic, with its Bayes ceiling AUC (``auc_ceiling``) on the scored rows. ``auc_din``:
  ``din`` with ``hist`` a sequence field sharing ``item``'s table; ``auc_no_sequence``:
  ``deepfm`` over ``user`` and ``item``; ``auc_sum_pooled``: ``deepfm`` with ``hist`` a
  multi-valued field, sum-pooled, on ``item``'s table. Same rows, same scored rows.
- ``speed``: ``deepfm`` with ``hist`` a sequence field of length 50 against the same model
  without it (``sps_ratio_sequence50``: median training samples per second over the
  passes after the first), on rows whose histories reach 50.

Multi-task (several labels in one model, docs/multitask.md):

- ``adult``: Adult (../shared/data/adult) as two tasks, as in the MMoE paper's census
  setup: income (the file's label) and marital status never-married, with the
  marital-status column removed from the inputs. One MMoE (both labels) against two
  single-task DeepFMs, the same settings on each side (a default ``train``'s data-sized
  batch size, rates and epoch bound; patience ends each run): trained on the first 87.5 % of
  train.csv, the best pass selected by validation AUC on the rest, scored on test.csv.
  ``table_bytes_*``: the embedding rows stored, one table against the two models' sum.
- ``planted``: ``synth --conversion`` data (a conversion only after a click, its logit
  sharing the click truth's factors plus its own): ESMM and MMoE against a single-task
  DeepFM per label, scored on a test file of the same truth, with both ceilings (the
  planted probabilities' AUC on the test rows).

    python benchmarks/sequence_multitask.py [--parts sequence,speed,adult,planted]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
ADULT_NUMERIC = ("age", "fnlwgt", "educational-num", "capital-gain", "capital-loss",
                 "hours-per-week")
VALID_FRACTION = 0.125
# The same settings on both sides of every comparison: selection by validation AUC, no
# refit, and Adagrad's start fixed (not chosen by validation, which trains each several
# times). An epoch count given here would also fix the batch size and rates at their
# stream defaults (a run that sets one of them keeps the fixed others), so ``adult``
# gives none: batch, rates and the epoch bound follow the data's size as in a default
# ``train``, and patience ends each run.
SETTINGS: dict[str, Any] = dict(select_by="auc", patience=2, refit=False, progress=False,
                                sparse_optimizer={"initial_accumulator": 0.001})


def _fit(train: Path, valid: Path, test: Path, out: Path, label: str, model: str,
         epochs: int | None, **data: Any) -> dict[str, Any]:
    """One model trained and scored on ``test``: its metrics, rows stored and seconds;
    ``epochs`` None leaves the schedule data-sized."""
    import terarec

    start = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fitted = terarec.fit(train, valid, out=out, label=label,
                             model={"name": model}, **SETTINGS, **data,
                             **({} if epochs is None else {"epochs": epochs}))
        scored = fitted.evaluate(test)
    return {**scored, "seconds": time.perf_counter() - start,
            "table_bytes": int(fitted.metrics["store_value_bytes"]),
            "epochs_trained": int(fitted.metrics.get("epochs_trained", 0))}


# -- behaviour sequences: DIN against pooling and no sequence -----------------------------

# The sequence models train with small batches and larger initial rows and learning rates
# than the defaults, so the item rows learn the planted similarity within the few epochs
# a CPU run affords, with the DIN paper's mini-batch-aware L2 (a decay on the rows a step
# touches) against the item and user rows' overfitting; the epoch count is an upper
# bound, validation AUC selects the pass and patience ends the run. Every side of the
# comparison uses the same.
SEQUENCE_TRAINING: dict[str, Any] = dict(
    format="csv", label="label", progress=False, refit=False, select_by="auc",
    patience=2, batch_size=256, store={"init_std": 0.1},
    sparse_optimizer={"lr": 0.1, "weight_decay": 0.001}, dense_optimizer={"lr": 0.003})


def _fit_sequence(train: Path, valid: Path, out: Path, model: str, categorical: str,
                  epochs: int, **extra: Any) -> tuple[float, float, int]:
    """(AUC on ``valid``, median training samples per second after the first pass,
    epochs trained)."""
    import terarec

    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = terarec.fit(train, valid, out=out, model=model, categorical=categorical,
                        epochs=epochs, **SEQUENCE_TRAINING, **extra)
        auc = float(m.evaluate(valid)["auc"])
    sps = [float(h["samples_per_s"]) for h in m.history if "samples_per_s" in h]
    steady = sorted(sps[1:] or sps)
    sps_median = steady[len(steady) // 2] if steady else float("nan")
    return auc, sps_median, int(m.metrics.get("epochs_trained", 0))


def sequence_din(work: Path, rows: int, epochs: int, max_len: int) -> dict[str, Any]:
    """DIN against DeepFM without the history and with it sum-pooled, and the ceiling."""
    from terarec.data.synth_history import HistorySettings, generate_history

    settings = HistorySettings(max_history=max_len)
    train, valid = work / "history-train.csv", work / "history-valid.csv"
    generate_history(train, rows, sample_seed=0, settings=settings)
    info = generate_history(valid, min(rows // 3, 20_000), sample_seed=1,
                            settings=settings)
    auc_din, _, din_epochs = _fit_sequence(train, valid, work / "din", "din", "user,item", epochs,
                               sequences=f"hist:{max_len}", share_tables="hist=item")
    auc_none, _, _ = _fit_sequence(train, valid, work / "none", "deepfm", "user,item", epochs)
    auc_sum, _, _ = _fit_sequence(train, valid, work / "sum", "deepfm", "user,item,hist",
                               epochs, multi_valued="hist", share_tables="hist=item")
    return {"sequence_rows": rows, "sequence_max_len": max_len, "sequence_epochs": epochs,
            "din_epochs_trained": din_epochs,
            "auc_din": auc_din, "auc_no_sequence": auc_none, "auc_sum_pooled": auc_sum,
            "auc_ceiling": info.ceiling_auc,
            "din_minus_best_reference": auc_din - max(auc_none, auc_sum),
            "ceiling_minus_din": info.ceiling_auc - auc_din}


def sequence_speed(work: Path, rows: int) -> dict[str, Any]:
    """Training samples per second with a length-50 sequence against none."""
    from terarec.data.synth_history import HistorySettings, generate_history

    long = HistorySettings(max_history=50)
    train, valid = work / "speed-train.csv", work / "speed-valid.csv"
    generate_history(train, rows, settings=long)
    generate_history(valid, rows // 4, sample_seed=1, settings=long)
    _, plain, _ = _fit_sequence(train, valid, work / "plain", "deepfm", "user,item", 3)
    _, seq, _ = _fit_sequence(train, valid, work / "seq50", "deepfm", "user,item", 3,
                           sequences="hist:50", share_tables="hist=item")
    return {"sps_no_sequence": round(plain), "sps_sequence50": round(seq),
            "sps_ratio_sequence50": round(seq / plain, 3)}


# -- multi-task: Adult as two tasks -------------------------------------------------------

def _adult_files(work: Path) -> tuple[Path, Path, Path, list[str]] | None:
    """fit / valid / test CSVs with the labels ``income`` and ``never_married`` and
    without the marital-status column; None when the data is absent."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pa_csv

    folder = DATA / "adult"
    if not (folder / "train.csv").exists():
        return None
    categorical: list[str] = []
    out = []
    for name in ("train", "test"):
        table = pa_csv.read_csv(folder / f"{name}.csv")
        never = pc.equal(table.column("marital-status"), "Never-married")
        columns = {"income": table.column("label"),
                   "never_married": pc.cast(never, pa.int8())}
        categorical = [c for c in table.column_names
                       if c not in (*ADULT_NUMERIC, "label", "marital-status")]
        for c in (*ADULT_NUMERIC, *categorical):
            columns[c] = table.column(c)
        out.append(pa.table(columns))
    train, test = out
    cut = int(train.num_rows * (1 - VALID_FRACTION))
    paths = []
    for name, table in (("fit", train.slice(0, cut)), ("valid", train.slice(cut)),
                        ("test", test)):
        path = work / f"adult-{name}.csv"
        pa_csv.write_csv(table, path)
        paths.append(path)
    return paths[0], paths[1], paths[2], categorical


def adult_multitask(work: Path, epochs: int | None) -> dict[str, Any]:
    """MMoE on (income, never-married) against a DeepFM per task."""
    files = _adult_files(work)
    if files is None:
        print(f"adult: {DATA / 'adult'} is absent; part skipped", file=sys.stderr)
        return {}
    fit, valid, test, categorical = files
    data = dict(format="csv", numeric=",".join(ADULT_NUMERIC),
                categorical=",".join(categorical))
    mmoe = _fit(fit, valid, test, work / "adult-mmoe", "income,never_married", "mmoe",
                epochs, **data)
    single = {task: _fit(fit, valid, test, work / f"adult-{task}", task, "deepfm", epochs,
                         **data) for task in ("income", "never_married")}
    return {
        "adult_mmoe_auc_income": mmoe["auc_income"],
        "adult_single_auc_income": single["income"]["auc"],
        "adult_mmoe_auc_never_married": mmoe["auc_never_married"],
        "adult_single_auc_never_married": single["never_married"]["auc"],
        "table_bytes_mmoe": mmoe["table_bytes"],
        "table_bytes_single": sum(s["table_bytes"] for s in single.values()),
        "adult_mmoe_epochs": mmoe["epochs_trained"],
        "adult_single_epochs": [single[t]["epochs_trained"] for t in single],
        "adult_mmoe_seconds": round(mmoe["seconds"], 1),
        "adult_single_seconds": round(sum(s["seconds"] for s in single.values()), 1),
    }


# -- multi-task: planted click and conversion ---------------------------------------------

def planted_multitask(work: Path, rows: int, epochs: int) -> dict[str, Any]:
    """ESMM and MMoE against a DeepFM per label, with the planted ceilings."""
    from terarec.data.synth_conversion import CATEGORICAL, NUMERIC, generate_conversion

    files = {}
    for name, n, seed in (("train", rows, 0), ("valid", rows // 4, 1), ("test", rows // 4, 2)):
        files[name] = work / f"planted-{name}.csv"
        info = generate_conversion(files[name], n, sample_seed=seed, vocab_scale=0.01)
    data = dict(format="csv", numeric=",".join(NUMERIC), categorical=",".join(CATEGORICAL))
    args = (files["train"], files["valid"], files["test"])
    out: dict[str, Any] = {"planted_rows": rows,
                           "planted_ceiling_auc_click": info.ceiling_auc,
                           "planted_ceiling_auc_conversion": info.conversion_ceiling_auc}
    for model in ("esmm", "mmoe"):
        got = _fit(*args, work / f"planted-{model}", "click,conversion", model, epochs,
                   **data)
        out[f"planted_{model}_auc_click"] = got["auc_click"]
        out[f"planted_{model}_auc_conversion"] = got["auc_conversion"]
    for task in ("click", "conversion"):
        got = _fit(*args, work / f"planted-single-{task}", task, "deepfm", epochs, **data)
        out[f"planted_single_auc_{task}"] = got["auc"]
    return out


PARTS: dict[str, Callable[[Path, argparse.Namespace], dict[str, Any]]] = {
    "sequence": lambda work, a: sequence_din(work, a.sequence_rows, a.sequence_epochs,
                                             a.max_len),
    "speed": lambda work, a: sequence_speed(work, a.speed_rows),
    "adult": lambda work, a: adult_multitask(work, a.adult_epochs),
    "planted": lambda work, a: planted_multitask(work, a.rows, a.epochs),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--sequence-rows", type=int, default=120_000,
                        help="planted-history training rows (a third as many scored, at "
                        "most 20,000)")
    parser.add_argument("--sequence-epochs", type=int, default=20,
                        help="epoch upper bound of the sequence models (patience 2 "
                        "stops first)")
    parser.add_argument("--max-len", type=int, default=20, help="history length of DIN")
    parser.add_argument("--speed-rows", type=int, default=20_000,
                        help="rows of the throughput runs (histories up to 50)")
    parser.add_argument("--rows", type=int, default=60_000, help="planted training rows")
    parser.add_argument("--epochs", type=int, default=6,
                        help="epoch upper bound on the planted data")
    parser.add_argument("--adult-epochs", type=int, default=None,
                        help="epoch upper bound on Adult (default: data-sized, with its "
                        "batch size and rates; patience stops first)")
    args = parser.parse_args(argv)
    wanted = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(wanted) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    line: dict[str, Any] = {"benchmark": "sequence_multitask",
                            "load_avg": [round(os.getloadavg()[0], 1)]}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="terarec-seqmt-") as tmp:
        for name in wanted:
            line.update(PARTS[name](Path(tmp), args))
    line["seconds"] = round(time.perf_counter() - start, 1)
    line["load_avg"].append(round(os.getloadavg()[0], 1))
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                      for k, v in line.items()}))
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
