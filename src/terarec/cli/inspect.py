"""``terarec inspect``: what a model directory's newest good checkpoint holds.

Keys, bytes per tier, admission and eviction counts, and how often keys were shown (a
log2 histogram of show counts): the numbers that say whether a memory budget, an
admission threshold or a TTL fits the data.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: --help needs neither numpy nor the checkpoints
    import numpy as np

# Per-pass figures of the run's history shown by inspect (docs/admission.md).
PER_PASS = ("pass_id", "new_keys", "rejected_keys", "evicted_keys", "store_keys")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="summarise a model directory's store",
                       description=__doc__)
    p.add_argument("model_dir", type=Path, help="model directory (written by terarec train)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(func=run)


def show_histogram(show: np.ndarray | Iterable[np.ndarray]) -> dict[str, int]:
    """Keys per show-count bucket: "0", "1", "2-3", "4-7", ... (powers of two), of one
    array of show counts or summed over several (chunks of a table)."""
    import numpy as np

    parts = [show] if isinstance(show, np.ndarray) else show
    by_exp: dict[int, int] = {}  # -1: never shown
    for part in parts:
        part = np.asarray(part, np.float64)
        by_exp[-1] = by_exp.get(-1, 0) + int((part < 1).sum())
        positive = part[part >= 1]
        if len(positive):
            exps = np.floor(np.log2(positive)).astype(np.int64)
            for e, n in zip(*np.unique(exps, return_counts=True), strict=True):
                by_exp[int(e)] = by_exp.get(int(e), 0) + int(n)
    counts = {}
    for e in sorted(by_exp):
        if not by_exp[e]:
            continue
        lo, hi = (0, 0) if e < 0 else (1 << e, (1 << (e + 1)) - 1)
        counts[str(lo) if lo == hi else f"{lo}-{hi}"] = by_exp[e]
    return counts


def summarise(model_dir: Path) -> dict:
    from terarec.modeldir import load_checkpoint, sum_store_summaries

    # Said "no committed checkpoint" of a path that does not exist or is a file.
    if not model_dir.is_dir():
        what = "a file" if model_dir.exists() else "no such folder"
        raise ValueError(f"{model_dir}: not a model directory ({what})")
    ckpt = load_checkpoint(model_dir)
    # 2-rank checkpoints from before the common layout list only per-rank figures
    store = dict(ckpt.meta.get("store") or sum_store_summaries(ckpt.meta.get("stores") or [{}]))
    keys = [0]

    def shows() -> Iterator[np.ndarray]:
        # The table a chunk at a time (never whole in RAM), counting its keys.
        for chunk in ckpt.iter_sorted():
            keys[0] += len(chunk)
            yield chunk.show

    histogram = show_histogram(shows())
    files = {name: (ckpt.path / name).stat().st_size for name in ckpt.meta["sha256"]}
    sparse_bytes = sum(v for k, v in files.items() if k.startswith("sparse"))
    tiers = store.get("tiers")
    history = ckpt.meta.get("history") or []
    return {
        "model_dir": str(model_dir),
        "checkpoint": ckpt.path.name,
        # A refit's checkpoint is numbered after the selection run's passes, which are
        # not in it: count the passes its history holds.
        "passes": len(history) if history else int(ckpt.meta["pass_id"]),
        "refit": _is_refit(Path(model_dir), ckpt.path.name),
        "store": "tiered" if ckpt.tiered else "memory",
        "keys": keys[0],
        "candidates": store.get("candidates"),
        "admitted": store.get("admitted"),
        "rejected": store.get("rejected"),
        "evicted": store.get("evicted"),
        "admission_bytes": store.get("admission_bytes"),
        "per_pass": [{k: h.get(k) for k in PER_PASS} for h in ckpt.meta.get("history", [])],
        "bytes": {
            "memory_tier": tiers["memory_bytes"] if tiers else store.get("bytes"),
            "key_index": tiers["index_bytes"] if tiers else None,
            # allocated blocks; checkpoints from before that figure hold the slab files'
            # apparent size (sparse files created at full size)
            "disk_tier": (tiers.get("disk_allocated_bytes", tiers.get("disk_file_bytes"))
                          if tiers else 0),
            "checkpoint_sparse": sparse_bytes,
        },
        "disk_tier_counted": "allocated" if tiers is None or "disk_allocated_bytes" in tiers
        else "file size",
        "memory_keys": tiers["memory_keys"] if tiers else keys[0],
        "show_histogram": histogram,
    }


def _is_refit(model_dir: Path, checkpoint: str) -> bool:
    """Whether ``checkpoint`` is the refit on train + valid (metrics.json names it)."""
    try:
        metrics = json.loads((model_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        return False
    refit = metrics.get("refit") if isinstance(metrics, dict) else None
    return isinstance(refit, dict) and refit.get("checkpoint") == checkpoint


def _fmt(n: float | None) -> str:
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
    trained = (f"refit: {info['passes']} passes on the train and valid rows"
               if info["refit"] else f"{info['passes']} passes")
    print(f"{info['model_dir']}: {info['checkpoint']} ({trained}), "
          f"{info['store']} store")
    print(f"  keys        {info['keys']:,} ({info['memory_keys']:,} in the memory tier)")
    print(f"  admission   {info['admitted'] or 0:,} admitted, {info['rejected'] or 0:,} "
          f"rejected, {info['candidates'] or 0:,} candidates waiting "
          f"({_fmt(info['admission_bytes'])}); {info['evicted'] or 0:,} evicted")
    if info["per_pass"]:
        print("  pass     admitted    rejected     evicted        keys")
        for h in info["per_pass"]:
            cells = (h.get(k) for k in PER_PASS[1:])
            print(f"  {h.get('pass_id', '-'):>4}" + "".join(
                f"  {'-' if c is None else f'{c:,}':>10}" for c in cells))
    print(f"  bytes       memory tier {_fmt(b['memory_tier'])}, key index "
          f"{_fmt(b['key_index'])}, disk tier {_fmt(b['disk_tier'])} "
          f"{info['disk_tier_counted']}, "
          f"checkpoint {_fmt(b['checkpoint_sparse'])}")
    print("  show count  keys")
    hist = info["show_histogram"]
    top = max(hist.values(), default=1)
    for bucket, n in hist.items():
        print(f"  {bucket:>10}  {n:>10,}  {'#' * max(1, round(40 * n / top))}")
    return 0
