"""The disk key index (sorted runs, ``--key-index disk``) against the in-RAM hash index.

For each key count N (``--keys``, repeatable; N distinct keys, every one with a 64 B row on
disk), one process per part below, so that each peak resident set (VmHWM) is its own:

* ``index``: builds a ``RunIndex`` over the N keys and measures RAM per cold key (run
  directories: fences and Bloom filters), RAM per hot key (the hot level holding a pass's
  keys), and how fast a pass's unique keys (Zipf draws over the whole keyspace) resolve:
  page cache warm, and cold (the run files dropped from the page cache with
  ``posix_fadvise(DONTNEED)``, which needs no privileges); then the baseline, a
  ``KeyIndex`` over the same keys with its 4 B last-seen mirror, on the same passes.
* ``ram`` / ``disk``: a ``TieredStore`` (16 fp32 values = 64 B per row, Adagrad) loaded
  with the N rows, then store passes driven as the trainer drives them: ``pull`` the pass's
  unique keys, ``prefetch`` the next pass's keys in a thread while the pass trains
  (``--model deepfm``: DeepFM over the pass's samples, ``--features`` keys each, in
  batches of ``--batch``, rows updated by Adagrad and the network by Adam at every step;
  ``--model none``: a fixed update of the pulled rows, the store's share alone),
  ``push``, ``end_pass``. Both arms get the same budget: what the in-RAM index needs plus
  ``--hot-rows`` rows; the disk index spends the RAM it saves on more hot rows.
* ``disk-equal``: the disk index with a budget for only ``--hot-rows`` rows plus its own
  needs (directories and the hot level's reservation): the index's own cost, without
  the extra hot rows (``sps_ratio_equal_hot_rows``).

Each store arm reports ``rss_phases``: the peak RSS of its setup, load and each pass
phase (pull, train_prefetch, push, end_pass), so an overshoot can be placed.

``sps`` counts samples of ``--features`` keys: the median over the timed passes (after
``--warmup-passes``). ``--repeats R`` runs the store arms R times, interleaved (ram,
disk, disk-equal, ram, ...), so that a change of the machine's load hits every arm; an
arm's ``sps`` is the median of its repeats and a ratio the median of the repeats' ratios.

Prints ONE JSON line: per key count the figures above, ``sps_ratio_vs_ram_index``
(target >= 0.8), ``peak_rss_bytes`` of the disk arm (target at 10^8 keys: <= 2 GB + its
budget), and the per-key RAM extrapolated to 10^9 and 10^10 keys for both indexes.

Usage: ``python benchmarks/key_index_scale.py --keys 10000000 [--keys 100000000]
[--pass-draws 2000000] [--passes 5] [--hot-rows 200000] [--arms index,ram,disk,disk-equal]
[--store-max-keys 1e7] [--model deepfm] [--repeats 3]``. At 10^8 keys an arm loads
10^8 rows (10 GB of slabs and runs, removed after each arm) for minutes: run the arms
one invocation each (``--arms disk --store-max-keys 1e8``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from terarec.config import SparseOptimizerConfig, StoreConfig
from terarec.embedding.index import KeyIndex
from terarec.embedding.keyindex import RunIndex
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.tiered import TieredStore
from terarec.embedding.types import RowBlock, RowChunk
from terarec.kernels import splitmix64_array

ROW_DIM = 16  # 64 B of fp32 values per row
LOAD_CHUNK = 1 << 20
STORE_ARMS = ("ram", "disk", "disk-equal")


def _vmhwm() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _PhasePeaks:
    """Peak RSS per phase of a store arm (load, pull, train, push, end_pass): the kernel's
    high-water mark is read at each phase's end and reset (``/proc/self/clear_refs`` 5),
    so each figure is that phase's own peak. Where the reset is refused (not Linux), every
    phase reports the process peak so far."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self._reset()

    def _reset(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        except OSError:
            pass

    def end(self, phase: str) -> None:
        self.peaks[phase] = max(self.peaks.get(phase, 0), _vmhwm())
        self._reset()


def _key(ranks: np.ndarray) -> np.ndarray:
    """The key of each popularity rank: spread over int64 as hashed features are."""
    return splitmix64_array(ranks.astype(np.uint64)).view(np.int64)


def _passes(n_keys: int, passes: int, draws: int, zipf: float, seed: int, features: int
            ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per pass: its unique keys (shuffled), their show counts (Zipf draws) and its
    samples: ``draws // features`` rows of ``features`` positions into the unique keys."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(passes):
        ranks = (rng.zipf(zipf, draws) - 1) % n_keys
        uniq, inverse, counts = np.unique(ranks, return_inverse=True, return_counts=True)
        order = rng.permutation(len(uniq))
        where = np.empty(len(uniq), np.int32)
        where[order] = np.arange(len(uniq), dtype=np.int32)
        samples = where[inverse[:draws // features * features]].reshape(-1, features)
        out.append((_key(uniq[order]), counts[order].astype(np.float32), samples))
    return out


def _drop_page_cache(folder: Path) -> None:
    for path in folder.glob("run-*"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _rate(fn, keys: np.ndarray) -> float:
    t0 = time.perf_counter()
    fn(keys)
    return len(keys) / (time.perf_counter() - t0)


def run_index(args: argparse.Namespace, n: int, folder: Path) -> dict:
    passes = _passes(n, 4, args.pass_draws, args.zipf, args.seed, args.features)
    runs = RunIndex(folder)
    t0 = time.perf_counter()
    for lo in range(0, n, LOAD_CHUNK):
        keys = _key(np.arange(lo, min(n, lo + LOAD_CHUNK)))
        runs.assign(keys, np.zeros(len(keys), np.int32))
    runs.end_pass()
    runs.compact()
    build_s = time.perf_counter() - t0
    runs.plan(passes[0][0])  # compile and warm the page cache
    warm = []
    for keys, _, _ in passes[1:3]:
        runs.end_pass()
        runs.end_pass()  # nothing planned: the hot level is empty, every key is cold
        warm.append(_rate(runs.plan, keys))
        hot_bytes = (runs.nbytes - runs.directory_bytes) / max(runs.hot_keys, 1)
    runs.end_pass()
    runs.end_pass()
    _drop_page_cache(folder)
    cold = _rate(runs.plan, passes[3][0])
    runs.end_pass()
    runs.end_pass()
    out = {"keys": n, "runs": len(runs.runs), "run_file_bytes": runs.file_bytes,
           "ram_bytes_per_cold_key": round(runs.nbytes / n, 3),
           "ram_bytes_per_hot_key": round(hot_bytes, 1),
           "pass_unique_keys": int(np.mean([len(k) for k, _, _ in passes])),
           "resolve_keys_per_s_warm": int(np.median(warm)),
           "resolve_keys_per_s_cold": int(cold),
           "build_keys_per_s": int(n / build_s),
           "peak_rss_index_bytes": _vmhwm()}
    runs.close()
    if n <= args.baseline_max_keys:  # the in-RAM index over the same keys
        index = KeyIndex(16)
        t0 = time.perf_counter()
        for lo in range(0, n, LOAD_CHUNK):
            index.lookup_or_insert(_key(np.arange(lo, min(n, lo + LOAD_CHUNK))))
        build_s = time.perf_counter() - t0
        index.lookup(passes[0][0])
        out.update({
            "ram_index_bytes_per_key": round((index.nbytes + 4 * n) / n, 1),
            "resolve_keys_per_s_warm_ram_index": int(np.median(
                [_rate(index.lookup, k) for k, _, _ in passes[1:3]])),
            "build_keys_per_s_ram_index": int(n / build_s)})
        del index
    if n <= args.engine_max_keys:
        try:
            out.update(run_lmdb(n, passes, folder))
        except ImportError:
            out["lmdb"] = "not installed"
    return out


def _byte_keys(a: np.ndarray) -> list[bytes]:
    """Each 8-byte element as bytes, in the array's byte order (a numpy scalar's
    ``tobytes`` would convert it to native order)."""
    buf = a.tobytes()
    return [buf[i:i + 8] for i in range(0, len(buf), 8)]


def run_lmdb(n: int, passes: list, folder: Path) -> dict:
    """The embedded-engine alternative: LMDB (py-lmdb) holding key -> slot, keys as
    big-endian bytes (sorted as the ints are, for non-negative keys: the keys here are
    masked to 63 bits), built in key order and read with batched ``getmulti``."""
    import lmdb

    env = lmdb.open(str(folder / "lmdb"), map_size=64 * n + (1 << 30), sync=False,
                    writemap=True)
    t0 = time.perf_counter()
    keys = np.sort(_key(np.arange(n)) & np.int64(0x7FFFFFFFFFFFFFFF))
    be_keys = keys.astype(">i8")
    slots = np.arange(n, dtype="<i8")
    with env.begin(write=True) as txn, txn.cursor() as cur:
        for lo in range(0, n, LOAD_CHUNK):
            cur.putmulti(zip(_byte_keys(be_keys[lo:lo + LOAD_CHUNK]),
                             _byte_keys(slots[lo:lo + LOAD_CHUNK]), strict=True),
                         append=True)
    build_s = time.perf_counter() - t0
    del keys, be_keys, slots
    rates = []
    for q, _, _ in passes[1:3]:
        q = np.sort(q & np.int64(0x7FFFFFFFFFFFFFFF)).astype(">i8")
        t0 = time.perf_counter()
        with env.begin() as txn, txn.cursor() as cur:
            found = cur.getmulti(_byte_keys(q))
        rates.append(len(q) / (time.perf_counter() - t0))
        assert len(found) == len(q)
    size = sum(f.stat().st_blocks * 512 for f in (folder / "lmdb").iterdir())  # sparse
    env.close()
    return {"resolve_keys_per_s_warm_lmdb": int(np.median(rates)),
            "build_keys_per_s_lmdb": int(n / build_s), "lmdb_file_bytes": size}


class _DeepFM:
    """A pass of real training over the pulled rows: DeepFM (15-wide factors plus the
    linear weight: the 16 values of a row) in batches of ``--batch`` samples, the rows
    updated by the store's sparse optimizer at every step and the network by Adam, as
    the trainer does. Labels are random: the cost, not the model, is measured."""

    def __init__(self, args: argparse.Namespace, rng: np.random.Generator) -> None:
        from terarec.config import ModelConfig
        from terarec.models.fm import DeepFM
        from terarec.types import FeatureSchema, FieldSpec

        torch.set_num_threads(args.threads)
        torch.manual_seed(args.seed)
        schema = FeatureSchema(label="label", missing_flags=False, fields=tuple(
            FieldSpec(f"C{i}", "categorical") for i in range(args.features)))
        self.model = DeepFM(schema, ModelConfig(name="deepfm", embedding_dim=ROW_DIM - 1))
        self.dense_opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.sparse = SparseOptimizer(SparseOptimizerConfig(name="adagrad"))
        self.batch, self.rng = args.batch, rng

    def train(self, block: RowBlock, admitted: np.ndarray, samples: np.ndarray) -> None:
        n = len(admitted)  # working-set rows: 0 is the zero row of keys not admitted
        row = np.zeros(n, np.int64)
        row[admitted] = np.arange(1, int(admitted.sum()) + 1)
        weights = torch.zeros(len(block.values) + 1, ROW_DIM)
        state = torch.zeros(len(block.values) + 1, block.state.shape[1])
        weights[1:] = torch.from_numpy(block.values)
        state[1:] = torch.from_numpy(block.state)
        ids = torch.from_numpy(row[samples])
        labels = torch.from_numpy((self.rng.random(len(samples)) < 0.2).astype(np.float32))
        dense = torch.zeros(self.batch, 0)
        scratch = np.full(len(weights), -1, np.int64)
        for lo in range(0, len(ids), self.batch):
            b_ids = ids[lo:lo + self.batch]
            emb = weights[b_ids].requires_grad_()
            logits = self.model(dense[:len(b_ids)], emb)
            loss = F.binary_cross_entropy_with_logits(logits, labels[lo:lo + self.batch])
            self.dense_opt.zero_grad()
            loss.backward()
            self.dense_opt.step()
            assert emb.grad is not None
            self.sparse.step(weights, state, b_ids.reshape(-1),
                             emb.grad.reshape(-1, ROW_DIM), scratch)
        block.values[:] = weights[1:].numpy()
        block.state[:] = state[1:].numpy()


def _ram_index_bytes(n: int) -> int:
    """What a tiered store's budget reserves for an in-RAM index of n keys: the table
    twice (its size after the next doubling), 16 B per bucket at <= 50 % load, and the
    last-seen mirror (grown by doubling)."""
    cap = 16
    while cap // 2 < n:
        cap *= 2
    mirror = 16
    while mirror < n:
        mirror *= 2
    return 2 * 16 * cap + 4 * mirror


def _folder_bytes(folder: Path) -> int:
    """Disk space the arm's files take (allocated blocks: slabs may be sparse)."""
    return sum(f.stat().st_blocks * 512 for f in folder.rglob("*") if f.is_file())


def run_store(args: argparse.Namespace, n: int, arm: str, folder: Path) -> dict:
    start = time.perf_counter()
    passes = _passes(n, args.warmup_passes + args.passes + 1, args.pass_draws, args.zipf,
                     args.seed + 1, args.features)
    optimizer = SparseOptimizer(SparseOptimizerConfig(name="adagrad"))
    row_bytes = TieredStore(ROW_DIM, optimizer)._row_bytes  # what the budget charges a row
    # The same budget for both arms: what the in-RAM index needs plus ``hot_rows`` rows;
    # "disk-equal": the disk index's own needs plus ``hot_rows`` rows. Its needs are the
    # directories (about 1.1 B per key) and the hot level's reservation: a quarter of
    # the budget (``RunIndex.reserved_bytes``), or more while it holds this pass's and
    # the planned next pass's keys (about 70-100 B each).
    uniq = max(len(k) for k, _, _ in passes)
    rest = args.hot_rows * row_bytes + int(1.1 * n)
    budget = rest + (max(rest // 3, 200 * uniq) if arm == "disk-equal" else _ram_index_bytes(n))
    arm_index = "disk" if arm == "disk-equal" else arm
    store = TieredStore(ROW_DIM, optimizer, StoreConfig(memory_budget=budget, key_index=arm_index),
                        seed=1, path=folder)
    rng = np.random.default_rng(args.seed)

    def chunks():
        for lo in range(0, n, LOAD_CHUNK):
            keys = _key(np.arange(lo, min(n, lo + LOAD_CHUNK)))
            m = len(keys)
            yield RowChunk(keys, rng.normal(0, 0.01, (m, ROW_DIM)).astype(np.float32),
                           np.ones((m, 1), np.float32), np.ones(m, np.float32),
                           np.zeros(m, np.float32), np.zeros(m, np.int32))

    phases = _PhasePeaks()
    phases.end("setup")
    t0 = time.perf_counter()
    store.load_rows(chunks(), {})
    load_s = time.perf_counter() - t0
    phases.end("load")
    trainer = _DeepFM(args, rng) if args.model == "deepfm" else None
    rates = []
    for pass_id, (keys, show, samples) in enumerate(passes[:-1]):
        t0 = time.perf_counter()
        block, admitted = store.pull(keys, show, np.zeros_like(show), pass_id)
        phases.end("pull")
        prefetch = threading.Thread(target=store.prefetch, args=(passes[pass_id + 1][0],))
        prefetch.start()
        if trainer is not None:
            trainer.train(block, admitted, samples)
        else:  # the store's share of a step alone: a fixed update of the pulled rows
            block.values *= np.float32(0.999)
            block.state += np.float32(1.0)
        prefetch.join()
        phases.end("train_prefetch")
        store.push(keys[admitted], RowBlock(block.values, block.state))
        phases.end("push")
        store.end_pass(pass_id)
        phases.end("end_pass")
        if pass_id >= args.warmup_passes:  # the first passes compile and warm up
            rates.append(len(samples) / (time.perf_counter() - t0))
    tiers = store.tier_stats()
    folder_bytes = _folder_bytes(folder)
    store.close()
    return {"arm": arm, "sps": int(np.median(rates)), "sps_passes": [int(r) for r in rates],
            "load_rows_per_s": int(n / load_s),
            "seconds": round(time.perf_counter() - start, 1), "folder_bytes": folder_bytes,
            "memory_budget_bytes": budget, "memory_capacity": tiers.memory_capacity,
            "hit_rate": round(tiers.hits / max(tiers.hits + tiers.misses, 1), 3),
            "index_bytes": tiers.index_bytes, "memory_keys": tiers.memory_keys,
            "peak_rss_bytes": max(phases.peaks.values()), "rss_phases": phases.peaks}


def _child(args: argparse.Namespace, what: str, n: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="key-index-", dir=args.dir) as tmp:
        cmd = [sys.executable, __file__, "--child", what, "--keys", str(n),
               "--dir", tmp, *args.pass_through]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{what} at {n} keys failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def _paired_ratio(a: list[dict], b: list[dict]) -> float:
    """Median over the repeats of each repeat's sps ratio (paired: run under the same
    load, one after the other)."""
    return round(float(np.median([x["sps"] / y["sps"] for x, y in zip(a, b, strict=True)])), 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=float, action="append")
    p.add_argument("--pass-draws", type=int, default=2_000_000,
                   help="Zipf draws (key occurrences) per pass")
    p.add_argument("--passes", type=int, default=5, help="timed store passes (+1 warm-up)")
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--features", type=int, default=26, help="keys per sample, for sps")
    p.add_argument("--hot-rows", type=int, default=200_000)
    p.add_argument("--arms", default="index,ram,disk,disk-equal",
                   help="parts to run, each in its own process (at 10^8 keys an arm takes "
                   "minutes: run them one invocation each)")
    p.add_argument("--baseline-max-keys", type=float, default=1e8,
                   help="skip the in-RAM baselines above this many keys (RAM)")
    p.add_argument("--store-max-keys", type=float, default=1e7,
                   help="run the store arms up to this many keys (loading N rows of "
                   "80 B records takes minutes at 10^8)")
    p.add_argument("--engine-max-keys", type=float, default=1e7,
                   help="measure LMDB (if installed) up to this many keys")
    p.add_argument("--model", choices=("deepfm", "none"), default="deepfm",
                   help="the dense model trained in each store pass (none: the store's "
                   "share of a step alone, a fixed update of the pulled rows)")
    p.add_argument("--batch", type=int, default=4096, help="samples per training step")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--warmup-passes", type=int, default=2,
                   help="untimed store passes first (compilation, page cache)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the store arms this many times, interleaved; sps and "
                   "ratios are medians over the repeats")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="scratch folder (default: the system's)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = [int(k) for k in (args.keys or [1e7])]
    args.pass_through = ["--pass-draws", str(args.pass_draws), "--passes", str(args.passes),
                         "--zipf", str(args.zipf), "--features", str(args.features),
                         "--hot-rows", str(args.hot_rows), "--seed", str(args.seed),
                         "--model", args.model, "--batch", str(args.batch),
                         "--threads", str(args.threads),
                         "--warmup-passes", str(args.warmup_passes),
                         "--baseline-max-keys", str(args.baseline_max_keys),
                         "--engine-max-keys", str(args.engine_max_keys)]
    if args.child:
        n, folder = sizes[0], Path(args.dir)
        out = run_index(args, n, folder) if args.child == "index" else \
            run_store(args, n, args.child, folder)
        print(json.dumps(out))
        return
    start = time.perf_counter()
    results = {}
    parts = [a for a in args.arms.split(",") if a]
    unknown = set(parts) - {"index", *STORE_ARMS}
    if unknown:
        raise SystemExit(f"--arms: unknown {sorted(unknown)}; expected index, "
                         f"{', '.join(STORE_ARMS)}")
    for n in sizes:
        r = _child(args, "index", n) if "index" in parts else {"keys": n}
        names = [a for a in parts if a in STORE_ARMS and n <= args.store_max_keys]
        runs: dict[str, list[dict]] = {a: [] for a in names}
        for _ in range(args.repeats):  # interleaved: a load change hits every arm
            for a in names:
                runs[a].append(_child(args, a, n))
        arms = {a: {**max(rs, key=lambda x: x["peak_rss_bytes"]),
                    "sps": int(np.median([x["sps"] for x in rs])),
                    "sps_repeats": [x["sps"] for x in rs]} for a, rs in runs.items()}

        if "disk" in arms:
            r.update({"sps_disk_index": arms["disk"]["sps"],
                      "peak_rss_bytes": arms["disk"]["peak_rss_bytes"],
                      "memory_budget_bytes": arms["disk"]["memory_budget_bytes"],
                      "rss_target_bytes": (2 << 30) + arms["disk"]["memory_budget_bytes"]})
        if "disk-equal" in arms:
            r.update({"peak_rss_disk_equal_bytes": arms["disk-equal"]["peak_rss_bytes"],
                      "rss_target_disk_equal_bytes":
                          (2 << 30) + arms["disk-equal"]["memory_budget_bytes"]})
        if "ram" in arms:
            r.update({"sps_ram_index": arms["ram"]["sps"],
                      "peak_rss_ram_index_bytes": arms["ram"]["peak_rss_bytes"]})
        if "ram" in arms and "disk" in arms:
            r["sps_ratio_vs_ram_index"] = _paired_ratio(runs["disk"], runs["ram"])
        if "ram" in arms and "disk-equal" in arms:
            r["sps_ratio_equal_hot_rows"] = _paired_ratio(runs["disk-equal"], runs["ram"])
        r["arms"] = arms
        results[str(n)] = r
    big = results[str(max(sizes))]
    cold = big.get("ram_bytes_per_cold_key")
    extrapolated = {} if cold is None else {f"1e{e}": {
        "disk_index_ram_bytes": int(cold * 10 ** e),
        "disk_index_file_bytes": 20 * 10 ** e,
        **({"ram_index_ram_bytes": int(big["ram_index_bytes_per_key"] * 10 ** e)}
           if "ram_index_bytes_per_key" in big else {})} for e in (9, 10)}
    print(json.dumps({"benchmark": "key_index_scale", "sizes": results,
                      "extrapolated": extrapolated, "pass_draws": args.pass_draws,
                      "zipf": args.zipf, "hot_rows": args.hot_rows, "model": args.model,
                      "repeats": args.repeats, "warmup_passes": args.warmup_passes,
                      "loadavg": [round(x, 2) for x in os.getloadavg()],
                      "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
