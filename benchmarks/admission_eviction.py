"""Admission and eviction policies against keeping every key, on the same data in one run.

Data: terarec's synthetic Criteo-format logs (bounded-Zipf keys, a planted ground truth
whose AUC is the ceiling), a train file and a validation file drawn from the same truth;
and the Criteo Kaggle sample (``../shared/data``: first 8,000 rows to train, last 2,000
to score; skipped when absent).

Arms (one model config, one epoch, eviction at every pass end):

    keep_all           every key admitted, nothing evicted: the baseline
    exact_count2       admission at 2 shows, exact candidate table (today's)
    sketch_count2      admission at 2 shows, count-min sketch of a fixed size (default:
                       1/8 of the exact table's peak RAM in this run)
    sketch_count2_quarter  the same with a quarter of that sketch (1/32 of the table)
    probability_0.5    each show admits a new key with probability 0.5
    show_click         admission at 2 shows and 1 click
    l2_below           eviction of rows with an L2 norm below --l2-below
    capacity_0.3_*     at most 0.3x keep-all's final keys, evicting by lfu / lru / l2

One JSON line per arm and data set: ``keys`` (final store), ``store_bytes`` (rows as
stored: values, optimizer state, counters, key), ``admission_ram_bytes`` (peak over the
passes of the RAM kept for keys not yet admitted) and ``admission_ram_fixed`` (the same
after every pass), ``auc``, ``delta_auc_vs_keep_all``, and the keep-all figures.

Usage: ``python benchmarks/admission_eviction.py [--rows 300000] [--sketch-bytes auto]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from terarec.config import ModelConfig, StoreConfig, TrainConfig, parse_bytes
from terarec.data.synth import generate
from terarec.embedding.eviction import store_bytes
from terarec.train.passes import iter_file_batches
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema

CRITEO = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / \
    "criteo-kaggle-sample" / "train-10k.txt"


def train_arm(train: Path, valid: Path, config: TrainConfig) -> dict:
    """Train one arm; its final store and validation AUC."""
    schema = FeatureSchema.criteo()
    trainer = Trainer(schema, config)
    ram: list[int] = []
    start = time.perf_counter()
    trainer.fit([train], progress=False,
                on_pass_end=lambda t, _: ram.append(t.store.stats().admission_bytes))
    seconds = time.perf_counter() - start
    batches = list(iter_file_batches([valid], schema, config.batch_size))
    auc = trainer.evaluate(batches)["auc"]
    st = trainer.store.stats()
    return {"keys": st.keys, "store_bytes": store_bytes(trainer.store),
            "admission_ram_bytes": max(ram), "admission_ram_fixed": len(set(ram)) == 1,
            "auc": round(float(auc), 5), "admitted": st.admitted, "rejected": st.rejected,
            "evicted": st.evicted, "passes": len(ram), "train_s": round(seconds, 1)}


def _arms(keep_all: dict, exact: dict, sketch_bytes: int, l2_below: float
          ) -> list[tuple[str, dict]]:
    cap = max(1, int(0.3 * keep_all["keys"]))
    return [
        ("sketch_count2", {"admit_min_count": 2, "admit_sketch_bytes": sketch_bytes}),
        ("sketch_count2_quarter", {"admit_min_count": 2,
                                   "admit_sketch_bytes": max(1024, sketch_bytes // 4)}),
        ("probability_0.5", {"admit_probability": 0.5}),
        ("show_click", {"admit_min_count": 2, "admit_min_clicks": 1}),
        ("l2_below", {"evict_l2_below": l2_below}),
        *((f"capacity_0.3_{score}", {"max_keys": cap, "evict_score": score})
          for score in ("lfu", "lru", "l2")),
    ]


def run_dataset(name: str, train: Path, valid: Path, base: TrainConfig,
                sketch_bytes: str, l2_below: float) -> list[dict]:
    def arm(store: dict) -> dict:
        return train_arm(train, valid, replace(base, store=StoreConfig(**store)))

    keep_all = arm({"admit_min_count": 1})
    exact = arm({"admit_min_count": 2})
    size = (max(1024, exact["admission_ram_bytes"] // 8) if sketch_bytes == "auto"
            else parse_bytes(sketch_bytes))
    results = [("keep_all", keep_all), ("exact_count2", exact)]
    for policy, store in _arms(keep_all, exact, size, l2_below):
        results.append((policy, arm(store)))
    lines = []
    for policy, r in results:
        line = {"benchmark": "admission_eviction", "data": name, "policy": policy,
                **{k: r[k] for k in ("keys", "store_bytes", "admission_ram_bytes", "auc")},
                "delta_auc_vs_keep_all": round(r["auc"] - keep_all["auc"], 5),
                "keys_vs_keep_all": round(r["keys"] / max(keep_all["keys"], 1), 4),
                "admission_ram_vs_exact": round(r["admission_ram_bytes"]
                                                / max(exact["admission_ram_bytes"], 1), 4),
                **{k: r[k] for k in ("admission_ram_fixed", "admitted", "rejected",
                                     "evicted", "passes", "train_s")},
                "keep_all_keys": keep_all["keys"], "keep_all_auc": keep_all["auc"],
                "note": "2-core machine shared with other jobs (loaded)"}
        print(json.dumps(line), flush=True)
        lines.append(line)
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=300_000, help="synthetic training rows")
    p.add_argument("--valid-rows", type=int, default=100_000)
    p.add_argument("--vocab-scale", type=float, default=1.0,
                   help="synth vocabulary sizes relative to Criteo-shaped defaults")
    p.add_argument("--pass-rows", type=int, default=25_000)
    p.add_argument("--sketch-bytes", default="auto",
                   help="size of the sketch arm's sketch (auto: 1/8 of the exact table's)")
    p.add_argument("--l2-below", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-criteo", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    base = TrainConfig(batch_size=1024, pass_rows=args.pass_rows, epochs=1, seed=0,
                       threads=args.threads,
                       model=ModelConfig(name="deepfm", embedding_dim=8))
    with tempfile.TemporaryDirectory(prefix="terarec-admission-") as tmp:
        root = Path(tmp)
        train, valid = root / "train.tsv", root / "valid.tsv"
        generate(train, args.rows, model_seed=7, sample_seed=1, vocab_scale=args.vocab_scale)
        generate(valid, args.valid_rows, model_seed=7, sample_seed=2,
                 vocab_scale=args.vocab_scale)
        run_dataset("synth_zipf", train, valid, base, args.sketch_bytes, args.l2_below)
        if CRITEO.exists() and not args.skip_criteo:
            lines = CRITEO.read_text().splitlines(keepends=True)
            (root / "criteo-train.tsv").write_text("".join(lines[:8000]))
            (root / "criteo-valid.tsv").write_text("".join(lines[8000:]))
            run_dataset("criteo_sample", root / "criteo-train.tsv", root / "criteo-valid.tsv",
                        replace(base, batch_size=256, pass_rows=2000), args.sketch_bytes,
                        args.l2_below)
        elif not args.skip_criteo:
            print(f"# {CRITEO} absent: Criteo sample skipped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
