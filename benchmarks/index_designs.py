"""Key index designs: int64 key -> slot, lookup-or-insert of a stream of key batches.

The workload is a training stream: batches of 4096 samples x 26 fields of Zipf keys
(hashed per field), inserted into an index that grows without a declared vocabulary.
Designs measured side by side in one run:

    numba        terarec's KeyIndex: compiled open addressing, linear probing
    numpy        a sorted key array: searchsorted lookups, new keys merged per batch
    torch        the same sorted-array design in torch ops
    python_dict  dict.setdefault per key (the per-key Python loop floor)

Prints one JSON line with keys/s per design and the ratio of each to numba.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from terarec.embedding.index import KeyIndex
from terarec.kernels import splitmix64_array


def zipf_batches(n_batches: int, batch_keys: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        ids = rng.zipf(1.15, batch_keys).astype(np.uint64)
        field = rng.integers(0, 26, batch_keys).astype(np.uint64)
        out.append(splitmix64_array(ids + (field << np.uint64(40))).view(np.int64))
    return out


def run_numba(batches: list[np.ndarray]) -> int:
    index = KeyIndex()
    for keys in batches:
        index.lookup_or_insert(keys)
    return len(index)


def run_numpy(batches: list[np.ndarray]) -> int:
    sorted_keys = np.empty(0, np.int64)
    sorted_slots = np.empty(0, np.int64)
    for keys in batches:
        pos = np.searchsorted(sorted_keys, keys).clip(max=max(len(sorted_keys) - 1, 0))
        found = (len(sorted_keys) > 0) & (sorted_keys[pos] == keys) if len(sorted_keys) \
            else np.zeros(len(keys), bool)
        new = np.unique(keys[~found])
        slots = np.arange(len(sorted_keys), len(sorted_keys) + len(new))
        merged = np.concatenate([sorted_keys, new])
        order = np.argsort(merged, kind="stable")
        sorted_keys = merged[order]
        sorted_slots = np.concatenate([sorted_slots, slots])[order]
        _ = sorted_slots[np.searchsorted(sorted_keys, keys)]
    return len(sorted_keys)


def run_torch(batches: list[np.ndarray]) -> int:
    sorted_keys = torch.empty(0, dtype=torch.int64)
    sorted_slots = torch.empty(0, dtype=torch.int64)
    for arr in batches:
        keys = torch.from_numpy(arr)
        if len(sorted_keys):
            pos = torch.searchsorted(sorted_keys, keys).clamp(max=len(sorted_keys) - 1)
            found = sorted_keys[pos] == keys
        else:
            found = torch.zeros(len(keys), dtype=torch.bool)
        new = torch.unique(keys[~found])
        slots = torch.arange(len(sorted_keys), len(sorted_keys) + len(new))
        merged = torch.cat([sorted_keys, new])
        merged, order = torch.sort(merged, stable=True)
        sorted_keys = merged
        sorted_slots = torch.cat([sorted_slots, slots])[order]
        _ = sorted_slots[torch.searchsorted(sorted_keys, keys)]
    return len(sorted_keys)


def run_dict(batches: list[np.ndarray]) -> int:
    index: dict[int, int] = {}
    for keys in batches:
        _ = [index.setdefault(k, len(index)) for k in keys.tolist()]
    return len(index)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--batch-keys", type=int, default=4096 * 26)
    args = parser.parse_args()
    batches = zipf_batches(args.batches, args.batch_keys)
    total = sum(len(b) for b in batches)
    run_numba(batches[:1])  # compile
    result: dict[str, object] = {"benchmark": "index_designs", "keys": total}
    sizes = set()
    for name, fn in [("numba", run_numba), ("numpy", run_numpy), ("torch", run_torch),
                     ("python_dict", run_dict)]:
        start = time.perf_counter()
        sizes.add(fn(batches))
        result[f"{name}_keys_per_s"] = round(total / (time.perf_counter() - start))
    if len(sizes) != 1:
        raise SystemExit(f"designs disagree on the number of distinct keys: {sizes}")
    result["distinct_keys"] = sizes.pop()
    for name in ("numpy", "torch", "python_dict"):
        result[f"numba_vs_{name}"] = round(
            result["numba_keys_per_s"] / result[f"{name}_keys_per_s"], 2)  # type: ignore[operator]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
