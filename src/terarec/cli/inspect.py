"""``terarec inspect``: what a model directory's newest good checkpoint holds.

Keys, bytes per tier, admission and eviction counts, and how often keys were shown (a
log2 histogram of show counts): the numbers that say whether a memory budget, an
admission threshold or a TTL fits the data.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from terarec.embedding.disk import read_snapshot_rows
from terarec.train.checkpoint import LoadedCheckpoint, load_checkpoint, sum_store_summaries


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="summarise a model directory's store",
                       description=__doc__)
    p.add_argument("model_dir", type=Path, help="model directory (written by terarec train)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(func=run)


def show_histogram(show: np.ndarray) -> dict[str, int]:
    """Keys per show-count bucket: "0", "1", "2-3", "4-7", ... (powers of two)."""
    show = np.asarray(show, np.float64)
    counts = {"0": int((show < 1).sum())}
    positive = show[show >= 1]
    if len(positive):
        exps = np.floor(np.log2(positive)).astype(np.int64)
        for e, n in zip(*np.unique(exps, return_counts=True), strict=True):
            lo, hi = 1 << int(e), (1 << (int(e) + 1)) - 1
            counts[str(lo) if lo == hi else f"{lo}-{hi}"] = int(n)
    return {k: v for k, v in counts.items() if v}


def _show_counts(ckpt: LoadedCheckpoint) -> np.ndarray:
    """The show column of every stored row, shard by shard, read without loading (or
    decoding) the rows themselves where the format allows it."""
    parts = []
    for shard in ckpt.shards:
        rows = ckpt.rows_file(shard)
        if rows is not None:
            with safe_open(str(rows), "np") as fh:
                parts.append(fh.get_tensor("show"))
            continue
        row_dim, state_dim = ckpt.dims()
        parts += [cols["show"] for _, cols in read_snapshot_rows(ckpt.path / shard, row_dim,
                                                                  state_dim, values=False)]
    return np.concatenate(parts) if parts else np.empty(0, np.float32)


def summarise(model_dir: Path) -> dict:
    ckpt = load_checkpoint(model_dir)
    # 2-rank checkpoints from before the common layout list only per-rank figures
    store = dict(ckpt.meta.get("store") or sum_store_summaries(ckpt.meta.get("stores") or [{}]))
    show = _show_counts(ckpt)
    files = {name: (ckpt.path / name).stat().st_size for name in ckpt.meta["sha256"]}
    sparse_bytes = sum(v for k, v in files.items() if k.startswith("sparse"))
    tiers = store.get("tiers")
    return {
        "model_dir": str(model_dir),
        "checkpoint": ckpt.path.name,
        "passes": int(ckpt.meta["pass_id"]),
        "store": "tiered" if ckpt.tiered else "memory",
        "keys": int(len(show)),
        "candidates": store.get("candidates"),
        "admitted": store.get("admitted"),
        "evicted": store.get("evicted"),
        "bytes": {
            "memory_tier": tiers["memory_bytes"] if tiers else store.get("bytes"),
            "key_index": tiers["index_bytes"] if tiers else None,
            "disk_tier_files": tiers["disk_file_bytes"] if tiers else 0,
            "checkpoint_sparse": sparse_bytes,
        },
        "memory_keys": tiers["memory_keys"] if tiers else int(len(show)),
        "show_histogram": show_histogram(show),
    }


def _fmt(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def run(args: argparse.Namespace) -> int:
    info = summarise(args.model_dir)
    if args.json:
        print(json.dumps(info))
        return 0
    b = info["bytes"]
    print(f"{info['model_dir']}: {info['checkpoint']} ({info['passes']} passes), "
          f"{info['store']} store")
    print(f"  keys        {info['keys']:,} ({info['memory_keys']:,} in the memory tier)")
    print(f"  admission   {info['admitted'] or 0:,} admitted, "
          f"{info['candidates'] or 0:,} candidates waiting; {info['evicted'] or 0:,} evicted")
    print(f"  bytes       memory tier {_fmt(b['memory_tier'])}, key index "
          f"{_fmt(b['key_index'])}, disk tier {_fmt(b['disk_tier_files'])}, "
          f"checkpoint {_fmt(b['checkpoint_sparse'])}")
    print("  show count  keys")
    hist = info["show_histogram"]
    top = max(hist.values(), default=1)
    for bucket, n in hist.items():
        print(f"  {bucket:>10}  {n:>10,}  {'#' * max(1, round(40 * n / top))}")
    return 0
