"""The tiered store: hot rows in RAM under a byte budget, every row on disk.

Implements ``EmbeddingStore`` (protocol.py) as ``MemoryStore`` does, so the trainer,
the working set, checkpoints and exports use either unchanged::

    pull(keys)      hot rows: counted in place, pinned      cold rows: one batched disk
                    (memory tier, MemoryStore <= budget)    read (or new, after admission)
                                                            -> the pass's pending rows
    prefetch(next)  disk -> memory tier in a thread while this pass trains, pinned
    push(keys)      hot rows updated in place; pending rows compete by priority (LFU: show
                    count, LRU: last use) for RAM: losers written to disk, once
    end_pass        TTL eviction in both tiers, spill to capacity, unmap slab pages

Invariant: a key lives in the memory tier, the disk tier or both; where both, the memory
copy is authoritative and ``dirty`` says whether the disk copy is behind. ``flush``
writes every dirty row back, after which the disk tier alone holds the whole store --
what checkpoints snapshot.

Compressed rows (precision, variable-length rows) are kept encoded in both tiers: the
memory tier holds a ``CodedRows`` and the disk records the same bytes (``RecordLayout``),
so rows move between the tiers without being re-encoded. With group lasso, ``end_pass``
prunes the pass's rows that became zero from both tiers.

The budget covers all RAM that grows with the store: memory-tier rows and their index,
admission candidates, and the disk tier's key index (32-64 B per key) with its last-seen
mirror (4 B per key). What is left after the indexes sets how many rows stay hot; a store
whose key index alone outgrows the budget is refused with the numbers.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file as save_numpy

from terarec.config import StoreConfig, parse_bytes
from terarec.embedding.admission import is_admission_array
from terarec.embedding.compression import CodedRows, make_row_values
from terarec.embedding.disk import (
    SLAB_BYTES,
    DiskTier,
    RecordLayout,
    iter_snapshot_sorted,
    madvise,
    read_snapshot_rows,
    snapshot_layout,
)
from terarec.embedding.eviction import (
    RowView,
    apply_eviction,
    apply_eviction_streamed,
    row_norms,
    store_bytes,
)
from terarec.embedding.index import KeyIndex, iter_sorted_keys
from terarec.embedding.keyindex import HOT_ENTRY_PEAK_BYTES, MERGE_CHUNK, RunIndex
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.store import (
    CHUNK_ROWS,
    EvictionLog,
    MemoryStore,
    arrays_file,
    init_rows,
    iter_arrays_file,
    store_extras,
)
from terarec.embedding.types import RowBlock, RowChunk, StoreStats, TierStats
from terarec.io import sha256_file
from terarec.kernels import grown

STORE_FILE = "store.safetensors"
# The memory tier's KeyIndex is sized for 1.5x its rows (a pull inserts up to half the
# tier on top of a full one): 3-6 buckets of 16 B per row.
_INDEX_BYTES_PER_ROW = 96


class MemoryBudgetError(ValueError):
    """The store's fixed RAM (key indexes) no longer fits the configured budget."""


class TieredStore(EvictionLog):
    """``EmbeddingStore`` over a memory tier bounded by ``config.memory_budget`` and a
    disk tier under ``path`` (default ``config.disk_path``, else a temporary folder)."""

    saved_format = "tiered"  # what ``save`` writes: a slab snapshot
    prefetches = True  # ``prefetch`` reads disk rows into RAM ahead of their pass
    # Per memory slot, grown with the memory tier (``_ensure_meta``): last use tick, row
    # changed since it was read, a record of it is on disk, kept in RAM for this pass.
    _used: np.ndarray
    _dirty: np.ndarray
    _on_disk: np.ndarray
    _pinned: np.ndarray

    def __init__(self, row_dim: int, optimizer: SparseOptimizer,
                 config: StoreConfig | None = None, seed: int = 0,
                 path: str | Path | None = None, slab_bytes: int = SLAB_BYTES) -> None:
        self.row_dim = row_dim
        self.optimizer = optimizer
        self.config = config or StoreConfig()
        self.seed = seed
        self.state_dim = optimizer.state_dim(row_dim)
        c = self.config
        # Rows are kept as the memory tier's values keep them (fp32, or encoded by
        # class), in RAM and in the disk records alike: see ``RecordLayout``.
        coded = make_row_values(row_dim, c.precision, tuple(c.variable_dims),
                                tuple(c.promote_at), class_precisions=tuple(c.class_precisions),
                                capacity=1)
        self.layout = RecordLayout.for_values(
            coded if coded is not None else np.empty((0, row_dim), np.float32), self.state_dim)
        self.width = self.layout.width
        self._plain = self.layout.plain
        self._variable = len(self.layout.widths) > 1
        self._slot_overhead = coded.overhead_bytes_per_slot if coded is not None else 0
        # Stochastic rounding of rows encoded into records (new rows, write-back).
        self._rng = np.random.default_rng(seed)
        self.budget = (parse_bytes(self.config.memory_budget)
                       if self.config.memory_budget is not None else None)
        if self.config.cache_policy not in ("lfu", "lru"):
            raise ValueError(f"cache_policy {self.config.cache_policy!r}: expected lfu or lru")
        path = path or self.config.disk_path
        if path is None:
            path = tempfile.mkdtemp(prefix="terarec-store-")
            weakref.finalize(self, shutil.rmtree, path, True)
        self._slab_bytes = slab_bytes
        self.disk = self._new_disk_tier(path)
        if self.budget is not None:
            _return_freed_buffers_to_os()
        self._lock = threading.RLock()
        self._tick = 0
        self._new_memory_tier()
        self._disk_only_evicted = 0
        self._counters = dict(spilled=0, loaded=0, prefetched=0, hits=0, misses=0)
        self._prefetch_s = 0.0
        self._pull_disk_s = 0.0
        self._snapshot_dir: Path | None = None
        self._snapshot_digests: dict[str, str] = {}
        # This pass's rows that were not in RAM at pull: (key -> row index, records,
        # on disk), written back or placed in RAM by push.
        self._pending: tuple[KeyIndex, np.ndarray, np.ndarray] | None = None
        # Keys of trained rows written to disk this pass, by push or by a spill of the
        # memory tier: with group lasso, end_pass checks them (and the memory tier's rows
        # of the pass) for rows shrunk to zero.
        self._trained_to_disk: list[np.ndarray] = []
        self._disk_only_pruned = 0

    def _new_disk_tier(self, path: str | Path) -> DiskTier:
        # The disk key index's hot level flushes and forgets unplanned keys once it holds
        # a quarter of the budget's worth of entries at their peak size
        # (HOT_ENTRY_PEAK_BYTES, flush copies included); that quarter is reserved for it
        # (``RunIndex.reserved_bytes``), so a bulk load that fills it does not take the
        # memory tier's share, and admission candidates keep room beside it. A pass's
        # keys kept in RAM save resolving them again at write-back.
        hot = 1 << 20 if self.budget is None else max(
            1 << 10, self.budget // (4 * HOT_ENTRY_PEAK_BYTES))
        return DiskTier(path, self.width, self._slab_bytes, mapped_bytes=self._mapped_bytes,
                        layout=self.layout, key_index=self.config.key_index,
                        buffer_keys=hot)

    @property
    def _mapped_bytes(self) -> int:
        """Slab pages mapped at once: a quarter of the budget, at most 64 MB."""
        return 64 << 20 if self.budget is None else max(1 << 20, min(64 << 20,
                                                                      self.budget // 4))

    # -- memory tier --------------------------------------------------------------------
    @property
    def _row_bytes(self) -> int:
        """RAM per hot row: per slot the record (values as encoded, at the widest class),
        LRU tick, three flags, class and pool position (variable-length rows) and a
        free-list entry, for 9/8 slots per row (rows may sit in slots up to an eighth past
        the capacity before ``_compact``), plus the row's share of the index."""
        slot = 4 * self.width + 8 + 3 + self._slot_overhead + 8
        return -(-9 * slot // 8) + _INDEX_BYTES_PER_ROW

    def _fixed_bytes(self) -> int:
        """RAM that grows with the key count, not the hot set. The disk index counts
        twice, its size after the next doubling, so that a doubling does not push the
        memory tier over budget (during the rehash itself the old table is held too)."""
        m = getattr(self, "memory", None)
        cand = m.candidate_nbytes if m is not None else 0
        return self.disk.fixed_bytes + cand

    def memory_capacity(self) -> int:
        """Rows the memory tier may hold now (the budget less the fixed part)."""
        if self.budget is None:
            return 1 << 62
        free = self.budget - self._fixed_bytes()
        if free < 64 * self._row_bytes:
            m = getattr(self, "memory", None)  # none yet while the first tier is sized
            raise MemoryBudgetError(
                f"memory budget {self.budget:,} B leaves room for no hot rows: the key "
                f"indexes of {len(self.disk):,} keys on disk and "
                f"{m.candidate_count if m is not None else 0:,} admission candidates take "
                f"{self._fixed_bytes():,} B (about 64-100 B per key) and 64 hot rows need "
                f"{64 * self._row_bytes:,} B more; raise --memory-budget")
        return free // self._row_bytes

    def _new_memory_tier(self) -> None:
        """Allocate an empty memory tier at the current capacity. Arrays are np.zeros, so
        rows never used cost no RAM; the index is sized for the capacity up front."""
        cap = self.memory_capacity()
        alloc = int(min(cap, 1 << 16)) if self.budget is None else int(cap)
        try:
            m = MemoryStore(self.row_dim, self.optimizer, self.config, seed=self.seed,
                            capacity=max(alloc + alloc // 2, 16))
        except MemoryError as exc:  # numpy's too-large shapes too (a ValueError there)
            raise self._unallocatable(alloc) from exc
        except ValueError as exc:
            if "maximum allowed dimension" not in str(exc).lower():
                raise
            raise self._unallocatable(alloc) from exc
        self.memory = m
        self._meta_size = 0
        self._ensure_meta()

    def _unallocatable(self, rows: int) -> MemoryBudgetError:
        """The budget's memory tier cannot be allocated: its index is sized for every hot
        row the budget allows up front, so a budget beyond this machine's RAM fails here."""
        return MemoryBudgetError(
            f"--memory-budget {self.config.memory_budget}: its memory tier of {rows:,} hot "
            f"rows has an index of {rows * _INDEX_BYTES_PER_ROW // 2:,} B or more, allocated "
            "up front, and this machine cannot allocate it; lower --memory-budget")

    def _ensure_meta(self) -> None:
        """Per memory slot: last use (LRU), dirty (disk copy behind), on_disk."""
        need = len(self.memory.show)
        if need <= self._meta_size:
            return
        for name, dtype in (("_used", np.int64), ("_dirty", np.bool_), ("_on_disk", np.bool_),
                            ("_pinned", np.bool_)):
            old = getattr(self, name) if self._meta_size else np.zeros(0, dtype)
            setattr(self, name, grown(old, need, double=False))
        self._meta_size = need

    def _records(self, slots: np.ndarray) -> np.ndarray:
        """Disk records of memory rows."""
        return self.memory.records(slots, self.layout)

    def _encode(self, rec: np.ndarray, values: np.ndarray,
                rows: np.ndarray | None = None) -> None:
        """Write ``values`` into records (``rows`` of them), encoded as the store keeps them."""
        if self._plain and rows is None:
            rec[:, :self.row_dim] = values
        else:
            self.layout.set_values(rec, values, rows, rng=self._rng,
                                   stochastic=self.config.stochastic_rounding)

    def _decode(self, rec: np.ndarray) -> np.ndarray:
        """Decoded values of records (a view for fp32 records)."""
        return rec[:, :self.row_dim] if self._plain else self.layout.values(rec)

    def _spill(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Move rows out of the memory tier, writing back those the disk lacks."""
        if self.optimizer.config.group_lasso and len(keys):
            # A row trained this pass and spilled by a later push of it must still be
            # pruned at its end if group lasso zeroed it.
            self._trained_to_disk.append(keys[self._dirty[slots]])
        self._write_back(keys, slots)
        self.memory.index.remove(keys)
        if self._variable:  # their pool positions go to the rows that take their places
            self.memory.coded.release(slots)
        self._dirty[slots] = False
        self._on_disk[slots] = False
        self._pinned[slots] = False
        self._counters["spilled"] += len(keys)

    def _priority(self, slots: np.ndarray) -> np.ndarray:
        """Keep-in-RAM priority of memory rows: show count (LFU) or last use (LRU); pinned
        rows (this pass's, or prefetched for the next) are never chosen to leave."""
        if self.config.cache_policy == "lfu":
            prio = self.memory.show[slots].astype(np.float64)
        else:
            prio = self._used[slots].astype(np.float64)
        prio[self._pinned[slots]] = np.inf
        return prio

    def _make_room(self, need: int) -> None:
        """Spill the lowest-priority unpinned rows until ``need`` more fit."""
        free = self.memory_capacity() - len(self.memory)
        if need <= free:
            return
        keys, slots = self.memory.index.items()
        n_out = min(need - free, len(keys))
        prio = self._priority(slots)
        out = np.argpartition(prio, n_out - 1)[:n_out] if n_out < len(prio) else \
            np.arange(len(prio))
        out = out[np.isfinite(prio[out])]
        self._spill(keys[out], slots[out])

    def _install(self, keys: np.ndarray, rec: np.ndarray, dirty: bool | np.ndarray,
                 on_disk: bool | np.ndarray) -> np.ndarray:
        """Put rows into the memory tier (room already made); returns their slots."""
        slots, _ = self.memory.index.lookup_or_insert(keys)
        self.memory.ensure_rows(self.memory.index.slot_bound)
        self._ensure_meta()
        self.memory.set_records(slots, rec, self.layout)
        self._dirty[slots] = dirty
        self._on_disk[slots] = on_disk
        self._used[slots] = self._tick
        self._pinned[slots] = False
        return slots

    # -- the MemoryStore API ------------------------------------------------------------
    def pull(self, keys: np.ndarray, show: np.ndarray, click: np.ndarray,
             pass_id: int) -> tuple[RowBlock, np.ndarray]:
        """Rows of the unique ``keys`` of a pass (see ``MemoryStore.pull``).

        Hot rows are counted in place and pinned until ``push``; the others are read from
        disk (or created, after admission) in one batch and held as this pass's pending
        rows, so a cold row costs one read here and one write (or a place in RAM) at push.
        """
        keys = np.ascontiguousarray(keys, np.int64)
        with self._lock:
            self._tick += 1
            self._pinned[:] = False
            m, d, s = self.memory, self.row_dim, self.state_dim
            v = self.layout.value_words
            n = len(keys)
            mslots = m.index.lookup(keys)
            hot = mslots >= 0
            self._counters["hits"] += int(hot.sum())
            self._counters["misses"] += n - int(hot.sum())
            cold = np.flatnonzero(~hot)
            ck = keys[cold]
            t0 = time.perf_counter()
            dslots = self.disk.slots(ck)
            on_disk = dslots >= 0
            rec = self.disk.read_slots(dslots, out=np.empty((len(ck), self.width), np.float32))
            self._pull_disk_s += time.perf_counter() - t0
            # Encoded rows are decoded before this pass's shows may move them to a wider
            # class (their records carry no class: it follows from the show count).
            cold_values = None if self._plain else self.layout.values(rec)
            fresh = np.zeros(len(ck), np.bool_)
            admitted = np.ones(n, np.bool_)
            absent = np.flatnonzero(~on_disk)
            if len(absent):
                ak = ck[absent]
                new_keys, earlier_show, earlier_click = m.admit(
                    ak, show[cold[absent]], click[cold[absent]], pass_id)
                ok = np.ones(len(ak), np.bool_) if len(new_keys) == len(ak) else \
                    np.isin(ak, new_keys)
                admitted[cold[absent[~ok]]] = False
                rows = absent[ok]
                init = init_rows(new_keys, d, self.config.init_std, self.seed)
                if cold_values is None:
                    rec[rows, :d] = init
                else:
                    cold_values[rows] = init
                    fresh[rows] = True
                rec[rows, v:v + s] = self.optimizer.init_state(len(new_keys), d)
                rec[rows, v + s] = earlier_show
                rec[rows, v + s + 1] = earlier_click
                m.admitted_total += len(new_keys)
            keep = admitted[cold]
            ck, rec, on_disk, cold = ck[keep], rec[keep], on_disk[keep], cold[keep]
            old_show = rec[:, v + s].copy() if self._variable else None
            rec[:, v + s] += show[cold]
            rec[:, v + s + 1] += click[cold]
            rec[:, v + s + 2] = np.full(len(ck), pass_id, np.int32).view(np.float32)
            if cold_values is not None:
                cold_values = self._encode_pulled(rec, cold_values[keep], fresh[keep], old_show)
            self._pending = (KeyIndex.from_items(ck, np.arange(len(ck), dtype=np.int64)),
                             rec, on_disk)
            hs = mslots[hot]
            m.show[hs] += show[hot]
            m.click[hs] += click[hot]
            m.last_seen[hs] = pass_id
            self._dirty[hs] = True
            self._used[hs] = self._tick
            self._pinned[hs] = True
            values = np.empty((n, d), np.float32)
            state = np.empty((n, s), np.float32)
            values[hot], state[hot] = m.values[hs], m.state[hs]  # as MemoryStore: before
            values[cold] = rec[:, :d] if cold_values is None else cold_values  # promotion
            state[cold] = rec[:, v:v + s]
            block = RowBlock(values, state)
            if self._variable:
                m.promote(hs)
                block.widths = np.empty(n, np.int32)
                block.widths[hot] = m.coded.widths_of(hs)
                block.widths[cold] = self.layout.widths_of(rec)
            if admitted.all():
                return block, admitted
            return RowBlock(values[admitted], state[admitted], None if block.widths is None
                            else block.widths[admitted]), admitted

    def _encode_pulled(self, rec: np.ndarray, values: np.ndarray, fresh: np.ndarray,
                       old_show: np.ndarray | None) -> np.ndarray:
        """Encode this pull's new rows into their records, at the class of their first
        shows, and return them as stored (as ``MemoryStore`` creates rows); re-encode rows
        whose shows now reach a wider class there, their decoded values unchanged (zeros
        in the new columns). Returns the decoded values the pass trains on."""
        redo = fresh.copy()
        if old_show is not None:
            col = self.layout.show_col
            redo |= self.layout.classes(old_show) != self.layout.classes(rec[:, col])
        rows = np.flatnonzero(redo)
        if len(rows):
            self._encode(rec, values[rows], rows)
        rows = np.flatnonzero(fresh)
        if len(rows):
            values[rows] = self.layout.values(rec[rows])
        return values

    def push(self, keys: np.ndarray, block: RowBlock) -> None:
        """Write back trained rows: hot ones in place; the pass's pending rows compete by
        priority with the memory tier's for its places, and the losers go to disk."""
        keys = np.ascontiguousarray(keys, np.int64)
        with self._lock:
            m, v, s = self.memory, self.layout.value_words, self.state_dim
            mslots = m.index.lookup(keys)
            hot = mslots >= 0
            hs = mslots[hot]
            m.values[hs] = block.values[hot]
            m.state[hs] = block.state[hot]
            self._dirty[hs] = True
            self._pinned[hs] = False
            rest = np.flatnonzero(~hot)
            if not len(rest):
                return
            rk = keys[rest]
            if self._pending is not None:
                index, pending, pending_on_disk = self._pending
                p = index.lookup(rk)
            else:
                p = np.full(len(rk), -1, np.int64)
            if (p < 0).any():  # pushed without a pull this pass: rows that live on disk
                cold = p < 0
                rec, found = self.disk.read(rk[cold])
                if not found.all():
                    raise KeyError(f"{int((~found).sum())} pushed keys are not in the store")
                self._encode(rec, block.values[rest[cold]])
                rec[:, v:v + s] = block.state[rest[cold]]
                self._write_pushed(rk[cold], rec)
                rk, rest, p = rk[~cold], rest[~cold], p[~cold]
            if len(rk):
                same_order = len(p) == len(pending) and (p == np.arange(len(p))).all()
                rec = pending if same_order else pending[p]
                self._encode(rec, block.values[rest])
                rec[:, v:v + s] = block.state[rest]
                self._place(rk, rec, pending_on_disk[p])
            self._pending = None

    def _place(self, keys: np.ndarray, rec: np.ndarray, on_disk: np.ndarray) -> None:
        """Keep the ``cap`` highest-priority rows of memory tier + ``keys`` in RAM; spill
        the memory rows that lose, write the new rows that lose straight to disk."""
        cap = self.memory_capacity()
        mk, ms = self.memory.index.items()
        n_out = len(mk) + len(keys) - cap
        stay = np.ones(len(keys), np.bool_)
        if n_out > 0:
            col = self.layout.show_col
            prio_new = rec[:, col].astype(np.float64) if self.config.cache_policy == "lfu" \
                else np.full(len(keys), float(self._tick))
            prio = np.concatenate([self._priority(ms), prio_new])
            out = np.argpartition(prio, n_out - 1)[:n_out] if n_out < len(prio) else \
                np.arange(len(prio))
            out = out[np.isfinite(prio[out])]
            out_mem = out[out < len(mk)]
            stay[out[out >= len(mk)] - len(mk)] = False
            self._spill(mk[out_mem], ms[out_mem])
            self._write_pushed(keys[~stay], rec[~stay])
        if stay.any():
            self._install(keys[stay], rec[stay], True, on_disk[stay])

    def _write_pushed(self, keys: np.ndarray, rec: np.ndarray) -> None:
        """Write trained rows straight to disk (remembered for group-lasso pruning)."""
        self.disk.write(keys, rec)
        if self.optimizer.config.group_lasso and len(keys):
            self._trained_to_disk.append(keys.copy())

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Read-only values of ``keys`` (zero rows where absent) and the found mask; the
        memory tier is left as it is (scoring does not displace training's hot rows)."""
        keys = np.ascontiguousarray(keys, np.int64)
        with self._lock:
            values, found = self.memory.lookup(keys)
            cold = np.flatnonzero(~found)
            if len(cold):
                rec, on_disk = self.disk.read(keys[cold])
                values[cold[on_disk]] = self._decode(rec[on_disk])
                found[cold[on_disk]] = True
            return values, found

    def prefetch(self, keys: np.ndarray) -> int:
        """Read the disk rows of ``keys`` (the next pass's) into the memory tier, pinned
        until that pass pulls them, as many as the unpinned part of the tier holds; run in
        a thread while the current pass trains. Returns the number of rows read."""
        keys = np.ascontiguousarray(keys, np.int64)
        with self._lock:
            t0 = time.perf_counter()
            keys = keys[self.memory.index.lookup(keys) < 0]
            if self._pending is not None:  # their newer rows arrive with push
                keys = keys[self._pending[0].lookup(keys) < 0]
            # The whole next pass is resolved here, off the training path (with the disk
            # key index, its keys stay in the index's hot level until that pass ends).
            dslots = self.disk.plan(keys)
            keys, dslots = keys[dslots >= 0], dslots[dslots >= 0]
            n = min(len(keys), max(0, self.memory_capacity() - int(self._pinned.sum())))
            keys, dslots = keys[:n], dslots[:n]
            self._make_room(n)
            n = min(n, max(0, self.memory_capacity() - len(self.memory)))
            if n:
                slots = self._install(keys[:n], self.disk.read_slots(dslots[:n]), False, True)
                self._pinned[slots] = True
            self._counters["prefetched"] += n
            self._counters["loaded"] += n
            self._prefetch_s += time.perf_counter() - t0
            return n

    def end_pass(self, pass_id: int) -> int:
        """Eviction across both tiers (group-lasso pruning, then the policies of
        embedding/eviction.py), then fit the memory tier to the budget again and unmap
        the slab pages this pass touched."""
        with self._lock:
            evicted = self._prune_zero_rows(pass_id) if self.optimizer.config.group_lasso \
                else 0
            self._trained_to_disk = []
            policies, runs = self.memory.eviction, self.disk.runs
            if runs is not None:
                evicted += apply_eviction_streamed(
                    policies, lambda: self._row_parts(runs),
                    lambda: (len(self), store_bytes(self)), self.evict, pass_id)
            else:
                evicted += apply_eviction(policies, self.row_view, self.evict, pass_id)
            ttl = self.config.evict_after_passes
            if ttl is not None:
                self.memory.expire_candidates(pass_id - ttl)
            self._fit_budget()
            self.disk.end_pass()
            return evicted

    def _row_parts(self, runs: RunIndex) -> Iterator[RowView]:
        """The rows of both tiers for streamed eviction, a part at a time: hot rows (their
        last-seen pass, show and norm from RAM, authoritative for them), then each key
        range of the disk key index's runs less the hot keys, shows and norms read from
        the records only when a policy asks."""
        m = self.memory
        mkeys, mslots = m.index.items()
        step = MERGE_CHUNK
        for lo in range(0, len(mkeys), step):
            keys, slots = mkeys[lo:lo + step], mslots[lo:lo + step]
            yield self._part(keys, m.last_seen[slots],
                             functools.partial(m.show.__getitem__, slots),
                             functools.partial(m.norms, slots))
        for keys, slots, seen in runs.iter_items(step):
            cold = m.index.lookup(keys) < 0
            if cold.any():
                dslots = slots[cold]
                yield self._part(keys[cold], seen[cold],
                                 functools.partial(self._disk_shows, dslots),
                                 functools.partial(self._disk_norms, dslots))
        self.disk.release_pages()

    @staticmethod
    def _part(keys: np.ndarray, seen: np.ndarray, show: Callable[[], np.ndarray],
              norm: Callable[[], np.ndarray]) -> RowView:
        return RowView(keys, seen, show, norm, 0.0)  # bytes per row: the whole store's

    def _disk_shows(self, slots: np.ndarray) -> np.ndarray:
        return self.disk.read_slots(slots)[:, self.layout.show_col].copy()

    def _disk_norms(self, slots: np.ndarray) -> np.ndarray:
        return row_norms(self._decode(self.disk.read_slots(slots)))

    def row_view(self) -> RowView:
        """Every row of both tiers for the eviction policies: hot rows, then rows only on
        disk. Last-seen passes come from RAM (the disk tier's mirror); shows and norms of
        disk-only rows are read when a policy asks, a chunk of records at a time."""
        m = self.memory
        mkeys, mslots = m.index.items()
        dkeys, dslots, dseen = self.disk.seen_items()
        cold = m.index.lookup(dkeys) < 0
        dkeys, dslots, dseen = dkeys[cold], dslots[cold], dseen[cold]

        def disk_column(column: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
            out = np.empty(len(dslots), np.float32)
            step = self.disk._chunk_rows
            for lo in range(0, len(dslots), step):
                out[lo:lo + step] = column(self.disk.read_slots(dslots[lo:lo + step]))
            self.disk.release_pages()
            return out

        col = self.layout.show_col
        return RowView(
            np.concatenate([mkeys, dkeys]),
            np.concatenate([m.last_seen[mslots], dseen]),
            lambda: np.concatenate([m.show[mslots], disk_column(lambda rec: rec[:, col])]),
            lambda: np.concatenate([m.norms(mslots),
                                    disk_column(lambda rec: row_norms(self._decode(rec)))]),
            store_bytes(self) / max(len(mkeys) + len(dkeys), 1))

    def _prune_zero_rows(self, pass_id: int) -> int:
        """Drop the keys whose rows group lasso shrank to exactly zero in this pass, from
        both tiers: the pass's rows are in the memory tier or were written to disk by
        push or a spill (``_trained_to_disk``), so no other disk row needs reading."""
        m = self.memory
        mkeys, mslots = m.index.items()
        seen = m.last_seen[mslots] == pass_id
        mkeys, mslots = mkeys[seen], mslots[seen]
        mzero = mkeys[~(m.values[mslots] != 0).any(axis=1)]
        pruned = m.evict(mzero)
        m.pruned_total += pruned
        self.disk.remove(mzero)
        if self._trained_to_disk:
            dkeys = np.unique(np.concatenate(self._trained_to_disk))
            dkeys = dkeys[m.index.lookup(dkeys) < 0]
            rec, found = self.disk.read(dkeys)
            seen = rec[:, -1].view(np.int32) == pass_id  # not rows pushed without a pull
            zero = found & seen & ~(self._decode(rec) != 0).any(axis=1)
            dzero = dkeys[zero]
            self.disk.remove(dzero)
            self._disk_only_evicted += len(dzero)
            self._disk_only_pruned += len(dzero)
            pruned += len(dzero)
            mzero = np.concatenate([mzero, dzero])
        self._log_evicted(mzero)
        return pruned

    def _fit_budget(self) -> None:
        """Spill down to the capacity; if the key index grew enough that rows sit in slots
        past it, compact the hot rows into the lowest slots and release the rest."""
        if self.budget is None:
            return
        for _ in range(3):  # spilling grows the disk index, which lowers the capacity
            self._make_room(0)
            if len(self.memory) <= self.memory_capacity():
                break
        cap = self.memory_capacity()
        if self.memory.index.slot_bound > cap + cap // 8:
            self._compact(cap)

    def _compact(self, cap: int) -> None:
        """Move the hot rows to slots 0..n-1 (in slot order, chunk by chunk: a row only
        moves down, onto a slot already vacated) and hand the pages past them back to the
        OS, so the tier's RAM follows its shrunken capacity without a second copy."""
        m = self.memory
        keys, slots = m.index.items()
        order = np.argsort(slots, kind="stable")
        keys, slots = keys[order], slots[order]
        target = np.arange(len(slots), dtype=np.int64)
        moved = np.flatnonzero(slots != target)
        coded = isinstance(m.values, CodedRows)
        # Encoded rows move as bytes (one class: codes by slot), or by class and pool
        # position (several classes: the pools are repacked after).
        values = m.coded.slot_arrays() if coded else [m.values]
        arrays = [*values, m.state, m.show, m.click, m.last_seen, self._used, self._dirty,
                  self._on_disk, self._pinned]
        for start in range(0, len(moved), 8192):
            sel = moved[start:start + 8192]
            for a in arrays:
                a[target[sel]] = a[slots[sel]]
        m.index = KeyIndex(16)  # the old table goes before the new one is allocated
        index = KeyIndex(cap + cap // 2)
        index.lookup_or_insert(keys)  # slots 0..n-1 in this order: no free slots yet
        m.index = index
        if coded and m.coded.variable:
            m.coded.truncate(len(keys))
            arrays = arrays[len(values):]
        for a in arrays:
            _release_rows(a, len(keys))

    def evict(self, keys: np.ndarray) -> int:
        keys = np.ascontiguousarray(keys, np.int64)
        with self._lock:
            inmem = self.memory.index.lookup(keys) >= 0
            n = self.memory.evict(keys)
            on_disk = self.disk.remove(keys)
            disk_only = int((on_disk & ~inmem).sum())
            self._disk_only_evicted += disk_only
            self._log_evicted(keys[inmem | on_disk])
            return n + disk_only

    # -- change tracking for incremental export (as MemoryStore) ------------------------
    def _disk_seen_since(self, pass_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, slots) of the disk tier last seen in pass ``pass_id`` or later; over a
        disk key index one streaming scan of its runs, holding a key range at a time."""
        runs = self.disk.runs
        if runs is None:
            keys, slots, seen = self.disk.seen_items()
            recent = seen >= pass_id
            return keys[recent], slots[recent]
        keys_found, slots_found = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
        for keys, slots, seen in runs.iter_items():
            recent = seen >= pass_id
            keys_found.append(keys[recent])
            slots_found.append(slots[recent])
        return np.concatenate(keys_found), np.concatenate(slots_found)

    def changed_since(self, pass_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Sorted keys (and values) of rows touched in pass ``pass_id`` or later, from both
        tiers: the disk tier's last-seen mirror, or its key index's runs, finds them without
        reading the row files."""
        with self._lock:
            m = self.memory
            mkeys, mslots = m.index.items()
            recent = m.last_seen[mslots] >= pass_id
            mkeys, mvalues = mkeys[recent], m.values[mslots[recent]]
            dkeys, dslots = self._disk_seen_since(pass_id)
            cold = m.index.lookup(dkeys) < 0
            dkeys, dslots = dkeys[cold], dslots[cold]
            dvalues = self._decode(self.disk.read_slots(dslots))
            keys = np.concatenate([mkeys, dkeys])
            values = np.concatenate([mvalues, dvalues])
            order = np.argsort(keys, kind="stable")
            return keys[order], values[order]

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
        on_disk = self.memory.index.count_marked(self._on_disk)  # no negated copy
        return len(self.disk) + len(self.memory) - on_disk

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

    @property
    def value_bytes(self) -> int:
        """Bytes of the rows' values as stored (codes + row scale/bias when encoded): hot
        rows at their class's size, rows only on disk at the record's value area (fixed
        size: the widest class's, padded to whole words)."""
        return self._value_bytes(len(self))

    def _value_bytes(self, keys: int) -> int:
        disk_only = keys - len(self.memory)
        return self.memory.value_bytes + disk_only * 4 * self.layout.value_words

    def stats(self) -> StoreStats:
        keys = len(self)  # one table scan for both figures
        return StoreStats(keys=keys, candidates=self.memory.candidate_count,
                          admitted=self.admitted_total, evicted=self.evicted_total,
                          bytes=self.nbytes, value_bytes=self._value_bytes(keys),
                          pruned=self.memory.pruned_total + self._disk_only_pruned,
                          rejected=self.memory.rejected_total,
                          admission_bytes=self.memory.candidate_nbytes)

    def tier_stats(self) -> TierStats:
        d = self.disk.stats()
        return TierStats(
            memory_keys=len(self.memory),
            memory_capacity=int(min(self.memory_capacity(), 1 << 62)),
            memory_bytes=self.memory.nbytes, disk_keys=d.keys,
            disk_allocated_bytes=d.allocated_bytes,
            index_bytes=d.index_bytes, disk_rows_read=d.rows_read,
            disk_rows_written=d.rows_written, disk_read_s=d.read_s, disk_write_s=d.write_s,
            prefetch_s=self._prefetch_s, pull_disk_s=self._pull_disk_s, **self._counters)

    # -- persistence --------------------------------------------------------------------
    def _store_arrays(self) -> dict[str, np.ndarray]:
        return {**self.memory.candidate_arrays(),
                "rejected": np.array([self.memory.rejected_total], np.int64),
                "counters": np.array([self.admitted_total, self.evicted_total,
                                      self._disk_only_evicted], np.int64),
                "pruned": np.array([self.memory.pruned_total, self._disk_only_pruned],
                                   np.int64)}

    def iter_sorted(self, chunk_rows: int = CHUNK_ROWS) -> Iterator[RowChunk]:
        """Every row in increasing key order, at most ``chunk_rows`` rows per chunk, from
        both tiers (a hot row's memory copy, else its disk record), decoded to fp32.

        RAM: one chunk of rows plus one key range (``iter_sorted_keys``); the slab pages a
        chunk maps are unmapped after it. Read-only: nothing is flushed or moved between
        the tiers. The store must not change until the iteration ends.
        """
        chunk_rows = max(1, int(chunk_rows))
        for keys, dslots in self._sorted_slots():
            for lo in range(0, len(keys), chunk_rows):
                k = keys[lo:lo + chunk_rows]
                with self._lock:
                    mslots = self.memory.index.lookup(k)
                    hot = mslots >= 0
                    # Disk records of the cold rows (zeros at the hot ones), read in place.
                    rec = self.disk.read_slots(np.where(hot, -1, dslots[lo:lo + chunk_rows]))
                    if hot.any():
                        rec[hot] = self._records(mslots[hot])
                yield RowChunk(k, **self.layout.decode(rec))

    def _sorted_slots(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every key of both tiers in increasing order, in parts, with its disk slot (-1
        for rows only in RAM). The disk key index streams its runs in key order; the RAM
        index is cut into key ranges (``iter_sorted_keys``)."""
        runs = self.disk.runs
        if runs is None:
            for keys in iter_sorted_keys([self.memory.index, self.disk.index]):
                yield keys, self.disk.slots(keys)
            return
        mkeys = np.sort(self.memory.index.items()[0])  # the hot rows: bounded by the budget
        lo = 0
        for dkeys, dslots, _ in runs.iter_items():
            hi = int(np.searchsorted(mkeys, dkeys[-1], side="right"))
            extra = mkeys[lo:hi][~np.isin(mkeys[lo:hi], dkeys, assume_unique=True)]
            lo = hi
            if len(extra):
                keys = np.concatenate([dkeys, extra])
                order = np.argsort(keys, kind="stable")
                yield keys[order], np.concatenate([dslots, np.full(len(extra), -1)])[order]
            else:
                yield dkeys, dslots
        if lo < len(mkeys):
            yield mkeys[lo:], np.full(len(mkeys) - lo, -1, np.int64)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The whole store sorted by key, in RAM: for small tables and tests; checkpoints
        and exports stream ``save`` / ``iter_sorted`` instead."""
        chunks = [c.columns() for c in self.iter_sorted(1 << 20)]
        if chunks:
            arrays = {name: np.concatenate([c[name] for c in chunks]) for name in chunks[0]}
        else:
            arrays = {"keys": np.empty(0, np.int64), **self.layout.decode(
                np.empty((0, self.width), np.float32))}
        arrays.update(self._store_arrays())
        arrays["counters"] = arrays["counters"][:2]  # MemoryStore's form
        arrays["pruned"] = arrays["pruned"].sum(keepdims=True)
        return arrays

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace the content by ``MemoryStore.to_arrays``-style arrays (written to disk)."""
        self.load_rows([RowChunk(*(arrays[name] for name in (
            "keys", "values", "state", "show", "click", "last_seen")))], arrays)

    def load_rows(self, chunks: Iterable[RowChunk], extras: dict[str, np.ndarray]) -> None:
        """Replace the content by ``chunks`` (rows of distinct keys, each written to the
        disk tier as it comes: one chunk in RAM) and the store-wide ``extras``."""
        with self._lock:
            self._reset()
            for chunk in chunks:
                if len(chunk):
                    self._write_rows(chunk)
            self.disk.end_pass()  # the disk key index flushes what was written
            self._load_extras(extras)

    def _write_rows(self, chunk: RowChunk) -> None:
        """Write decoded rows to the disk tier, encoded as this store keeps them."""
        if chunk.values.shape != (len(chunk), self.row_dim):
            raise ValueError(f"stored rows have shape {chunk.values.shape}, "
                             f"expected ({len(chunk)}, {self.row_dim})")
        rec = self.layout.encode(chunk.columns(), stochastic=self.config.stochastic_rounding,
                                 rng=self._rng)
        self.disk.write(np.ascontiguousarray(chunk.keys, np.int64), rec)

    def _load_extras(self, arrays: dict[str, np.ndarray]) -> None:
        """Admission candidates and counters from ``to_arrays``-style arrays."""
        self.memory.load_candidate_arrays(arrays)
        if "counters" in arrays:
            c = [int(x) for x in arrays["counters"]]
            self.memory.admitted_total, self.memory.evicted_total = c[0], c[1]
        self.memory.pruned_total = int(arrays["pruned"].sum()) if "pruned" in arrays else 0

    # -- the EmbeddingStore persistence API ---------------------------------------------
    def save(self, dst: Path) -> dict[str, str]:
        """Write the store into the new folder ``dst`` (``save_snapshot``)."""
        return self.save_snapshot(Path(dst))

    def committed(self, path: Path, digests: dict[str, str]) -> None:
        """The folder last saved is now committed at ``path`` (``snapshot_committed``)."""
        self.snapshot_committed(Path(path), digests)

    def load(self, src: Path, digests: dict[str, str] | None = None) -> None:
        """Replace the content by what a store saved at ``src``: a slab snapshot, or the
        arrays form of a memory store (streamed to disk a chunk at a time)."""
        path = arrays_file(src)
        if path is None:
            self.load_snapshot(Path(src), digests)
            return
        with self._lock:
            self._reset()
            for chunk in iter_arrays_file(path, self.disk._chunk_rows):
                self._write_rows(chunk)
            self.disk.end_pass()
            self._load_extras(store_extras(path))

    def _reset(self) -> None:
        self.disk.release()
        self.disk = self._new_disk_tier(self.disk.path)
        del self.memory  # freed before its successor is allocated: not two at the peak
        self._new_memory_tier()
        self._disk_only_evicted = 0
        self._disk_only_pruned = 0
        self._trained_to_disk = []
        self._snapshot_dir, self._snapshot_digests = None, {}
        self._pending = None

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
            digests[STORE_FILE] = sha256_file(dst / STORE_FILE)
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
            if "pruned" in arrays:  # snapshots from before pruned keys were counted lack it
                self.memory.pruned_total, self._disk_only_pruned = (
                    int(x) for x in arrays["pruned"])
            self._snapshot_dir = Path(src)
            self._snapshot_digests = dict(digests or {})

    def close(self) -> None:
        """Unmap the slabs and unlock the store folder."""
        with contextlib.suppress(Exception):
            self.disk.release()


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 16 << 20


def _release_rows(arr: np.ndarray, start: int) -> None:
    """Return the whole pages of ``arr``'s rows ``start:`` to the OS; they read as zeros
    again (as after np.zeros), and cost RAM only once written."""
    if arr.ndim == 0 or start >= len(arr):
        return
    page = mmap.PAGESIZE
    lo = arr.ctypes.data + start * arr.strides[0]
    hi = arr.ctypes.data + arr.nbytes
    lo, hi = -(-lo // page) * page, hi // page * page
    if hi > lo:
        madvise(lo, hi - lo, mmap.MADV_DONTNEED)


@functools.cache
def _return_freed_buffers_to_os() -> None:
    """Pin glibc's mmap and trim thresholds at 16 MB. By default the
    mmap threshold adapts upwards to 32 MB and the trim threshold to twice that, after
    which freed pass-sized buffers stay in the heap, counted in the resident set, and a
    memory budget is not kept. Pinning lower costs speed instead: at 1 MB every
    step-sized tensor (activations, gathered rows) was mapped fresh and page-faulted,
    which measured 2x slower training steps. Elsewhere (not glibc) this is a no-op."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, _MMAP_THRESHOLD_BYTES)


def snapshot_arrays(src: Path, row_dim: int, state_dim: int) -> dict[str, np.ndarray]:
    """A tiered snapshot as ``MemoryStore.to_arrays`` arrays (sorted by key, values
    decoded to fp32), for loading into a memory store or exporting."""
    parts = list(read_snapshot_rows(Path(src), row_dim, state_dim))
    if parts:
        keys = np.concatenate([k for k, _ in parts])
        cols = {name: np.concatenate([c[name] for _, c in parts]) for name in parts[0][1]}
    else:
        keys = np.empty(0, np.int64)
        cols = {"values": np.empty((0, row_dim), np.float32),
                "state": np.empty((0, state_dim), np.float32),
                "show": np.empty(0, np.float32), "click": np.empty(0, np.float32),
                "last_seen": np.empty(0, np.int32)}
    order = np.argsort(keys, kind="stable")
    arrays = {"keys": keys[order], **{name: c[order] for name, c in cols.items()}}
    arrays.update(saved_extras(src))
    return arrays


def saved_extras(src: Path) -> dict[str, np.ndarray]:
    """The store-wide arrays (admission candidates, ``counters``, ``pruned``) of what a
    store saved at ``src``, in ``to_arrays`` form, without reading its rows."""
    path = arrays_file(src)
    if path is not None:
        return store_extras(path)
    extra = load_numpy(str(Path(src) / STORE_FILE))
    arrays = {k: v for k, v in extra.items() if is_admission_array(k) or k == "rejected"}
    arrays["counters"] = extra["counters"][:2]
    if "pruned" in extra:
        arrays["pruned"] = extra["pruned"].sum(keepdims=True)
    return arrays


def iter_saved(src: Path, chunk_rows: int = CHUNK_ROWS, row_dim: int | None = None,
               state_dim: int | None = None) -> Iterator[RowChunk]:
    """Key-ordered RowChunks (values decoded to fp32) of what a store saved at ``src``
    (a ``save`` folder of either store, or an arrays-form file), read a chunk at a time
    without building a store: what exports of a checkpoint stream."""
    path = arrays_file(src)
    if path is not None:
        yield from iter_arrays_file(path, chunk_rows)
        return
    layout = snapshot_layout(Path(src), row_dim, state_dim)
    for keys, rec in iter_snapshot_sorted(Path(src), chunk_rows):
        yield RowChunk(keys, **layout.decode(rec))



