"""K = 8 trials in one ``search`` pass loop versus the same 8 trials trained one after
another through ``train``, in the same run, on synthetic data with a planted ceiling and
(when present) the Criteo and Avazu samples in ../shared/data.

Prints one JSON line: ``trials``, ``seconds_shared`` (one search, pruning off),
``seconds_separate`` (8 ``terarec train`` runs, in-process), ``ratio_shared_vs_separate``,
``seconds_pruned`` (one search, successive halving), ``ratio_pruned_vs_separate``,
``auc_default`` (trial 0: the base configuration), ``auc_best`` (best trial of the
unpruned search; every variant selects by validation AUC, patience 2), ``auc_ceiling``
(the synthetic truth's AUC); the real samples under ``real``, with the same keys (no
ceiling); ``load_avg`` (at the end) and ``load_avg_start``: the machine's load.

    python benchmarks/search.py [--rows 20000] [--trials 8]
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
from pathlib import Path

import optuna

from terarec.cli.main import main as cli
from terarec.config import TrainConfig, to_dict
from terarec.data.numeric import with_numeric_stats
from terarec.data.readers import csv_schema
from terarec.data.synth import generate
from terarec.train.cohort import apply_params
from terarec.train.passes import iter_file_batches
from terarec.train.search import SearchConfig, run_search
from terarec.train.search.space import default_space, suggest
from terarec.types import FeatureSchema

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def _trial_params(model: str, trials: int, seed: int) -> list[dict]:
    """The trials every variant trains: the base configuration, then random draws."""
    space = default_space(model)
    sampler = optuna.samplers.RandomSampler(seed=seed)
    study = optuna.create_study(sampler=sampler)
    params = [{}]
    for _ in range(trials - 1):
        params.append(suggest(study.ask(), space))
    return params


def _search(schema, base, train, valid, out, params, pruner) -> tuple[float, object]:
    space = default_space(base.model.name)
    keys = sorted({k for p in params for k in p})
    space = {k: space[k] for k in keys} if keys else space
    start = time.perf_counter()
    # The schema `train` and `search` build: numeric statistics and bucket keys from the
    # training rows, once per search as the command does (each `train` run pays it too).
    schema = with_numeric_stats(schema, [train], on_bad_row="skip")
    batches = list(iter_file_batches([valid], schema, base.batch_size))
    with contextlib.redirect_stdout(io.StringIO()):
        settings = SearchConfig(base=base, trials=len(params), space=space,
                                sampler="random", pruner=pruner, select_by="auc",
                                fixed=[p or {k: _get(base, k) for k in keys} for p in params])
        result = run_search(settings, schema, [train], batches, out)
    return time.perf_counter() - start, result


def _get(config: TrainConfig, dotted: str):
    node = to_dict(config)
    for part in dotted.split("."):
        node = node[part]
    return node


def _separate(base, train, valid, out: Path, params, fmt: list[str]) -> float:
    """Each trial through ``terarec train`` (in-process), its full config as --config."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for i, p in enumerate(params):
        config = out / f"config-{i}.json"
        config.write_text(json.dumps(to_dict(apply_params(base, p))))
        with contextlib.redirect_stdout(io.StringIO()):
            code = cli(["train", "--train", str(train), "--valid", str(valid), "--out",
                        str(out / f"trial-{i}"), "--config", str(config), "--no-progress",
                        "--patience", "2", "--select-by", "auc", "--no-refit", *fmt])
        if code:
            raise SystemExit(f"train run {i} failed")
    return time.perf_counter() - start


def _auc_of(result, number: int) -> float | None:
    row = next(r for r in result.rows() if r["trial"] == number)
    return row["valid_auc"]


def _warm_up(schema: FeatureSchema, base: TrainConfig, train: Path, valid: Path) -> None:
    """Pay one-time costs (imports torch's optimizer stack and scikit-learn pull in, the
    page cache of the input) before any variant is timed, so none of them pays them."""
    from terarec.train.trainer import Trainer

    batches = list(iter_file_batches([valid], schema, base.batch_size))[:2]
    Trainer(schema, base).evaluate(batches)
    for _ in iter_file_batches([train], schema, base.batch_size):
        pass


def bench(schema: FeatureSchema, base: TrainConfig, train: Path, valid: Path, tmp: Path,
          trials: int, fmt: list[str]) -> dict:
    _warm_up(schema, base, train, valid)
    params = _trial_params(base.model.name, trials, seed=base.seed)
    separate = _separate(base, train, valid, tmp / "separate", params, fmt)
    shared, result = _search(schema, base, train, valid, tmp / "shared", params, "none")
    pruned, pruned_result = _search(schema, base, train, valid, tmp / "pruned", params,
                                    "halving")
    return {"trials": trials, "seconds_shared": round(shared, 2),
            "seconds_separate": round(separate, 2),
            "ratio_shared_vs_separate": round(shared / separate, 3),
            "seconds_pruned": round(pruned, 2),
            "ratio_pruned_vs_separate": round(pruned / separate, 3),
            "pruned_trials": sum(t.state == "pruned" for t in pruned_result.trials),
            "auc_default": _auc_of(result, 0),
            "auc_best": _auc_of(result, result.best.number) if result.best else None}


def _split(src: Path, dst: Path, header: bool) -> tuple[Path, Path]:
    """First 8,000 rows to train, the rest to test (as the data README measures)."""
    lines = src.read_text().splitlines(keepends=True)
    head, rows = (lines[:1], lines[1:]) if header else ([], lines)
    (dst / "train").write_text("".join(head + rows[:8000]))
    (dst / "test").write_text("".join(head + rows[8000:]))
    return dst / "train", dst / "test"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--no-real", action="store_true")
    args = parser.parse_args()
    load_start = [round(x, 2) for x in os.getloadavg()]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    base = TrainConfig()
    base.batch_size, base.pass_rows, base.threads, base.epochs = 512, 4096, 1, args.epochs
    base.model.embedding_dim = 8
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="terarec-search-bench-") as root:
        tmp = Path(root)
        info = generate(tmp / "train.tsv", args.rows, model_seed=7, sample_seed=1)
        generate(tmp / "valid.tsv", args.rows // 4, model_seed=7, sample_seed=2)
        (tmp / "synth").mkdir()
        out = bench(FeatureSchema.criteo(), base, tmp / "train.tsv", tmp / "valid.tsv",
                    tmp / "synth", args.trials, [])
        out["auc_ceiling"] = round(info.ceiling_auc, 4)
        out["rows"] = args.rows
        real = {}
        criteo = DATA / "criteo-kaggle-sample" / "train-10k.txt"
        if criteo.exists() and not args.no_real:
            (tmp / "criteo").mkdir()
            tr, te = _split(criteo, tmp / "criteo", header=False)
            real["criteo"] = bench(FeatureSchema.criteo(), base, tr, te, tmp / "criteo",
                                   args.trials, [])
        avazu = DATA / "avazu-sample" / "train-10k.csv"
        if avazu.exists() and not args.no_real:
            (tmp / "avazu").mkdir()
            tr, te = _split(avazu, tmp / "avazu", header=True)
            cols = avazu.open().readline().strip().split(",")
            cats = [c for c in cols if c not in ("id", "click")]
            schema = csv_schema("click", [], cats, format="csv")
            fmt = ["--format", "csv", "--label", "click", "--categorical", ",".join(cats)]
            real["avazu"] = bench(schema, base, tr, te, tmp / "avazu", args.trials, fmt)
        if real:
            out["real"] = real
    out["load_avg"] = [round(x, 2) for x in os.getloadavg()]  # 1, 5, 15 min, at the end
    out["load_avg_start"] = load_start
    out["note"] = "2 shared cores, loaded by other jobs (load_avg)"
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
