"""Two-level key index: every key on disk in sorted immutable runs, RAM for the keys in play.

Why: the disk tier's in-RAM ``KeyIndex`` plus its last-seen mirror cost 36-68 B per key
whether the key is hot or was last seen months ago; at 10^9 keys that is 36-68 GB before a
row is cached. Key frequencies are Zipf-like, so most of that RAM indexes rows no pass
touches. Here a key costs RAM only while it is in play::

    level 1 (RAM)   hot: KeyIndex key -> entry (slot, last_seen, dirty, generation)
                    the keys of this pass, of the planned next pass (``plan``), and the
                    entries changed since the last flush
    level 2 (disk)  runs: run-NNNNNN.{keys,slots,seen}, sorted by key, immutable
                    per run in RAM: a fence key per 512 keys (0.016 B/key) and a
                    register-blocked Bloom filter (8 bits/key, 4 bits in one word)

A lookup asks the hot level, then resolves the misses as one sorted batch against the
runs, newest first: a merge of the sorted queries with each run's fences, one binary
search inside a 4 KB block per query that passes the Bloom filter (sequential reads, no
per-key random I/O beyond the block). Resolved keys (and known-absent ones) enter the hot
level for the rest of the pass. Changed entries are flushed as a new run at pass end (or
when the hot level passes ``buffer_keys``); runs are merged size-tiered (the newest runs
are merged into the one before them while it is at most twice their size), so there are
O(log n) runs and each entry is rewritten O(log n) times. A merge keeps the newest entry
of each key and drops removed keys (tombstones: slot -1) once it reaches the oldest run.
Merges run in a background thread (``background=True``): their inputs are immutable, so
lookups go on against them and the merged run replaces them in one step when written;
only that swap waits for a resolution in flight. Evicting keys (any policy) writes
tombstones in the next flushed run, never a merge of its own.

The last-seen pass lives with the key in the runs (no RAM mirror). Checkpoints list the
runs in ``index.safetensors`` and hard-link their files: runs are never written again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import numba
import numpy as np

from terarec.embedding.index import KeyIndex
from terarec.io import NotWritableError
from terarec.kernels import GOLDEN_GAMMA, grown, splitmix64

RUN_BLOCK = 512  # keys per fence: one 4 KB page of keys per binary search
BLOOM_BITS_PER_KEY = 8
MERGE_RATIO = 2
BUFFER_KEYS = 1 << 20
# RAM a hot-level entry can take at its peak: the KeyIndex bucket share (32-64 B, plus the
# old table during a doubling: up to 112 B with the items it reinserts) or, at a flush,
# the steady 32-64 B plus the flush's sorted copies (~72 B: keys, positions, argsort,
# gathered slots and last-seen), and the four per-entry columns (17 B, grown by doubling:
# up to 34 B). Measured at 10^7 keys: a bulk load with the hot level at its limit held
# about 124 B per entry above the rest of the process.
HOT_ENTRY_PEAK_BYTES = 168
MERGE_CHUNK = 1 << 20
MAPPED_BYTES = 64 << 20  # run pages a resolution maps at once
_COLUMNS = (("keys", np.int64), ("slots", np.int64), ("seen", np.int32))
_GAMMA = np.uint64(GOLDEN_GAMMA)


def run_files(name: str) -> list[str]:
    """The file names of run ``name``: one per column."""
    return [f"{name}.{c}" for c, _ in _COLUMNS]


@numba.njit(inline="always")
def _bloom_hash(key):
    return splitmix64(np.uint64(key) + _GAMMA)


@numba.njit(inline="always")
def _bloom_word(h, n_words):
    return ((h >> np.uint64(32)) * np.uint64(n_words)) >> np.uint64(32)


@numba.njit(inline="always")
def _bloom_mask(h):
    one = np.uint64(1)
    m63 = np.uint64(63)
    return ((one << (h & m63)) | (one << ((h >> np.uint64(6)) & m63))
            | (one << ((h >> np.uint64(12)) & m63)) | (one << ((h >> np.uint64(18)) & m63)))


@numba.njit(nogil=True, cache=True)
def _bloom_build(keys, words):
    n_words = words.shape[0]
    for i in range(keys.shape[0]):
        h = _bloom_hash(keys[i])
        words[_bloom_word(h, n_words)] |= _bloom_mask(h)


@numba.njit(nogil=True, cache=True)
def _probe(run_keys, fences, block, bloom, queries, todo, out_pos, f0):
    """For the sorted ``queries[todo[i]]``: their position in the run, else -1. A merge
    with the fence keys (from fence ``f0``), a Bloom test and a binary search within one
    block each."""
    n = run_keys.shape[0]
    n_fences = fences.shape[0]
    n_words = bloom.shape[0]
    f = f0
    for t in range(todo.shape[0]):
        i = todo[t]
        k = queries[i]
        out_pos[t] = -1
        if n_fences == 0 or k < fences[0]:
            continue
        h = _bloom_hash(k)
        m = _bloom_mask(h)
        if (bloom[_bloom_word(h, n_words)] & m) != m:
            continue
        while f + 1 < n_fences and fences[f + 1] <= k:
            f += 1
        lo = f * block
        hi = min(lo + block, n)
        while lo < hi:
            mid = (lo + hi) >> 1
            if run_keys[mid] < k:
                lo = mid + 1
            else:
                hi = mid
        if lo < n and run_keys[lo] == k:
            out_pos[t] = lo


@numba.njit(nogil=True, cache=True)
def _take(src, pos, out, todo):
    for t in range(pos.shape[0]):
        if pos[t] >= 0:
            out[todo[t]] = src[pos[t]]


def _release(mm: np.ndarray) -> None:
    """Unmap the pages of a run file this process touched (they stay in the page cache):
    mapped pages count in the resident set."""
    m = getattr(mm, "_mmap", None)
    if m is not None:
        with contextlib.suppress(ValueError, OSError):
            m.madvise(mmap.MADV_DONTNEED)


class Run:
    """One immutable sorted run: three column files and its in-RAM directory."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder, self.name = Path(folder), name
        self.n = os.path.getsize(self.path("keys")) // 8
        self.cols = {c: (np.memmap(self.path(c), dt, "r", shape=(self.n,)) if self.n else
                         np.empty(0, dt)) for c, dt in _COLUMNS}
        keys = self.cols["keys"]
        self.fences = np.empty(-(-self.n // RUN_BLOCK), np.int64)
        self.bloom = np.zeros(max(1, -(-self.n * BLOOM_BITS_PER_KEY // 64)), np.uint64)
        step = RUN_BLOCK * 16384  # 64 MB of keys mapped at a time
        for lo in range(0, self.n, step):
            part = keys[lo:lo + step]
            self.fences[lo // RUN_BLOCK:(lo + len(part) - 1) // RUN_BLOCK + 1] = \
                part[::RUN_BLOCK]
            _bloom_build(part, self.bloom)
            self.release()

    def path(self, column: str) -> Path:
        return self.folder / f"{self.name}.{column}"

    @property
    def files(self) -> list[str]:
        return run_files(self.name)

    @property
    def nbytes(self) -> int:
        """RAM of the directory: fences and Bloom filter."""
        return self.fences.nbytes + self.bloom.nbytes

    def release(self) -> None:
        for a in self.cols.values():
            _release(a)

    def close(self) -> None:
        for a in self.cols.values():
            m = getattr(a, "_mmap", None)
            if m is not None:
                m.close()
        self.cols = {}

    def range(self, lo: int | None, hi: int | None) -> tuple[int, int]:
        """Positions of keys in [lo, hi) (None: unbounded)."""
        keys = self.cols["keys"]
        a = 0 if lo is None else int(np.searchsorted(keys, lo))
        b = self.n if hi is None else int(np.searchsorted(keys, hi))
        return a, b


class _RunWriter:
    """Appends sorted (key, slot, seen) chunks to a new run's three files."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder, self.name = folder, name
        self.files = {c: open(folder / f"{name}.{c}", "wb") for c, _ in _COLUMNS}  # noqa: SIM115

    def append(self, keys: np.ndarray, slots: np.ndarray, seen: np.ndarray) -> None:
        with self._no_space():
            for c, a in (("keys", keys), ("slots", slots), ("seen", seen)):
                self.files[c].write(np.ascontiguousarray(a, dict(_COLUMNS)[c]).tobytes())

    def close(self) -> Run:
        with self._no_space():
            for fh in self.files.values():
                fh.close()
        return Run(self.folder, self.name)

    @contextlib.contextmanager
    def _no_space(self) -> Iterator[None]:
        """A full disk is one error naming the run's files, not a traceback."""
        try:
            yield
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise NotWritableError(errno.ENOSPC, f"cannot write {self.folder / self.name}.*: "
                                   "no space left on device for the disk key index"
                                   ) from None


def _newest(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], drop_removed: bool
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge sorted parts given oldest first: the newest entry of each key, without
    removed keys (slot -1) when ``drop_removed``."""
    parts = [p for p in parts if len(p[0])]
    if not parts:
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int32)
    if len(parts) == 1:
        k, s, t = (np.asarray(a) for a in parts[0])
    else:
        k = np.concatenate([p[0] for p in parts])
        order = np.argsort(k, kind="stable")  # equal keys keep oldest-first order
        k = k[order]
        s = np.concatenate([p[1] for p in parts])[order]
        t = np.concatenate([p[2] for p in parts])[order]
        last = np.ones(len(k), np.bool_)
        last[:-1] = k[1:] != k[:-1]
        k, s, t = k[last], s[last], t[last]
    if drop_removed:
        live = s >= 0
        k, s, t = k[live], s[live], t[live]
    return k, s, t


class RunIndex:
    """int64 key -> (slot, last_seen), every key in sorted runs under ``folder``.

    The same slot discipline as ``KeyIndex`` (dense slots, recycled after removal), so the
    slab files stay compact. ``lookup`` / ``assign`` / ``remove`` take whole batches;
    ``end_pass`` flushes, merges and forgets the keys not planned for the next pass.
    """

    def __init__(self, folder: str | Path, buffer_keys: int = BUFFER_KEYS,
                 background: bool = True) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        for old in self.folder.glob("run-*"):
            old.unlink()
        self.buffer_keys = int(buffer_keys)
        self._limit = self.buffer_keys  # raised while this pass's own keys need more
        self.runs: list[Run] = []  # oldest first
        # Guards the runs list and keeps its runs' files open: held by resolutions and
        # scans, and by a merge only to swap its output in (re-entrant: a scan may flush).
        self._lock = threading.RLock()
        self.background = background
        self._merger: threading.Thread | None = None
        self._merge_error: BaseException | None = None
        self.merges = 0  # merges done (stats)
        self._run_id = 0
        self._next_slot = 0
        self._free = np.empty(16, np.int64)
        self._n_free = 0
        self._size = 0
        self._gen = 0
        self._new_hot()
        self.resolved = 0  # keys resolved against the runs (stats)

    # -- hot level ----------------------------------------------------------------------
    def _new_hot(self, capacity: int = 1024) -> None:
        self._hot = KeyIndex(capacity)
        self._h_slot = np.empty(16, np.int64)
        self._h_seen = np.empty(16, np.int32)
        self._h_dirty = np.zeros(16, np.bool_)
        self._h_gen = np.zeros(16, np.int32)

    def _hot_insert(self, keys: np.ndarray, slots: np.ndarray, seen: np.ndarray,
                    dirty: bool, gen: int) -> np.ndarray:
        pos, _ = self._hot.lookup_or_insert(keys)
        need = self._hot.slot_bound
        self._h_slot = grown(self._h_slot, need)
        self._h_seen = grown(self._h_seen, need)
        self._h_dirty = grown(self._h_dirty, need)
        self._h_gen = grown(self._h_gen, need)
        self._h_slot[pos] = slots
        self._h_seen[pos] = seen
        self._h_dirty[pos] = dirty
        self._h_gen[pos] = gen
        return pos

    @property
    def hot_keys(self) -> int:
        return len(self._hot)

    # -- sizes --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._size

    @property
    def slot_bound(self) -> int:
        return self._next_slot

    @property
    def nbytes(self) -> int:
        """RAM held: run directories, the hot level and the free-slot list."""
        return self.directory_bytes + self._hot_bytes + self._free.nbytes

    @property
    def _hot_bytes(self) -> int:
        return (self._hot.nbytes + self._h_slot.nbytes + self._h_seen.nbytes
                + self._h_dirty.nbytes + self._h_gen.nbytes)

    @property
    def reserved_bytes(self) -> int:
        """What the budget must keep for this index: the directories and free list as
        they are, and the hot level at the larger of its current size and its flush
        limit (``buffer_keys``) at ``HOT_ENTRY_PEAK_BYTES`` per entry, so that filling
        the hot level up to its limit and flushing it (sorted copies included) never
        takes RAM the memory tier was given. A pass whose own keys outgrow the limit
        holds them (the limit rises to twice the batch): that part, and its flush
        copies, are counted as they are, like the pass's other buffers."""
        hot = max(self._hot_bytes, self.buffer_keys * HOT_ENTRY_PEAK_BYTES)
        return self.directory_bytes + hot + self._free.nbytes

    @property
    def directory_bytes(self) -> int:
        """RAM of the runs' directories alone: what every key costs."""
        with self._lock:
            return sum(r.nbytes for r in self.runs)

    @property
    def file_bytes(self) -> int:
        with self._lock:
            return sum(20 * r.n for r in self.runs)

    # -- lookups ------------------------------------------------------------------------
    def _resolve(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot, seen) of distinct ``keys`` from the runs (slot -1: absent or removed)."""
        n = len(keys)
        slots = np.full(n, -1, np.int64)
        seen = np.zeros(n, np.int32)
        if not n or not self.runs:
            return slots, seen
        with self._lock:  # a merge finishing meanwhile swaps its output in after this
            self._resolve_sorted(keys, slots, seen)
        self.resolved += n
        return slots, seen

    def _resolve_sorted(self, keys: np.ndarray, slots: np.ndarray, seen: np.ndarray) -> None:
        n = len(keys)
        order = np.argsort(keys)
        q = keys[order]
        todo = np.arange(n, dtype=np.int64)
        s_sorted = np.full(n, -1, np.int64)
        t_sorted = np.zeros(n, np.int32)
        for run in reversed(self.runs):  # newest first: the first entry found is current
            if not len(todo):
                break
            # Sorted queries touch the files front to back: a part at a time, so that the
            # pages mapped at once span about MAPPED_BYTES of the run (they count in the
            # resident set until released; a pass's keys can touch every page).
            step = max(1024, MAPPED_BYTES * len(todo) // max(1, 20 * run.n))
            hit = np.zeros(len(todo), np.bool_)
            for lo in range(0, len(todo), step):
                part = todo[lo:lo + step]
                pos = np.empty(len(part), np.int64)
                f0 = max(0, int(np.searchsorted(run.fences, q[part[0]], "right")) - 1)
                _probe(run.cols["keys"], run.fences, RUN_BLOCK, run.bloom, q, part, pos, f0)
                found = pos >= 0
                if found.any():
                    _take(run.cols["slots"], pos, s_sorted, part)
                    _take(run.cols["seen"], pos, t_sorted, part)
                    hit[lo:lo + step] = found
                run.release()
            todo = todo[~hit]
        slots[order] = s_sorted
        seen[order] = t_sorted

    def _entries(self, keys: np.ndarray, gen: int) -> np.ndarray:
        """Hot positions of distinct ``keys``, resolving the misses in one sorted batch."""
        keys = np.ascontiguousarray(keys, np.int64)
        pos = self._hot.lookup(keys)
        miss = np.flatnonzero(pos < 0)
        if len(miss) and len(self._hot) + len(miss) > self._limit:
            self._shrink(len(miss))
            pos = self._hot.lookup(keys)
            miss = np.flatnonzero(pos < 0)
        if len(miss):
            mk = keys[miss]
            slots, seen = self._resolve(mk)
            pos[miss] = self._hot_insert(mk, slots, seen, False, gen)
        self._h_gen[pos] = np.maximum(self._h_gen[pos], gen)
        return pos

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Slots of distinct ``keys`` (-1 where absent)."""
        pos = self._entries(keys, self._gen)  # may grow or rebuild the hot arrays
        return self._h_slot[pos]

    def plan(self, keys: np.ndarray) -> np.ndarray:
        """``lookup`` for the next pass's keys: they stay in the hot level past this
        pass's end (the planning thread resolves them off the training path)."""
        pos = self._entries(keys, self._gen + 1)
        return self._h_slot[pos]

    def seen_of(self, keys: np.ndarray) -> np.ndarray:
        pos = self._entries(keys, self._gen)
        return self._h_seen[pos]

    # -- changes ------------------------------------------------------------------------
    def assign(self, keys: np.ndarray, seen: np.ndarray) -> np.ndarray:
        """Slots of distinct ``keys``, new keys getting free slots; records their
        last-seen pass. Only entries that change are flushed."""
        pos = self._entries(keys, self._gen)
        slots = self._h_slot[pos]
        new = np.flatnonzero(slots < 0)
        if len(new):
            take = min(len(new), self._n_free)
            fresh = np.empty(len(new), np.int64)
            fresh[:take] = self._free[self._n_free - take:self._n_free][::-1]
            self._n_free -= take
            fresh[take:] = np.arange(self._next_slot, self._next_slot + len(new) - take)
            self._next_slot += len(new) - take
            slots[new] = fresh
            self._h_slot[pos[new]] = fresh
            self._size += len(new)
        seen = np.asarray(seen, np.int32)
        changed = (self._h_seen[pos] != seen)
        changed[new] = True
        self._h_seen[pos] = seen
        self._h_dirty[pos[changed]] = True
        return slots

    def remove(self, keys: np.ndarray) -> np.ndarray:
        """Remove distinct ``keys``; returns their former slots (-1 where absent)."""
        keys = np.ascontiguousarray(keys, np.int64)
        if not len(keys):
            return np.empty(0, np.int64)
        pos = self._entries(keys, self._gen)
        slots = self._h_slot[pos].copy()
        present = slots >= 0
        freed = slots[present]
        self._h_slot[pos[present]] = -1
        self._h_dirty[pos[present]] = True
        self._size -= len(freed)
        need = self._n_free + len(freed)
        self._free = grown(self._free, need)
        self._free[self._n_free:need] = freed
        self._n_free = need
        return slots

    # -- runs ---------------------------------------------------------------------------
    def _new_name(self) -> str:
        with self._lock:
            self._run_id += 1
            return f"run-{self._run_id:06d}"

    def flush(self, items: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Write the changed hot entries as a new run (then merge size-tiered, in the
        background unless ``background`` is off); ``items``: the hot level's (keys,
        positions) when the caller has them."""
        self._check()
        keys, pos = self._hot.items() if items is None else items
        dirty = self._h_dirty[pos]
        if not dirty.any():
            return
        keys, pos = keys[dirty], pos[dirty]
        order = np.argsort(keys)
        keys, pos = keys[order], pos[order]
        writer = _RunWriter(self.folder, self._new_name())
        writer.append(keys, self._h_slot[pos], self._h_seen[pos])
        run = writer.close()
        with self._lock:
            self.runs.append(run)
        self._h_dirty[pos] = False
        self._schedule()

    def _plan(self) -> list[Run] | None:
        """The newest runs a size-tiered merge folds together (None: none due): the
        newest, then each run before while it is at most ``MERGE_RATIO`` times what is
        gathered so far."""
        with self._lock:
            runs = self.runs
            if len(runs) < 2 or runs[-2].n > MERGE_RATIO * runs[-1].n:
                return None
            total, i = runs[-1].n, len(runs) - 2
            while i >= 0 and runs[i].n <= MERGE_RATIO * total:
                total += runs[i].n
                i -= 1
            return runs[i + 1:]

    def _schedule(self) -> None:
        """Start the due merges: in a thread (one at a time; it looks for more work when
        done), or here when ``background`` is off."""
        if not self.background:
            while (inputs := self._plan()) is not None:
                self._merge(inputs)
            return
        if self._merger is not None and self._merger.is_alive():
            return
        if self._plan() is None:
            return
        self._merger = threading.Thread(target=self._merge_loop, name="run-index-merge",
                                        daemon=True)
        self._merger.start()

    def _merge_loop(self) -> None:
        try:
            while (inputs := self._plan()) is not None:
                self._merge(inputs)
        except BaseException as e:  # re-raised by the next call that changes the runs
            self._merge_error = e

    def _check(self) -> None:
        if self._merge_error is not None:
            e, self._merge_error = self._merge_error, None
            raise RuntimeError(f"merging the key index runs in {self.folder} failed") from e

    def wait(self) -> None:
        """Wait for the background merges due now (and raise a failed one's error)."""
        while self._merger is not None and self._merger.is_alive():
            self._merger.join()
            if self._plan() is not None and self._merge_error is None:
                self._schedule()  # runs added while the merger was finishing
        self._check()

    def _merge(self, inputs: list[Run]) -> None:
        """Merge ``inputs`` (consecutive runs, oldest first) into one run, chunk by chunk
        in key order, then swap it in: the inputs stay readable until then."""
        with self._lock:
            oldest = self.runs[0] is inputs[0]
        writer = _RunWriter(self.folder, self._new_name())
        for parts in _ranges(inputs):
            writer.append(*_newest(parts, drop_removed=oldest))
        merged = writer.close()
        with self._lock:
            at = next(i for i, r in enumerate(self.runs) if r is inputs[0])
            self.runs[at:at + len(inputs)] = [merged]
            for run in inputs:
                run.close()
                for name in run.files:
                    (self.folder / name).unlink()
            self.merges += 1

    def compact(self) -> None:
        """Merge every run into one (dropping removed keys and shadowed entries)."""
        self.flush()
        self.wait()
        if len(self.runs) > 1 or (self.runs and self.runs[0].n > self._size):
            self._merge(list(self.runs))

    def _shrink(self, incoming: int) -> None:
        """The hot level is full: flush it and forget every key not planned for the next
        pass (this pass's come back from the runs if asked again). The limit rises to
        twice what is kept plus the incoming batch, until pass end, so that one large
        pass does not flush at every batch; a bulk load holds two batches at most."""
        keys, pos = self._hot.items()
        self.flush((keys, pos))
        keep = self._h_gen[pos] > self._gen
        self._rebuild_hot(keys[keep], pos[keep])
        self._limit = max(self._limit, 2 * (len(self._hot) + incoming))

    def _rebuild_hot(self, keys: np.ndarray, pos: np.ndarray) -> None:
        slot, seen, gen = self._h_slot[pos], self._h_seen[pos], self._h_gen[pos]
        self._new_hot(max(1024, 2 * len(keys)))
        if len(keys):
            p = self._hot_insert(keys, slot, seen, False, 0)
            self._h_gen[p] = gen

    def end_pass(self) -> None:
        """Flush the pass's changes and forget the keys not planned for the next pass."""
        keys, pos = self._hot.items()
        self.flush((keys, pos))
        keep = self._h_gen[pos] > self._gen
        self._rebuild_hot(keys[keep], pos[keep])
        self._gen += 1
        self._limit = max(self.buffer_keys, 2 * len(self._hot))

    def release_pages(self) -> None:
        with self._lock:
            for run in self.runs:
                run.release()

    # -- scans --------------------------------------------------------------------------
    def iter_items(self, chunk: int | None = None
                   ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Live (keys, slots, seen) in increasing key order, about ``chunk`` (default
        ``MERGE_CHUNK``) per part."""
        self.flush()
        with self._lock:  # no merge swaps runs out while they are read
            for parts in _ranges(list(self.runs), chunk):
                k, s, t = _newest(parts, drop_removed=True)
                if len(k):
                    yield k, s, t
            self.release_pages()

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        keys, slots, _ = self.items_seen()
        return keys, slots

    def items_seen(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every live (key, slot, seen) in key order (O(keys) RAM: for scans)."""
        parts = list(self.iter_items())
        if not parts:
            return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int32)
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]

    # -- persistence --------------------------------------------------------------------
    def snapshot(self, dst: Path) -> tuple[dict[str, np.ndarray], str]:
        """Hard-link the runs into ``dst`` (copied when the filesystems differ); returns
        the arrays and the manifest (JSON) the snapshot's index file records. Its run
        names are the runs linked: a background merge may swap ``runs`` right after."""
        self.flush()
        with self._lock:  # the listed runs' files exist while they are linked
            for run in self.runs:
                for name in run.files:
                    _link_or_copy(self.folder / name, dst / name)
            manifest = json.dumps({"runs": [r.name for r in self.runs],
                                   "run_id": self._run_id, "next_slot": self._next_slot,
                                   "size": self._size})
        return {"free": self._free[:self._n_free].copy()}, manifest

    @staticmethod
    def snapshot_files(manifest: str) -> list[str]:
        """The file names of the runs a snapshot's ``manifest`` lists."""
        return [f for name in json.loads(manifest)["runs"] for f in run_files(name)]

    def restore(self, src: Path, arrays: dict[str, np.ndarray], manifest: str) -> None:
        """Replace the content by a snapshot (run files hard-linked from ``src``)."""
        self.close()
        for old in self.folder.glob("run-*"):
            old.unlink()
        m = json.loads(manifest)
        for name in m["runs"]:
            for file in run_files(name):
                _link_or_copy(Path(src) / file, self.folder / file)
            self.runs.append(Run(self.folder, name))
        self._run_id, self._next_slot, self._size = m["run_id"], m["next_slot"], m["size"]
        free = arrays["free"]
        self._free = np.empty(max(16, len(free)), np.int64)
        self._free[:len(free)] = free
        self._n_free = len(free)
        self._new_hot()

    def load_items(self, keys: np.ndarray, slots: np.ndarray, seen: np.ndarray) -> None:
        """Replace the content by (key, slot, seen) entries (one run; unused slots below
        the highest become free, as ``KeyIndex.from_items``)."""
        self.close()
        for old in self.folder.glob("run-*"):
            old.unlink()
        order = np.argsort(keys)
        writer = _RunWriter(self.folder, self._new_name())
        writer.append(keys[order], slots[order], seen[order])
        self.runs = [writer.close()]
        self._size = len(keys)
        self._next_slot = int(slots.max()) + 1 if len(slots) else 0
        used = np.zeros(self._next_slot, np.bool_)
        used[slots] = True
        free = np.flatnonzero(~used)[::-1].astype(np.int64)
        self._free = np.empty(max(16, len(free)), np.int64)
        self._free[:len(free)] = free
        self._n_free = len(free)
        self._new_hot()

    def close(self) -> None:
        """Wait for the merges in flight, then close the runs' files."""
        if self._merger is not None:
            self._merger.join()
        self._merge_error = None
        with self._lock:
            for run in self.runs:
                run.close()
            self.runs = []


def _ranges(runs: list[Run], chunk: int | None = None
            ) -> Iterator[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """The runs cut into key ranges of about ``chunk`` (default ``MERGE_CHUNK``) entries
    of the largest run: per range, each run's (keys, slots, seen) slice, oldest first.
    Read pages are unmapped after each range."""
    if not runs:
        return
    chunk = chunk or MERGE_CHUNK
    big = max(runs, key=lambda r: r.n)
    bounds = [int(b) for b in big.cols["keys"][chunk::chunk]] if big.n else []
    edges: list[int | None] = [None, *bounds, None]
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        parts = []
        for run in runs:
            a, b = run.range(lo, hi)
            parts.append(tuple(np.array(run.cols[c][a:b]) for c, _ in _COLUMNS))
        yield parts  # type: ignore[misc]
        for run in runs:
            run.release()


def read_run_items(folder: Path, manifest: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every live (key, slot, seen) of the runs a snapshot's manifest lists, key order."""
    runs = [Run(Path(folder), name) for name in json.loads(manifest)["runs"]]
    parts = [_newest(p, drop_removed=True) for p in _ranges(runs)]
    for run in runs:
        run.close()
    if not parts:
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int32)
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
