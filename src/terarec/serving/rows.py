"""Where a served version's sparse rows come from: disk shards, a delta overlay, a hot cache.

::

    request keys ──> RowCache (hot keys, bounded, CLOCK eviction)
                        │ misses
                        v
                     VersionRows.lookup
                        ├── overlay: rows upserted/deleted by the deltas since the full
                        │   version (in memory, sorted, np.searchsorted)
                        └── ShardedRows: the full version's sorted-key shards,
                            memory-mapped from local disk (np.searchsorted per shard)

A ``VersionRows`` is immutable: a delta yields a new one sharing the same shards, so the
version being served is never modified while requests read it.

Every stage behind the cache is a ``RowSource``: one call maps a batch of unique int64
keys to their rows and a found mask. A tier that holds rows elsewhere (cold keys in a
remote store) is one more ``RowSource``, chained behind a version's own rows with
``FallbackRows`` (``ServedVersion.cold_rows``).
"""

from __future__ import annotations

import mmap
from typing import Protocol

import numba
import numpy as np

from terarec.embedding.index import KeyIndex
from terarec.export.format import mappings_of


class RowSource(Protocol):
    """Rows by key, a batch at a time: the request path's one row-reading step."""

    row_dim: int

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For unique int64 ``keys``: float32 rows ``[len(keys), row_dim]`` (zero where
        not found) and the bool found mask."""
        ...


class FallbackRows:
    """``first``'s rows, and ``then``'s for the keys ``first`` does not find."""

    def __init__(self, first: RowSource, then: RowSource) -> None:
        if first.row_dim != then.row_dim:
            raise ValueError(f"row sources of {first.row_dim} and {then.row_dim} "
                             "values per row cannot be chained")
        self.first = first
        self.then = then
        self.row_dim = first.row_dim

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows, found = self.first.lookup(keys)
        missing = np.flatnonzero(~found)
        if len(missing):
            more, more_found = self.then.lookup(keys[missing])
            rows[missing] = more
            found[missing] = more_found
        return rows, found


class DamagedRowsError(RuntimeError):
    """A memory-mapped shard file shrank under the server (truncated in place): reading
    its missing pages would kill the process with SIGBUS, so the lookup stops first."""


def _check_mapped(maps: list[mmap.mmap]) -> None:
    """Raise ``DamagedRowsError`` when a mapped file is now shorter than its map (one
    ``fstat`` per map: what the map's ``size()`` asks the kernel)."""
    for m in maps:
        try:
            size = m.size()
        except (OSError, ValueError) as exc:
            raise DamagedRowsError(f"a mapped shard file cannot be checked ({exc})") from None
        if size < len(m):
            raise DamagedRowsError(f"a mapped shard file shrank from {len(m)} to {size} "
                                   "bytes under the server")


class ShardedRows:
    """Rows of a full version: shards with disjoint, increasing key ranges, each a sorted
    ``keys`` array and its ``values`` (usually memory maps of the shard files). Before a
    mapped shard is read, its file is checked to still be as long as its map: a file
    truncated underneath raises ``DamagedRowsError`` instead of a fatal SIGBUS."""

    def __init__(self, shards: list[tuple[np.ndarray, np.ndarray]], row_dim: int) -> None:
        self.row_dim = row_dim
        self.shard_keys = [k for k, _ in shards]
        self.shard_values = [v for _, v in shards]
        self.shard_maps = [mappings_of(k, v) for k, v in shards]
        self.firsts = np.array([k[0] for k in self.shard_keys], np.int64)
        if len(self.firsts) > 1 and not bool(np.all(self.firsts[1:] > self.firsts[:-1])):
            raise ValueError("shards must hold increasing key ranges")

    def __len__(self) -> int:
        return sum(len(k) for k in self.shard_keys)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Values of ``keys`` (zero rows where absent) and the found mask."""
        out = np.zeros((len(keys), self.row_dim), np.float32)
        found = np.zeros(len(keys), np.bool_)
        if not len(self.firsts) or not len(keys):
            return out, found
        shard = np.searchsorted(self.firsts, keys, side="right") - 1
        for s in np.unique(shard[shard >= 0]):
            _check_mapped(self.shard_maps[s])
            sel = np.flatnonzero(shard == s)
            skeys = self.shard_keys[s]
            pos = np.minimum(np.searchsorted(skeys, keys[sel]), len(skeys) - 1)
            hit = skeys[pos] == keys[sel]
            out[sel[hit]] = self.shard_values[s][pos[hit]]
            found[sel[hit]] = True
        return out, found


class VersionRows:
    """A version's rows: ``base`` shards overridden by an overlay of delta rows.

    The overlay holds sorted keys, their values and a ``live`` flag (False: deleted by a
    delta, served as a zero row even if the base has the key).
    """

    def __init__(self, base: ShardedRows, keys: np.ndarray | None = None,
                 values: np.ndarray | None = None, live: np.ndarray | None = None) -> None:
        self.base = base
        self.row_dim = base.row_dim
        self.keys = keys if keys is not None else np.empty(0, np.int64)
        self.values = (values if values is not None
                       else np.empty((0, base.row_dim), np.float32))
        self.live = live if live is not None else np.empty(0, np.bool_)

    @property
    def overlay_rows(self) -> int:
        return len(self.keys)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Values of ``keys`` (zero rows where absent or deleted) and the found mask."""
        keys = np.ascontiguousarray(keys, np.int64)
        if not len(self.keys):
            return self.base.lookup(keys)
        pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        in_overlay = self.keys[pos] == keys
        rest = np.flatnonzero(~in_overlay)
        out = np.zeros((len(keys), self.row_dim), np.float32)
        found = np.zeros(len(keys), np.bool_)
        hit = np.flatnonzero(in_overlay)
        out[hit] = self.values[pos[hit]]
        found[hit] = self.live[pos[hit]]
        if len(rest):
            out[rest], found[rest] = self.base.lookup(keys[rest])
        return out, found

    def with_delta(self, upsert_keys: np.ndarray, upsert_values: np.ndarray,
                   deleted: np.ndarray) -> VersionRows:
        """A new ``VersionRows`` with one delta applied: deletions first, then upserts."""
        keys = np.concatenate([self.keys, deleted.astype(np.int64), upsert_keys])
        values = np.concatenate([
            self.values, np.zeros((len(deleted), self.row_dim), np.float32),
            np.asarray(upsert_values, np.float32).reshape(-1, self.row_dim)])
        live = np.concatenate([self.live, np.zeros(len(deleted), np.bool_),
                               np.ones(len(upsert_keys), np.bool_)])
        # A stable sort keeps equal keys in the order above, so the last of each run is
        # the newest word on that key.
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        last = np.ones(len(keys), np.bool_)
        last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
        take = order[last]
        return VersionRows(self.base, keys[take], values[take], live[take])


@numba.njit(nogil=True, cache=True)
def _clock_victims(ref, occupied, hand, out):
    """Second-chance (CLOCK) choice of ``len(out)`` occupied slots to evict: a slot used
    since the hand last passed gets its bit cleared and is spared once."""
    n = ref.shape[0]
    k = 0
    while k < out.shape[0]:
        if occupied[hand]:
            if ref[hand]:
                ref[hand] = False
            else:
                occupied[hand] = False
                out[k] = hand
                k += 1
        hand = (hand + 1) % n
    return hand


class RowCache:
    """A bounded int64 key -> row cache for hot keys; approximately LRU (CLOCK).

    Not thread-safe: the serving engine calls it under its lock.
    """

    def __init__(self, capacity: int, row_dim: int) -> None:
        if capacity < 0:
            raise ValueError(f"cache capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.row_dim = row_dim
        self.clear()

    def clear(self) -> None:
        self.index = KeyIndex(max(16, self.capacity))
        self.values = np.zeros((self.capacity, self.row_dim), np.float32)
        self.slot_keys = np.zeros(self.capacity, np.int64)
        self.ref = np.zeros(self.capacity, np.bool_)
        self.occupied = np.zeros(self.capacity, np.bool_)
        self.hand = 0

    def __len__(self) -> int:
        return len(self.index)

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slots, hit mask) for unique ``keys``; rows are ``values[slots[hit]]``."""
        slots = self.index.lookup(keys)
        hit = slots >= 0
        self.ref[slots[hit]] = True
        return slots, hit

    def put(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Insert unique keys absent from the cache, evicting cold ones to make room."""
        keys, rows = keys[:self.capacity], rows[:self.capacity]
        if not len(keys):
            return
        need = len(keys) - (self.capacity - len(self.index))
        if need > 0:
            victims = np.empty(need, np.int64)
            self.hand = _clock_victims(self.ref, self.occupied, self.hand, victims)
            self.index.remove(self.slot_keys[victims])
        slots, _ = self.index.lookup_or_insert(keys)
        self.values[slots] = rows
        self.slot_keys[slots] = keys
        self.occupied[slots] = True
        self.ref[slots] = False

    def refresh(self, keys: np.ndarray, rows: np.ndarray) -> int:
        """Overwrite the rows of those ``keys`` that are cached; returns how many were."""
        slots = self.index.lookup(keys)
        present = slots >= 0
        self.values[slots[present]] = rows[present]
        return int(present.sum())
