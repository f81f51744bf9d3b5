"""A table larger than the machine's RAM: train, checkpoint, export, serve.

One process trains a tiered store (``StoreConfig.memory_budget`` + ``key_index="disk"``)
on synthetic rows (``data.synth`` dense features, categoricals and labels, plus
``--unique-fields`` fields of near-unique ids, so every row brings that many new keys)
until the table holds ``--keys`` keys; then it commits a checkpoint, writes a full int8
export (``ModelExporter`` with ``RowCodec(8)``, streamed from ``store.iter_sorted``),
trains one more pass and writes a delta of it, and scores request rows through a
``ServingEngine`` on the export, against ``Trainer.predict_batches`` on the same rows.
Rows and keys go through ``readers.batch_from_columns``, the server's own path.

A second process trains the same model on the same kind of rows with every row in RAM
(``MemoryStore``, ``--in-ram-keys`` keys) for the speed baseline.

Reported per phase: seconds and peak RSS (VmHWM, reset between phases through
``/proc/self/clear_refs``); bytes per key on disk (slabs, key runs, checkpoint, export)
and in RAM; ``table_bytes`` = keys x (row + optimizer-state bytes).

The script refuses to start when the free disk under ``--workdir`` is below its
estimate of what the run writes, and deletes its folders at the end unless ``--keep``.

Usage: ``python benchmarks/beyond_ram.py --keys 400000000 --budget-gb 4 --workdir DIR``;
``--keys 1000000`` finishes in about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from terarec.config import ModelConfig, SparseOptimizerConfig, StoreConfig, TrainConfig
from terarec.data.readers import batch_from_columns
from terarec.data.synth import NUM_CATEGORICAL, NUM_DENSE, generate_arrays
from terarec.embedding.store import CHUNK_ROWS
from terarec.export.compressed import RowCodec
from terarec.export.writer import ModelExporter
from terarec.modeldir import save_checkpoint
from terarec.models import row_dim_for
from terarec.serving.engine import ServingEngine
from terarec.train.trainer import Trainer
from terarec.types import Batch, FeatureSchema, FieldSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiered_store import proc_status  # noqa: E402

GIB = 1 << 30
SALT = "beyond-ram"


def meminfo_total() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise KeyError("MemTotal")


def reset_peak() -> None:
    """Start a new VmHWM (Linux: writing 5 to clear_refs resets the peak RSS)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def tree_bytes(path: Path) -> int:
    """Allocated bytes under ``path`` (sparse slab files count what they hold; a file
    hard-linked twice counts once)."""
    seen: set[int] = set()
    total = 0
    for p in path.rglob("*"):
        st = p.lstat()
        if p.is_file() and st.st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_blocks * 512
    return total


def schema_for(unique_fields: int, zipf_fields: int) -> FeatureSchema:
    numeric = tuple(FieldSpec(f"I{i}", "numeric") for i in range(1, NUM_DENSE + 1))
    cats = tuple(FieldSpec(f"C{i}", "categorical") for i in range(1, zipf_fields + 1))
    ids = tuple(FieldSpec(f"U{i}", "categorical") for i in range(1, unique_fields + 1))
    return FeatureSchema(label="label", fields=numeric + cats + ids, missing_flags=False,
                         hash_salt=SALT)


def pass_columns(schema: FeatureSchema, first_row: int, rows: int, unique_fields: int,
                 zipf_fields: int, seed: int) -> tuple[dict[str, pa.Array], np.ndarray]:
    """Raw columns of rows ``first_row ..``: synthetic counts, Zipf categoricals and labels
    (``generate_arrays``), and the global row number as each ``U`` field's value."""
    arr = generate_arrays(rows, model_seed=0, sample_seed=seed)
    cols: dict[str, pa.Array] = {}
    for j in range(NUM_DENSE):
        d = arr.dense[:, j]
        cols[f"I{j + 1}"] = pa.array(d, mask=np.isnan(d))
    for j in range(zipf_fields):
        c = arr.categorical[:, j % NUM_CATEGORICAL]
        cols[f"C{j + 1}"] = pa.array(c, mask=c < 0)
    ids = pa.array(np.arange(first_row, first_row + rows, dtype=np.int64))
    for j in range(unique_fields):
        cols[f"U{j + 1}"] = ids
    return cols, arr.labels.astype(np.float32)


def pass_batches(schema: FeatureSchema, first_row: int, rows: int, args: argparse.Namespace,
                 seed: int) -> list[Batch]:
    cols, labels = pass_columns(schema, first_row, rows, args.unique_fields,
                                args.zipf_fields, seed)
    whole = batch_from_columns(cols, rows, schema)
    whole = Batch(whole.dense, whole.sparse, torch.from_numpy(labels))
    b = args.batch_size
    return [whole.slice(s, min(s + b, rows)) for s in range(0, rows, b)]


def request_columns(schema: FeatureSchema, pass_index: int, n: int,
                    args: argparse.Namespace) -> dict[str, pa.Array]:
    """The first ``n`` rows of pass ``pass_index`` as trained (the generator draws a
    block at a time, so the pass is generated whole and cut)."""
    cols, _ = pass_columns(schema, pass_index * args.pass_rows, args.pass_rows,
                           args.unique_fields, args.zipf_fields, seed=1 + pass_index)
    return {k: v.slice(0, n) for k, v in cols.items()}


def records_of(cols: dict[str, pa.Array], n: int) -> list[dict[str, object]]:
    """The first ``n`` rows as request records (raw values; None for missing)."""
    names = list(cols)
    lists = [cols[k].slice(0, n).to_pylist() for k in names]
    return [dict(zip(names, vals, strict=True)) for vals in zip(*lists, strict=True)]


def train_config(args: argparse.Namespace, tiered: bool, store_dir: Path | None) -> TrainConfig:
    store = (StoreConfig(memory_budget=int(args.budget_gb * GIB), key_index="disk",
                         disk_path=str(store_dir)) if tiered else StoreConfig())
    return TrainConfig(
        batch_size=args.batch_size, pass_rows=args.pass_rows, seed=0, threads=1,
        device="cpu",
        model=ModelConfig(name=args.model, embedding_dim=args.dim),
        sparse_optimizer=SparseOptimizerConfig(name="adagrad", lr=0.05), store=store)


def train_passes(trainer: Trainer, schema: FeatureSchema, args: argparse.Namespace,
                 passes: int, first_pass: int = 0) -> dict[str, float]:
    """Train ``passes`` passes of new rows (pass i: rows ``i * pass_rows ..``); the next
    pass is generated and planned while the store prefetches. Figures of the passes after
    the first (kernels compile, allocators grow there)."""
    def make(i: int) -> list[Batch]:
        return pass_batches(schema, i * args.pass_rows, args.pass_rows, args, seed=1 + i)

    rows = busy = 0.0
    wall0 = 0.0
    planned = trainer.plan(make(first_pass))
    t_first = time.perf_counter()
    for i in range(first_pass, first_pass + passes):
        upcoming = trainer.plan(make(i + 1)) if i + 1 < first_pass + passes else None
        r = trainer.train_pass(planned, upcoming=upcoming)
        planned = upcoming  # type: ignore[assignment]
        if i == first_pass:
            wall0 = time.perf_counter()
        else:
            rows += r.rows
            busy += r.staging_s + r.train_s + r.write_back_s
        if args.verbose:
            print(f"pass {i}: {len(trainer.store)} keys, "
                  f"{time.perf_counter() - t_first:.0f} s, rss {proc_status('VmRSS') >> 20} MB",
                  file=sys.stderr, flush=True)
    wall = time.perf_counter() - wall0
    return {"sps": rows / busy if busy else 0.0,
            "sps_wall": rows / wall if rows and wall else 0.0, "timed_rows": rows}


def run_in_ram(args: argparse.Namespace) -> dict[str, float]:
    """The baseline arm: every row in RAM (``MemoryStore``), same model and rows."""
    torch.set_num_threads(1)
    schema = schema_for(args.unique_fields, args.zipf_fields)
    trainer = Trainer(schema, train_config(args, False, None))
    passes = max(2, -(-args.in_ram_keys // (args.pass_rows * args.unique_fields)))
    out = train_passes(trainer, schema, args, passes)
    return {**out, "keys": len(trainer.store), "peak_rss_bytes": proc_status("VmHWM")}


def disk_needed(keys: int, record_bytes: int, row_dim: int) -> int:
    """Bytes the run writes: slabs, key runs (20 B per entry; twice while merging), the
    int8 export and the server's copy of it, plus 10 %. The checkpoint hard-links the
    slabs; only those the delta pass rewrites are copied, which the 10 % covers."""
    export = 8 + row_dim + 8  # key, int8 codes, row scale and bias
    return int(1.1 * keys * (record_bytes + 40 + 2 * export))


class Phases:
    """Seconds and peak RSS per phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.peak: dict[str, int] = {}
        self._name = ""
        self._t0 = 0.0

    def start(self, name: str) -> None:
        reset_peak()
        self._name, self._t0 = name, time.perf_counter()

    def stop(self) -> None:
        self.seconds[self._name] = round(time.perf_counter() - self._t0, 2)
        self.peak[self._name] = proc_status("VmHWM")


def run(args: argparse.Namespace) -> dict[str, object]:
    t_start = time.perf_counter()
    torch.set_num_threads(1)
    load0 = os.getloadavg()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    schema = schema_for(args.unique_fields, args.zipf_fields)
    per_pass = args.pass_rows * args.unique_fields
    passes = max(2, -(-args.keys // per_pass))
    config = train_config(args, True, work / "store")
    row_dim = row_dim_for(config.model.name, config.model)  # fm: dim + a first-order weight
    record = 4 * (row_dim + 1 + 3)  # values, Adagrad's accumulator, show / click / last seen
    need = disk_needed(passes * per_pass, record, row_dim)
    free = shutil.disk_usage(work).free
    if free < need:
        raise SystemExit(f"--workdir {work}: {free / 1e9:.1f} GB free, the run needs about "
                         f"{need / 1e9:.1f} GB for {passes * per_pass} keys; lower --keys "
                         "or free disk")
    ram = meminfo_total()
    phases = Phases()
    baseline = None
    if not args.no_in_ram:
        cmd = [sys.executable, __file__, "--arm", "ram", *sys.argv[1:]]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"in-RAM arm failed:\n{done.stderr[-4000:]}")
        baseline = json.loads(done.stdout.strip().splitlines()[-1])

    phases.start("train")
    trainer = Trainer(schema, config)
    store = trainer.store
    trained = train_passes(trainer, schema, args, passes)
    phases.stop()
    keys = len(store)
    tiers = store.tier_stats()

    phases.start("checkpoint")
    ckpt = save_checkpoint(work / "model", trainer)
    phases.stop()

    export = work / "export"
    phases.start("export_full_int8")
    exporter = ModelExporter(str(export), None, shard_rows=args.shard_rows, codec=RowCodec(8))
    full = exporter.write_full(schema=schema, model_config=config.model,
                               dense=trainer.model.state_dict(),
                               rows=store.iter_sorted(CHUNK_ROWS), row_dim=store.row_dim,
                               pass_id=trainer.pass_id)
    phases.stop()

    # One more pass of new rows, exported as a delta; its first rows are the requests.
    phases.start("train_delta_pass")
    since = trainer.pass_id
    train_passes(trainer, schema, args, 1, first_pass=passes)
    phases.stop()
    phases.start("export_delta")
    changed, values = store.changed_since(since)
    delta = ModelExporter(str(export), None, shard_rows=args.shard_rows).write_delta(
        dense=trainer.model.state_dict(), keys=changed, values=values,
        deleted=np.empty(0, np.int64), pass_id=trainer.pass_id)
    del changed, values
    phases.stop()

    # Requests: the first rows of the delta pass (rows of the delta, fp32) and of the
    # first pass (rows of the int8 full version), regenerated whole as trained.
    n = min(args.requests, args.pass_rows)
    new_cols = request_columns(schema, passes, n, args)
    old_cols = request_columns(schema, 0, n, args)
    phases.start("predict")
    predicted = trainer.predict_batches([batch_from_columns(new_cols, n, schema)])
    predicted_old = trainer.predict_batches([batch_from_columns(old_cols, n, schema)])
    phases.stop()

    phases.start("serve")
    engine = ServingEngine(str(export), cache_dir=work / "serve-cache", onnx=False)
    try:
        if not engine.refresh():
            raise SystemExit(f"{export}: the server loaded no version")
        served_version = engine.served().version
        t0 = time.perf_counter()
        served, _ = engine.score_records(records_of(new_cols, n))
        served_old, _ = engine.score_records(records_of(old_cols, n))
        serve_s = time.perf_counter() - t0
    finally:
        engine.close()
    phases.stop()

    disk = {name: tree_bytes(work / name) for name in ("store", "model", "export")}
    runs = sum(p.stat().st_blocks * 512 for p in (work / "store").glob("run-*"))
    budget = int(args.budget_gb * GIB)
    table_bytes = keys * 4 * (store.row_dim + store.state_dim)
    peak = max(phases.peak.values())
    out: dict[str, object] = {
        "benchmark": "beyond_ram",
        "keys": keys,
        "dim": args.dim,
        "table_bytes": table_bytes,
        "machine_ram_bytes": ram,
        "table_over_ram": round(table_bytes / ram, 3),
        "budget_bytes": budget,
        "peak_rss_bytes": peak,
        "rss_target_bytes": budget + 2 * GIB,
        "peak_rss_by_phase": phases.peak,
        "seconds_by_phase": phases.seconds,
        "sps": round(trained["sps"]),
        "sps_wall": round(trained["sps_wall"]),
        "sps_in_ram": round(baseline["sps"]) if baseline else None,
        "in_ram_keys": baseline["keys"] if baseline else None,
        "peak_rss_in_ram_bytes": baseline["peak_rss_bytes"] if baseline else None,
        "sps_ratio_vs_in_ram": round(trained["sps"] / baseline["sps"], 3) if baseline else None,
        "keys_per_s_created": round(keys / phases.seconds["train"]),
        "max_score_diff_served_vs_predict": float(np.max(np.abs(served - predicted))),
        "max_score_diff_int8_rows": float(np.max(np.abs(served_old - predicted_old))),
        "requests": 2 * n,
        "serve_rows_per_s": round(2 * n / serve_s),
        "served_version": served_version,
        "export_full_rows": full.rows,
        "export_delta_rows": delta.rows,
        "disk_bytes": {**disk, "key_runs": runs},
        "disk_bytes_per_key": {k: round(v / keys, 1) for k, v in
                               {**disk, "key_runs": runs}.items()},
        "ram_bytes_per_key": round(peak / keys, 2),
        "memory_keys": tiers.memory_keys if tiers else None,
        "row_dim": store.row_dim,
        "state_dim": store.state_dim,
        "record_bytes": 4 * store.width,
        "checkpoint": ckpt.name,
        "unique_fields": args.unique_fields,
        "pass_rows": args.pass_rows,
        "shard_rows": args.shard_rows,
        "passes": passes + 1,
        "model": args.model,
        "disk_free_at_start_bytes": free,
        "disk_needed_estimate_bytes": need,
        "loadavg": {"start": [round(x, 2) for x in load0],
                    "end": [round(x, 2) for x in os.getloadavg()]},
        "cpus": os.cpu_count(),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    store.close()
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=400_000_000, help="keys the table reaches")
    p.add_argument("--budget-gb", type=float, default=4.0, help="the store's memory budget")
    p.add_argument("--workdir", required=True, help="folder for the store, checkpoint and "
                   "export (removed at the end unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep --workdir's folders")
    p.add_argument("--dim", type=int, default=16, help="floats per row")
    p.add_argument("--model", default="fm")
    p.add_argument("--unique-fields", type=int, default=32,
                   help="fields of near-unique ids: new keys per row")
    p.add_argument("--zipf-fields", type=int, default=8, help="Zipf categoricals per row")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--shard-rows", type=int, default=1 << 18,
                   help="rows per export shard: the writer holds one shard as fp32 rows "
                   "(1 << 18 rows of 129 floats: 135 MB)")
    p.add_argument("--pass-rows", type=int, default=50_000,
                   help="rows per pass: each brings --unique-fields new keys, and the keys "
                        "of this pass and the planned next one are held in RAM beside the "
                        "budget (about 340 B each measured), so this sets the RSS above it")
    p.add_argument("--in-ram-keys", type=int, default=20_000_000,
                   help="keys of the all-in-RAM baseline")
    p.add_argument("--no-in-ram", action="store_true", help="skip the in-RAM baseline")
    p.add_argument("--requests", type=int, default=256, help="request rows of each kind")
    p.add_argument("--verbose", action="store_true", help="a line per pass on stderr")
    p.add_argument("--arm", choices=["ram"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for flag in ("keys", "unique_fields", "batch_size", "pass_rows", "dim", "requests"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.budget_gb <= 0:
        p.error("--budget-gb must be > 0")
    args.in_ram_keys = min(args.in_ram_keys, args.keys)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.arm == "ram":
        print(json.dumps(run_in_ram(args)))
        return
    work = Path(args.workdir)
    created = not work.exists()
    try:
        print(json.dumps(run(args)))
    finally:
        if not args.keep:
            for name in ("store", "model", "export", "serve-cache"):
                shutil.rmtree(work / name, ignore_errors=True)
            if created:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
