"""Embedding compression: bytes per key against AUC, every mode trained side by side.

Trained modes (the store keeps rows this way during training):
    fp32, fp16, int8, int4          row precision (int: row-wise scale + bias, stochastic
                                    rounding on write-back)
    varlen+int8                     variable-length rows by show count, int8 (fp16 where a
                                    short row is smaller that way)
    group_lasso                     fp32 rows, group lasso, zero rows pruned at pass end
Export modes (the fp32 model's rows encoded for serving, scored offline with the
decoded rows, which is what a server scores with):
    export-int2, export-int1        row-wise scale + bias (1 bit: per-row 2-means levels)
    export-cb2, export-cb1          shared k-means levels times an fp16 row scale

``bytes_per_key`` counts what the store (or shard) keeps per key for its values: codes
plus row scale and bias. It excludes optimizer state (fp32, 4 B per key for row-wise
Adagrad), show/click counters and the key index, which are the same for every mode.
``bytes_ratio_vs_fp32`` compares total value bytes, so keys pruned by group lasso count
as zero bytes.

Datasets: synthetic Criteo-format logs with planted signal (data/synth), and the Criteo
sample at ../shared/data/criteo-kaggle-sample/train-10k.txt when present (first 8,000
rows train, last 2,000 test). Prints one JSON line per (dataset, mode) and writes a PNG
of AUC against bytes per key.

Usage: ``python benchmarks/compression.py [--out DIR] [--synth-rows N] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from terarec.config import ModelConfig, SparseOptimizerConfig, StoreConfig, TrainConfig
from terarec.data.readers import iter_batches
from terarec.data.synth import generate
from terarec.export.compressed import RowCodec, compress_rows, decompress_rows
from terarec.report import plot_xy
from terarec.train.passes import group_passes
from terarec.train.trainer import Trainer
from terarec.types import Batch, FeatureSchema

REPO = Path(__file__).resolve().parents[1]
CRITEO_SAMPLE = REPO / ".." / "shared" / "data" / "criteo-kaggle-sample" / "train-10k.txt"
EXPORTS = ("int2", "int1", "cb2", "cb1")


@dataclass
class Dataset:
    name: str
    train: list[Batch]
    test: list[Batch]
    config: TrainConfig
    variable: StoreConfig  # store settings of the varlen+int8 mode
    group_lasso: float
    extra: dict = field(default_factory=dict)


def trained_modes(data: Dataset) -> dict[str, TrainConfig]:
    base = data.config
    store = base.store

    def with_store(**kw) -> TrainConfig:
        return replace(base, store=replace(store, **kw))

    return {
        "fp32": base,
        "fp16": with_store(precision="fp16"),
        "int8": with_store(precision="int8", stochastic_rounding=True),
        "int4": with_store(precision="int4", stochastic_rounding=True),
        "varlen+int8": replace(base, store=data.variable),
        "group_lasso": replace(base, sparse_optimizer=replace(
            base.sparse_optimizer, group_lasso=data.group_lasso)),
    }


def train(data: Dataset, config: TrainConfig, schema: FeatureSchema) -> Trainer:
    trainer = Trainer(schema, config)
    for _ in range(config.epochs):
        for group in group_passes(data.train, config.pass_rows):
            trainer.train_pass(trainer.plan(group))
    return trainer


def evaluate_with_values(trainer: Trainer, data: Dataset, values: np.ndarray) -> float:
    """AUC of ``trainer``'s model with its rows replaced by ``values`` (restored after)."""
    arrays = trainer.store.to_arrays()
    trainer.store.load_arrays({**arrays, "values": values})
    try:
        return float(trainer.evaluate(data.test)["auc"])
    finally:
        trainer.store.load_arrays(arrays)


def run_dataset(data: Dataset, schema: FeatureSchema) -> list[dict]:
    records: list[dict] = []
    fp32_trainer: Trainer | None = None
    row_dim = 0
    for mode, config in trained_modes(data).items():
        start = time.perf_counter()
        trainer = train(data, config, schema)
        stats = trainer.store.stats()
        row_dim = trainer.store.row_dim
        record = {"mode": mode, "dataset": data.name, "keys": stats.keys,
                  "value_bytes": stats.value_bytes,
                  "bytes_per_key": stats.value_bytes / max(stats.keys, 1),
                  "auc": float(trainer.evaluate(data.test)["auc"]),
                  "train_seconds": round(time.perf_counter() - start, 2)}
        if mode == "group_lasso":
            record["pruned_keys"] = stats.pruned
            record["pruned_share"] = stats.pruned / max(stats.admitted, 1)
        if mode == "varlen+int8":
            record["bookkeeping_bytes_per_key"] = trainer.store.values.overhead_bytes_per_slot
            counts = trainer.store.values.class_counts(trainer.store.index.items()[1])
            record["keys_per_width"] = dict(zip(
                map(str, trainer.store.values.classes.widths), counts.tolist(), strict=True))
        records.append(record)
        if mode == "fp32":
            fp32_trainer = trainer
    assert fp32_trainer is not None
    arrays = fp32_trainer.store.to_arrays()
    for name in EXPORTS:
        rows = compress_rows(arrays["keys"], arrays["values"], RowCodec.parse(name))
        records.append({
            "mode": f"export-{name}", "dataset": data.name, "keys": len(rows),
            "value_bytes": rows.nbytes, "bytes_per_key": rows.nbytes / max(len(rows), 1),
            "auc": evaluate_with_values(fp32_trainer, data, decompress_rows(rows))})
    base = records[0]
    for r in records:
        r["row_dim"] = row_dim
        r["bytes_ratio_vs_fp32"] = r["value_bytes"] / base["value_bytes"]
        r["delta_auc_vs_fp32"] = r["auc"] - base["auc"]
        r["bytes_counted"] = "values + row scale/bias; no optimizer state, counters or index"
        r.update(data.extra)
    return records


def load(path: Path, schema: FeatureSchema, batch_size: int) -> list[Batch]:
    return list(iter_batches(path, schema, batch_size))


def synth_dataset(tmp: Path, rows: int, schema: FeatureSchema, dim: int) -> Dataset:
    info = generate(tmp / "synth-train.txt", rows, model_seed=7, sample_seed=1)
    generate(tmp / "synth-test.txt", max(rows // 5, 2000), model_seed=7, sample_seed=2)
    config = TrainConfig(
        batch_size=512, pass_rows=max(rows // 8, 2048), epochs=1, seed=0,
        model=ModelConfig(name="deepfm", embedding_dim=dim, deep_mlp=(128, 64)),
        sparse_optimizer=SparseOptimizerConfig(name="adagrad", lr=0.05))
    return Dataset("synth", load(tmp / "synth-train.txt", schema, 512),
                   load(tmp / "synth-test.txt", schema, 4096), config,
                   StoreConfig(precision="int8", stochastic_rounding=True,
                               variable_dims=(12,), promote_at=(3,)),
                   group_lasso=3e-4, extra={"ceiling_auc": info.ceiling_auc})


def criteo_dataset(tmp: Path, schema: FeatureSchema, dim: int) -> Dataset | None:
    if not CRITEO_SAMPLE.exists():
        return None
    lines = CRITEO_SAMPLE.read_text().splitlines(keepends=True)
    (tmp / "criteo-train.txt").write_text("".join(lines[:8000]))
    (tmp / "criteo-test.txt").write_text("".join(lines[8000:]))
    config = TrainConfig(
        batch_size=256, pass_rows=2048, epochs=2, seed=0,
        model=ModelConfig(name="deepfm", embedding_dim=dim, dropout=0.3),
        sparse_optimizer=SparseOptimizerConfig(name="adagrad", lr=0.01))
    return Dataset("criteo-10k", load(tmp / "criteo-train.txt", schema, 256),
                   load(tmp / "criteo-test.txt", schema, 4096), config,
                   StoreConfig(precision="int8", stochastic_rounding=True,
                               variable_dims=(1, 4), promote_at=(4, 16)),
                   group_lasso=5e-4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out")
    parser.add_argument("--synth-rows", type=int, default=40_000)
    parser.add_argument("--synth-dim", type=int, default=47,
                        help="embedding_dim on synthetic data (row = dim + 1 floats)")
    parser.add_argument("--criteo-dim", type=int, default=8)
    parser.add_argument("--only", choices=["synth", "criteo"], default=None)
    args = parser.parse_args()
    schema = FeatureSchema.criteo()
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        datasets = []
        if args.only in (None, "synth"):
            datasets.append(synth_dataset(tmp, args.synth_rows, schema, args.synth_dim))
        if args.only in (None, "criteo"):
            criteo = criteo_dataset(tmp, schema, args.criteo_dim)
            if criteo is None:
                print(json.dumps({"dataset": "criteo-10k", "skipped": f"{CRITEO_SAMPLE} absent"}))
            else:
                datasets.append(criteo)
        for data in datasets:
            for record in run_dataset(data, schema):
                records.append(record)
                print(json.dumps(record), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    series = {}
    for name in dict.fromkeys(r["dataset"] for r in records):
        rows = sorted((r for r in records if r["dataset"] == name),
                      key=lambda r: r["bytes_ratio_vs_fp32"])
        series[name] = ([r["bytes_ratio_vs_fp32"] for r in rows], [r["auc"] for r in rows])
    if series:
        path = plot_xy(args.out / "compression.png", series,
                       "Embedding compression: AUC against stored value bytes",
                       "value bytes / fp32 value bytes (codes + scale/bias)", "test AUC")
        print(f"plot written to {path}")


if __name__ == "__main__":
    main()
