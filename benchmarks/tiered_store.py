"""Tiered store against all-in-RAM training: same data, same DLRM, in one run.

The tiered arm trains with a memory budget several times smaller than its final table
(every row on disk in slab files, hot rows in RAM, the next pass's rows prefetched while
the current one trains); the in-memory arm holds the whole table in RAM. Each arm runs in
its own process so its peak resident set (VmHWM) is its own.

After training, each arm commits a checkpoint and writes a full export version (both
streamed from the store a chunk at a time, as ``terarec train`` does).

Reported: ``table_bytes`` (final rows x record bytes), ``memory_budget_bytes``,
``peak_rss_bytes`` of the tiered arm through training, checkpoint and full export
(target <= budget + 1.5 GB with the table >= 4x the budget; ``peak_rss_train_bytes``:
after training only; ``start_rss_bytes``: the process before its first pass, data and
model included), ``export_rows_per_s`` and ``checkpoint_s`` of both arms (the in-memory
arm is the baseline: its rows need no disk reads), throughput of both arms and their ratio (target
>= 0.7), the disk tier's batched warm read and write rates after training, on its own
records and on 64 B records (targets >= 2e6 and >= 1e6 rows/s), the rates seen during
training (sharing the cores with it), and ``prefetch_hidden_share``: the share of
disk-read time spent in the prefetch thread while the trainer did not wait for it.

``--precision int8`` (or fp16, int4) runs both arms with encoded rows: disk records and
hot rows shrink, so more rows stay hot under the same budget (``memory_keys``).

Prints one JSON line. Usage: ``python benchmarks/tiered_store.py [--rows N]
[--budget 90MB] [--policies lfu,lru] [--precision fp32]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_throughput import benchmark_schema, synthetic_inputs  # noqa: E402

from terarec.config import (  # noqa: E402
    ModelConfig,
    SparseOptimizerConfig,
    StoreConfig,
    TrainConfig,
    parse_bytes,
)
from terarec.export.writer import IncrementalExporter  # noqa: E402
from terarec.modeldir import save_checkpoint  # noqa: E402
from terarec.train.trainer import Trainer  # noqa: E402
from terarec.types import Batch, KeyedIds  # noqa: E402


def proc_status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def disk_probe(disk, batch: int = 100_000, repeats: int = 3) -> tuple[float, float]:
    """Batched warm reads and writes of ``batch`` random rows of a disk tier, best of
    ``repeats`` (rows/s): the tier's own speed, without training competing for cores."""
    keys, slots = disk.items()
    rng = np.random.default_rng(0)
    pick = rng.choice(len(keys), min(batch, len(keys)), replace=False)
    keys, slots = keys[pick], slots[pick]
    disk.read_slots(slots)  # warm the page cache
    read = write = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        rec = disk.read_slots(slots)
        t1 = time.perf_counter()
        disk.write(keys, rec)
        t2 = time.perf_counter()
        read, write = min(read, t1 - t0), min(write, t2 - t1)
    return len(keys) / read, len(keys) / write


def small_row_probe(path: Path, rows: int = 2_000_000) -> tuple[float, float]:
    """The same probe on 64 B records (the size the design notes were measured at)."""
    from terarec.embedding.disk import DiskTier

    disk = DiskTier(path, 16)
    keys = np.arange(1, rows + 1, dtype=np.int64)
    for start in range(0, rows, 500_000):
        part = keys[start:start + 500_000]
        disk.write(part, np.random.default_rng(start).random((len(part), 16), np.float32))
    try:
        return disk_probe(disk)
    finally:
        disk.release()


def run_arm(args: argparse.Namespace) -> dict:
    """Train every pass of the data once; figures of this process only."""
    torch.set_num_threads(args.threads)
    dense, ids, labels = synthetic_inputs(args.rows, seed=0)
    schema = benchmark_schema()
    store = StoreConfig(memory_budget=args.budget, cache_policy=args.policy,
                        precision=args.precision) \
        if args.arm == "tiered" else StoreConfig(precision=args.precision)
    config = TrainConfig(
        batch_size=args.batch_size, seed=0,
        model=ModelConfig(name="dlrm", embedding_dim=args.dim, bottom_mlp=(64, args.dim),
                          top_mlp=(256, 128)),
        sparse_optimizer=SparseOptimizerConfig(name="adam", lr=1e-3), store=store)
    trainer = Trainer(schema, config)
    names, b = schema.sparse_names, args.batch_size
    batches = [Batch(dense[s:s + b], KeyedIds.from_dense(names, ids[s:s + b]), labels[s:s + b])
               for s in range(0, len(labels) - b + 1, b)]
    passes = [batches[i:i + args.pass_batches]
              for i in range(0, len(batches), args.pass_batches)]
    start_rss = proc_status("VmRSS")
    rows = busy = wait = 0.0
    planned = trainer.plan(passes[0]) if passes else None
    for i in range(len(passes)):
        assert planned is not None
        upcoming = trainer.plan(passes[i + 1]) if i + 1 < len(passes) else None
        r = trainer.train_pass(planned, upcoming=upcoming)
        planned = upcoming
        if i:  # the first pass compiles kernels and grows allocators
            rows += r.rows
            busy += r.staging_s + r.train_s + r.write_back_s
        wait += r.prefetch_wait_s
    train_peak = proc_status("VmHWM")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        save_checkpoint(Path(tmp) / "model", trainer)
        t1 = time.perf_counter()
        exported = IncrementalExporter(Path(tmp) / "export", trainer).export(trainer, full=True)
        t2 = time.perf_counter()
    s = trainer.store
    # A disk record (encoded values, state, counters); in RAM the same for fp32 rows.
    record = 4 * s.width if args.arm == "tiered" else 4 * (s.row_dim + s.state_dim + 3)
    out = {"sps": rows / busy, "keys": len(s), "table_bytes": len(s) * record,
           "start_rss_bytes": start_rss, "peak_rss_bytes": proc_status("VmHWM"),
           "peak_rss_train_bytes": train_peak, "passes": len(passes),
           "checkpoint_s": t1 - t0, "export_rows": exported.rows,
           "export_rows_per_s": exported.rows / max(t2 - t1, 1e-9)}
    if args.arm == "tiered":
        t = s.tier_stats()
        hidden = max(0.0, t.prefetch_s - wait)
        read, write = disk_probe(s.disk)
        with tempfile.TemporaryDirectory() as tmp:
            read_64, write_64 = small_row_probe(Path(tmp))
        out.update(
            disk_read_rows_per_s=read, disk_write_rows_per_s=write,
            disk_read_rows_per_s_64b=read_64, disk_write_rows_per_s_64b=write_64,
            train_disk_read_rows_per_s=t.disk_rows_read / max(t.disk_read_s, 1e-9),
            train_disk_write_rows_per_s=t.disk_rows_written / max(t.disk_write_s, 1e-9),
            prefetch_hidden_share=hidden / max(t.prefetch_s + t.pull_disk_s, 1e-9),
            hit_rate=t.hits / max(t.hits + t.misses, 1), memory_keys=t.memory_keys,
            rows_read=t.disk_rows_read, rows_written=t.disk_rows_written)
    return out


def _spawn(args: argparse.Namespace, arm: str, policy: str = "lfu") -> dict:
    cmd = [sys.executable, __file__, "--arm", arm, "--policy", policy, "--rows", str(args.rows),
           "--budget", args.budget, "--dim", str(args.dim), "--batch-size",
           str(args.batch_size), "--pass-batches", str(args.pass_batches), "--threads",
           str(args.threads), "--precision", args.precision]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{arm} arm failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--budget", default="90MB", help="memory budget of the tiered arm")
    parser.add_argument("--dim", type=int, default=64, help="embedding dim (Adam rows)")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--pass-batches", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", default="fp32",
                        help="row precision of both arms (fp32, fp16, int8, int4)")
    parser.add_argument("--policies", default="lfu",
                        help="comma-separated cache policies to run tiered arms for")
    parser.add_argument("--arm", choices=["tiered", "memory"], help=argparse.SUPPRESS)
    parser.add_argument("--policy", default="lfu", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args)))
        return
    start = time.perf_counter()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    tiered = {p: _spawn(args, "tiered", p) for p in policies}
    memory = _spawn(args, "memory")
    main_arm = tiered[policies[0]]
    budget = parse_bytes(args.budget)
    print(json.dumps({
        "benchmark": "tiered_store",
        "rows": args.rows,
        "keys": main_arm["keys"],
        "table_bytes": main_arm["table_bytes"],
        "memory_budget_bytes": budget,
        "table_over_budget": round(main_arm["table_bytes"] / budget, 2),
        "peak_rss_bytes": main_arm["peak_rss_bytes"],
        "peak_rss_train_bytes": main_arm["peak_rss_train_bytes"],
        "rss_target_bytes": budget + int(1.5 * (1 << 30)),
        "start_rss_bytes": main_arm["start_rss_bytes"],
        "peak_rss_in_memory_bytes": memory["peak_rss_bytes"],
        "peak_rss_train_in_memory_bytes": memory["peak_rss_train_bytes"],
        "sps_tiered": round(main_arm["sps"]),
        "sps_in_memory": round(memory["sps"]),
        "ratio": round(main_arm["sps"] / memory["sps"], 3),
        "export_rows": main_arm["export_rows"],
        "export_rows_per_s": round(main_arm["export_rows_per_s"]),
        "export_rows_per_s_in_memory": round(memory["export_rows_per_s"]),
        "checkpoint_s": round(main_arm["checkpoint_s"], 2),
        "checkpoint_s_in_memory": round(memory["checkpoint_s"], 2),
        "record_bytes": main_arm["table_bytes"] // max(main_arm["keys"], 1),
        "disk_read_rows_per_s": round(main_arm["disk_read_rows_per_s"]),
        "disk_write_rows_per_s": round(main_arm["disk_write_rows_per_s"]),
        "disk_read_rows_per_s_64b": round(main_arm["disk_read_rows_per_s_64b"]),
        "disk_write_rows_per_s_64b": round(main_arm["disk_write_rows_per_s_64b"]),
        "train_disk_read_rows_per_s": round(main_arm["train_disk_read_rows_per_s"]),
        "train_disk_write_rows_per_s": round(main_arm["train_disk_write_rows_per_s"]),
        "prefetch_hidden_share": round(main_arm["prefetch_hidden_share"], 3),
        "cache_policy": policies[0],
        "precision": args.precision,
        "memory_keys": main_arm["memory_keys"],
        "hit_rate": {p: round(t["hit_rate"], 3) for p, t in tiered.items()},
        "sps_by_policy": {p: round(t["sps"]) for p, t in tiered.items()},
        "threads": args.threads,
        "seconds": round(time.perf_counter() - start, 1),
    }))


if __name__ == "__main__":
    main()
