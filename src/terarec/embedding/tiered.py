"""The tiered store: hot rows in RAM under a byte budget, every row on disk.

Same API as ``MemoryStore`` (pull / push / lookup / end_pass / evict / stats), so the
trainer and the working set use either unchanged::

    pull(keys) ──> memory tier (MemoryStore, <= budget) ──miss──> disk tier (slab files)
                    │  hit: rows copied out                         batched read
                    └─ full: coldest rows spilled (written back if dirty)
    prefetch(next pass keys)   disk -> memory in a thread while this pass trains
    push(keys)                 memory rows updated in place; spilled ones written to disk

Invariant: a key lives in the memory tier, the disk tier or both; where both, the memory
copy is authoritative and ``dirty`` says whether the disk copy is behind. ``flush``
writes every dirty row back, after which the disk tier alone holds the whole store --
what checkpoints snapshot.

The budget covers all RAM that grows with the store: memory-tier rows and their index,
admission candidates, and the disk tier's key index (32-64 B per key) with its last-seen
mirror (4 B per key). What is left after the indexes sets how many rows stay hot; a store
whose key index alone outgrows the budget is refused with the numbers.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file as save_numpy

from terarec.config import StoreConfig, parse_bytes
from terarec.embedding.disk import DiskTier, file_sha256, read_snapshot_records, record_width
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.store import MemoryStore, RowBlock, StoreStats

STORE_FILE = "store.safetensors"
# The memory tier's KeyIndex is sized for 1.5x its rows (a pull inserts up to half the
# tier on top of a full one): 3-6 buckets of 16 B per row.
_INDEX_BYTES_PER_ROW = 96


class MemoryBudgetError(MemoryError):
    """The store's fixed RAM (key indexes) no longer fits the configured budget."""


@dataclass
class TierStats:
    """Where the rows are and what moving them cost, for logs and ``terarec inspect``."""

    memory_keys: int
    memory_capacity: int
    memory_bytes: int
    disk_keys: int
    disk_file_bytes: int
    index_bytes: int
    spilled: int
    loaded: int
    prefetched: int
    hits: int
    misses: int
    disk_rows_read: int
    disk_rows_written: int
    disk_read_s: float
    disk_write_s: float
    prefetch_s: float
    pull_disk_s: float


class TieredStore:
    """``MemoryStore`` API over a memory tier bounded by ``config.memory_budget`` and a
    disk tier under ``path`` (default ``config.disk_path``, else a temporary folder)."""

    def __init__(self, row_dim: int, optimizer: SparseOptimizer,
                 config: StoreConfig | None = None, seed: int = 0,
                 path: str | Path | None = None) -> None:
        self.row_dim = row_dim
        self.optimizer = optimizer
        self.config = config or StoreConfig()
        self.seed = seed
        self.state_dim = optimizer.state_dim(row_dim)
        self.width = record_width(row_dim, self.state_dim)
        self.budget = (parse_bytes(self.config.memory_budget)
                       if self.config.memory_budget is not None else None)
        if self.config.cache_policy not in ("lfu", "lru"):
            raise ValueError(f"cache_policy {self.config.cache_policy!r}: expected lfu or lru")
        path = path or self.config.disk_path
        if path is None:
            path = tempfile.mkdtemp(prefix="terarec-store-")
            weakref.finalize(self, shutil.rmtree, path, True)
        self.disk = DiskTier(path, self.width, mapped_bytes=self._mapped_bytes)
        if self.budget is not None:
            _return_freed_buffers_to_os()
        self._lock = threading.RLock()
        self._tick = 0
        self._capacity_at_alloc = 0
        self._new_memory_tier()
        self._disk_only_evicted = 0
        self._counters = dict(spilled=0, loaded=0, prefetched=0, hits=0, misses=0)
        self._prefetch_s = 0.0
        self._pull_disk_s = 0.0
        self._snapshot_dir: Path | None = None
        self._snapshot_digests: dict[str, str] = {}

    @property
    def _mapped_bytes(self) -> int:
        """Slab pages mapped at once: a quarter of the budget, at most 64 MB."""
        return 64 << 20 if self.budget is None else max(1 << 20, min(64 << 20,
                                                                      self.budget // 4))

    # -- memory tier --------------------------------------------------------------------
    @property
    def _row_bytes(self) -> int:
        """RAM per hot row: record, LRU tick, two flags, and its share of the index."""
        return 4 * self.width + 8 + 2 + _INDEX_BYTES_PER_ROW

    def _fixed_bytes(self) -> int:
        """RAM that grows with the key count, not the hot set. The disk index counts
        twice, its size after the next doubling, so that a doubling does not push the
        memory tier over budget (during the rehash itself the old table is held too)."""
        m = getattr(self, "memory", None)
        cand = m._cand_index.nbytes + m._cand_show.nbytes * 3 if m is not None else 0
        return 2 * self.disk.index.nbytes + self.disk.last_seen.nbytes + cand

    def memory_capacity(self) -> int:
        """Rows the memory tier may hold now (the budget less the fixed part)."""
        if self.budget is None:
            return 1 << 62
        free = self.budget - self._fixed_bytes()
        if free < 64 * self._row_bytes:
            raise MemoryBudgetError(
                f"memory budget {self.budget:,} B leaves room for no hot rows: the key "
                f"indexes of {len(self.disk):,} keys on disk and "
                f"{len(self.memory._cand_index):,} admission candidates take "
                f"{self._fixed_bytes():,} B (about 64-100 B per key); raise --memory-budget")
        return free // self._row_bytes

    def _new_memory_tier(self, carry: MemoryStore | None = None) -> None:
        """(Re)allocate the memory tier at the current capacity. Arrays are np.zeros, so
        rows never used cost no RAM; the index is sized for the capacity up front."""
        cap = self.memory_capacity()
        alloc = int(min(cap, 1 << 16)) if self.budget is None else int(cap)
        m = MemoryStore(self.row_dim, self.optimizer, self.config, seed=self.seed,
                        capacity=max(alloc + alloc // 2, 16))
        if carry is not None:
            m._cand_index, m._cand_show = carry._cand_index, carry._cand_show
            m._cand_click, m._cand_seen = carry._cand_click, carry._cand_seen
            m.admitted_total, m.evicted_total = carry.admitted_total, carry.evicted_total
        self.memory = m
        self._capacity_at_alloc = alloc
        self._meta_size = 0
        self._ensure_meta()

    def _ensure_meta(self) -> None:
        """Per memory slot: last use (LRU), dirty (disk copy behind), on_disk."""
        need = len(self.memory.show)
        if need <= self._meta_size:
            return
        for name, dtype in (("_used", np.int64), ("_dirty", np.bool_), ("_on_disk", np.bool_)):
            old = getattr(self, name, None) if self._meta_size else None
            grown = np.zeros(need, dtype)
            if old is not None:
                grown[:len(old)] = old
            setattr(self, name, grown)
        self._meta_size = need

    def _records(self, slots: np.ndarray) -> np.ndarray:
        m = self.memory
        out = np.empty((len(slots), self.width), np.float32)
        d, s = self.row_dim, self.state_dim
        out[:, :d] = m.values[slots]
        out[:, d:d + s] = m.state[slots]
        out[:, d + s] = m.show[slots]
        out[:, d + s + 1] = m.click[slots]
        out[:, d + s + 2] = m.last_seen[slots].view(np.float32)
        return out

    def _set_records(self, slots: np.ndarray, rec: np.ndarray) -> None:
        m = self.memory
        d, s = self.row_dim, self.state_dim
        m.values[slots] = rec[:, :d]
        m.state[slots] = rec[:, d:d + s]
        m.show[slots] = rec[:, d + s]
        m.click[slots] = rec[:, d + s + 1]
        m.last_seen[slots] = np.ascontiguousarray(rec[:, d + s + 2]).view(np.int32)

    def _spill(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Move rows out of the memory tier, writing back those the disk lacks."""
        self._write_back(keys, slots)
        self.memory.index.remove(keys)
        self._dirty[slots] = False
        self._on_disk[slots] = False
        self._counters["spilled"] += len(keys)

    def _make_room(self, need: int, protect: np.ndarray) -> None:
        """Spill the coldest rows (by policy) until ``need`` more fit; ``protect``: memory
        slots that must stay (the keys being pulled)."""
        cap = self.memory_capacity()
        free = cap - len(self.memory)
        if need <= free:
            return
        keys, slots = self.memory.index.items()
        n_out = min(need - free, len(keys))
        if self.config.cache_policy == "lfu":
            prio = self.memory.show[slots].astype(np.float64)
        else:
            prio = self._used[slots].astype(np.float64)
        if len(protect):
            keep = np.zeros(len(self._used), np.bool_)
            keep[protect] = True
            prio[keep[slots]] = np.inf
        victims = np.argpartition(prio, n_out - 1)[:n_out] if n_out < len(prio) else \
            np.arange(len(prio))
        victims = victims[np.isfinite(prio[victims])]
        self._spill(keys[victims], slots[victims])

    def _load(self, keys: np.ndarray, protect_present: bool = True) -> np.ndarray:
        """Bring the disk rows of ``keys`` that the memory tier lacks into it; returns the
        mask of keys found in neither tier."""
        mslots = self.memory.index.lookup(keys)
        inmem = mslots >= 0
        self._used[mslots[inmem]] = self._tick
        missing = keys[~inmem]
        absent = np.zeros(len(keys), np.bool_)
        if not len(missing):
            return absent
        dslots = self.disk.index.lookup(missing)
        found = dslots >= 0
        absent[np.flatnonzero(~inmem)[~found]] = True
        loaded = missing[found]
        self._make_room(len(loaded), mslots[inmem] if protect_present else np.empty(0, np.int64))
        rec = self.disk.read_slots(dslots[found])
        if len(loaded):
            slots, _ = self.memory.index.lookup_or_insert(loaded)
            self.memory._ensure_rows(self.memory.index.slot_bound)
            self._ensure_meta()
            self._set_records(slots, rec)
            self._dirty[slots] = False
            self._on_disk[slots] = True
            self._used[slots] = self._tick
            self._counters["loaded"] += len(loaded)
        return absent

    # -- the MemoryStore API ------------------------------------------------------------
    def pull(self, keys: np.ndarray, show: np.ndarray, click: np.ndarray,
             pass_id: int) -> tuple[RowBlock, np.ndarray]:
        """Rows of the unique ``keys`` of a pass (see ``MemoryStore.pull``), loading misses
        from disk in batches no larger than half the memory tier."""
        keys = np.ascontiguousarray(keys, np.int64)
        with self._lock:
            self._tick += 1
            chunk = max(1, self.memory_capacity() // 2)
            values, states, masks = [], [], []
            for start in range(0, len(keys), chunk):
                k = keys[start:start + chunk]
                hits = int((self.memory.index.lookup(k) >= 0).sum())
                self._counters["hits"] += hits
                self._counters["misses"] += len(k) - hits
                t0 = time.perf_counter()
                absent = self._load(k)
                self._pull_disk_s += time.perf_counter() - t0
                # Room for the new keys admission may add (at most the absent ones).
                present = self.memory.index.lookup(k)
                self._make_room(int(absent.sum()), present[present >= 0])
                block, admitted = self.memory.pull(k, show[start:start + chunk],
                                                   click[start:start + chunk], pass_id)
                self._ensure_meta()
                slots = self.memory.index.lookup(k[admitted])
                self._dirty[slots] = True
                self._used[slots] = self._tick
                new = absent[admitted]
                self._on_disk[slots[new]] = False
                values.append(block.values)
                states.append(block.state)
                masks.append(admitted)
            if not masks:
                empty = RowBlock(np.empty((0, self.row_dim), np.float32),
                                 np.empty((0, self.state_dim), np.float32))
                return empty, np.zeros(0, np.bool_)
            if len(masks) == 1:  # the usual case: no second copy of the pass's rows
                return RowBlock(values[0], states[0]), masks[0]
            return RowBlock(np.concatenate(values), np.concatenate(states)), \
                np.concatenate(masks)

    def push(self, keys: np.ndarray, block: RowBlock) -> None:
        """Write back trained rows: in place where hot, to disk where spilled meanwhile."""
        keys = np.ascontiguousarray(keys, np.int64)
        with self._lock:
            mslots = self.memory.index.lookup(keys)
            hot = mslots >= 0
            s = mslots[hot]
            self.memory.values[s] = block.values[hot]
            self.memory.state[s] = block.state[hot]
            self._dirty[s] = True
            cold = keys[~hot]
            if len(cold):
                rec, found = self.disk.read(cold)
                if not found.all():
                    raise KeyError(f"{int((~found).sum())} pushed keys are not in the store")
                d = self.row_dim
                rec[:, :d] = block.values[~hot]
                rec[:, d:d + self.state_dim] = block.state[~hot]
                self.disk.write(cold, rec)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Read-only values of ``keys`` (zero rows where absent) and the found mask; the
        memory tier is left as it is (scoring does not displace training's hot rows)."""
        keys = np.ascontiguousarray(keys, np.int64)
        with self._lock:
            values, found = self.memory.lookup(keys)
            cold = np.flatnonzero(~found)
            if len(cold):
                rec, on_disk = self.disk.read(keys[cold])
                values[cold[on_disk]] = rec[on_disk, :self.row_dim]
                found[cold[on_disk]] = True
            return values, found

    def prefetch(self, keys: np.ndarray) -> int:
        """Load the disk rows of ``keys`` (the next pass's) into the memory tier, as many
        as half of it holds; run in a thread while the current pass trains. Returns the
        number of rows read."""
        keys = np.ascontiguousarray(keys, np.int64)
        with self._lock:
            t0 = time.perf_counter()
            self._tick += 1
            keys = keys[self.memory.index.lookup(keys) < 0]
            keys = keys[:max(0, self.memory_capacity() // 2)]
            before = self._counters["loaded"]
            self._load(keys, protect_present=False)
            n = self._counters["loaded"] - before
            self._counters["prefetched"] += n
            self._prefetch_s += time.perf_counter() - t0
            return n

    def end_pass(self, pass_id: int) -> int:
        """TTL eviction across both tiers, then fit the memory tier to the budget again
        and unmap the slab pages this pass touched."""
        with self._lock:
            evicted = 0
            ttl = self.config.evict_after_passes
            if ttl is not None:
                cutoff = pass_id - ttl
                mkeys, mslots = self.memory.index.items()
                mem_stale = mkeys[self.memory.last_seen[mslots] <= cutoff]
                evicted += self.memory.end_pass(pass_id)  # rows and admission candidates
                self.disk.remove(mem_stale)
                dkeys, dslots = self.disk.items()
                stale = dkeys[self.disk.last_seen[dslots] <= cutoff]
                stale = stale[self.memory.index.lookup(stale) < 0]
                present = self.disk.remove(stale)
                disk_only = stale[present]
                disk_only = disk_only[~np.isin(disk_only, mem_stale)]
                self._disk_only_evicted += len(disk_only)
                evicted += len(disk_only)
            self._fit_budget()
            self.disk.release_pages()
            return evicted

    def _fit_budget(self) -> None:
        if self.budget is None:
            return
        cap = self.memory_capacity()
        if cap < 0.875 * self._capacity_at_alloc:
            # The key index grew: rebuild the memory tier smaller so RAM stays in budget.
            self.flush()
            self._new_memory_tier(carry=self.memory)
            return
        self._make_room(0, np.empty(0, np.int64))

    def evict(self, keys: np.ndarray) -> int:
        keys = np.ascontiguousarray(keys, np.int64)
        with self._lock:
            inmem = self.memory.index.lookup(keys) >= 0
            n = self.memory.evict(keys)
            on_disk = self.disk.remove(keys)
            disk_only = int((on_disk & ~inmem).sum())
            self._disk_only_evicted += disk_only
            return n + disk_only

    def flush(self) -> None:
        """Write every dirty hot row to disk: afterwards the disk tier holds the store."""
        with self._lock:
            keys, slots = self.memory.index.items()
            self._write_back(keys, slots)
            self._dirty[slots] = False
            self._on_disk[slots] = True

    def _write_back(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Write the rows of ``slots`` the disk lacks, a bounded chunk at a time (a
        whole-tier copy would double the memory tier's RAM for a moment)."""
        dirty = self._dirty[slots] | ~self._on_disk[slots]
        keys, slots = keys[dirty], slots[dirty]
        step = self.disk._chunk_rows
        for start in range(0, len(keys), step):
            self.disk.write(keys[start:start + step], self._records(slots[start:start + step]))

    # -- sizes and stats ----------------------------------------------------------------
    def __len__(self) -> int:
        _, slots = self.memory.index.items()
        return len(self.disk) + int((~self._on_disk[slots]).sum())

    @property
    def admitted_total(self) -> int:
        return self.memory.admitted_total

    @property
    def evicted_total(self) -> int:
        return self.memory.evicted_total + self._disk_only_evicted

    @property
    def nbytes(self) -> int:
        """RAM held: hot rows, their index and flags, the disk tier's index."""
        meta = self._used.nbytes + self._dirty.nbytes + self._on_disk.nbytes
        return self.memory.nbytes + meta + self.disk.ram_bytes

    def stats(self) -> StoreStats:
        return StoreStats(keys=len(self), candidates=len(self.memory._cand_index),
                          admitted=self.admitted_total, evicted=self.evicted_total,
                          bytes=self.nbytes)

    def tier_stats(self) -> TierStats:
        d = self.disk.stats()
        return TierStats(
            memory_keys=len(self.memory),
            memory_capacity=int(min(self.memory_capacity(), 1 << 62)),
            memory_bytes=self.memory.nbytes, disk_keys=d.keys, disk_file_bytes=d.file_bytes,
            index_bytes=d.index_bytes, disk_rows_read=d.rows_read,
            disk_rows_written=d.rows_written, disk_read_s=d.read_s, disk_write_s=d.write_s,
            prefetch_s=self._prefetch_s, pull_disk_s=self._pull_disk_s, **self._counters)

    # -- persistence --------------------------------------------------------------------
    def _store_arrays(self) -> dict[str, np.ndarray]:
        return {**self.memory.candidate_arrays(),
                "counters": np.array([self.admitted_total, self.evicted_total,
                                      self._disk_only_evicted], np.int64)}

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The whole store sorted by key, in RAM (small tables, exports); checkpoints use
        ``save_snapshot``, which never materialises the table."""
        with self._lock:
            self.flush()
            keys, slots = self.disk.items()
            order = np.argsort(keys, kind="stable")
            keys, slots = keys[order], slots[order]
            arrays = {**records_to_arrays(keys, self.disk.read_slots(slots), self.row_dim,
                                          self.state_dim), **self._store_arrays()}
            arrays["counters"] = arrays["counters"][:2]  # MemoryStore's form
            return arrays

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace the content by ``MemoryStore.to_arrays``-style arrays (written to disk)."""
        keys = arrays["keys"]
        if arrays["values"].shape != (len(keys), self.row_dim):
            raise ValueError(f"stored rows have shape {arrays['values'].shape}, "
                             f"expected ({len(keys)}, {self.row_dim})")
        with self._lock:
            self._reset()
            rec = np.empty((len(keys), self.width), np.float32)
            d, s = self.row_dim, self.state_dim
            rec[:, :d] = arrays["values"]
            rec[:, d:d + s] = arrays["state"]
            rec[:, d + s] = arrays["show"]
            rec[:, d + s + 1] = arrays["click"]
            rec[:, d + s + 2] = np.ascontiguousarray(arrays["last_seen"], np.int32).view(
                np.float32)
            self.disk.write(np.ascontiguousarray(keys, np.int64), rec)
            self.memory.load_candidate_arrays(arrays)
            if "counters" in arrays:
                c = [int(x) for x in arrays["counters"]]
                self.memory.admitted_total, self.memory.evicted_total = c[0], c[1]

    def _reset(self) -> None:
        self.disk.close()
        self.disk = DiskTier(self.disk.path, self.width, mapped_bytes=self._mapped_bytes)
        self._new_memory_tier()
        self._disk_only_evicted = 0
        self._snapshot_dir, self._snapshot_digests = None, {}

    def save_snapshot(self, dst: Path) -> dict[str, str]:
        """Write the store into the empty folder ``dst`` (inside an uncommitted checkpoint);
        returns {file name: sha256}.

        Flushes dirty rows, then copies the slabs changed since the last committed
        snapshot and hard-links the rest from it; the key index and admission state go to
        small safetensors files. Each key's values and optimizer state come from the same
        moment: the pass boundary, with no thread touching the store.
        """
        with self._lock:
            self.flush()
            digests = self.disk.snapshot(dst, self._snapshot_dir, self._snapshot_digests)
            save_numpy(self._store_arrays(), str(dst / STORE_FILE))
            digests[STORE_FILE] = file_sha256(dst / STORE_FILE)
            return digests

    def snapshot_committed(self, path: Path, digests: dict[str, str]) -> None:
        """The snapshot last written now lives, committed, at ``path``: later snapshots
        may hard-link its unchanged slabs."""
        with self._lock:
            self.disk.mark_clean()
            self._snapshot_dir = Path(path)
            self._snapshot_digests = dict(digests)

    def load_snapshot(self, src: Path, digests: dict[str, str] | None = None) -> None:
        """Replace the content by the committed snapshot in ``src``."""
        with self._lock:
            self._reset()
            self.disk.restore(src)
            arrays = load_numpy(str(src / STORE_FILE))
            self.memory.load_candidate_arrays(arrays)
            admitted, evicted, disk_only = (int(x) for x in arrays["counters"])
            self.memory.admitted_total = admitted
            self.memory.evicted_total = evicted - disk_only
            self._disk_only_evicted = disk_only
            self._snapshot_dir = Path(src)
            self._snapshot_digests = dict(digests or {})

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.disk.close()


_M_MMAP_THRESHOLD = -3


@functools.cache
def _return_freed_buffers_to_os() -> None:
    """Pin glibc's mmap threshold at 1 MB. By default it adapts upwards to 32 MB, after
    which freed pass-sized buffers stay in the heap, counted in the resident set, and a
    memory budget is not kept. Elsewhere (not glibc) this is a no-op."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 1 << 20)


def records_to_arrays(keys: np.ndarray, rec: np.ndarray, row_dim: int,
                      state_dim: int) -> dict[str, np.ndarray]:
    d, s = row_dim, state_dim
    return {"keys": keys, "values": np.ascontiguousarray(rec[:, :d]),
            "state": np.ascontiguousarray(rec[:, d:d + s]),
            "show": np.ascontiguousarray(rec[:, d + s]),
            "click": np.ascontiguousarray(rec[:, d + s + 1]),
            "last_seen": np.ascontiguousarray(rec[:, d + s + 2]).view(np.int32)}


def snapshot_arrays(src: Path, row_dim: int, state_dim: int) -> dict[str, np.ndarray]:
    """A tiered snapshot as ``MemoryStore.to_arrays`` arrays (sorted by key), for loading
    into a memory store or exporting."""
    parts = list(read_snapshot_records(Path(src)))
    if parts:
        keys = np.concatenate([k for k, _ in parts])
        rec = np.concatenate([r for _, r in parts])
    else:
        keys = np.empty(0, np.int64)
        rec = np.empty((0, row_dim + state_dim + 3), np.float32)
    order = np.argsort(keys, kind="stable")
    arrays = records_to_arrays(keys[order], rec[order], row_dim, state_dim)
    extra = load_numpy(str(Path(src) / STORE_FILE))
    arrays.update({k: v for k, v in extra.items() if k.startswith("cand_")})
    arrays["counters"] = extra["counters"][:2]
    return arrays


def snapshot_key_count(src: Path) -> int:
    return len(load_numpy(str(Path(src) / "index.safetensors"))["keys"])


