"""The one interface every embedding store implements (memory, tiered; a sharded or
device-cached store joins by implementing it too).

Callers outside ``embedding/`` (trainers, working sets, checkpoints, exporters) hold an
``EmbeddingStore`` and use nothing else: no ``hasattr`` probes, no private members.
What differs between stores is said by attributes of the protocol (``prefetches``,
``saved_format``, ``tier_stats() is None``), not found out by trying.

Life of a pass::

    pull(keys, show, click, pass)  -> rows (+ admission mask)     prefetch(next keys)
                                      (admission.py decides who gets a row; eviction.py
                                      who loses it at end_pass)
    push(keys, rows)               <- trained rows and optimizer state
    end_pass(pass)                 -> group-lasso pruning, eviction policies, fit to budget

Between passes::

    iter_sorted(chunk_rows)        key-ordered RowChunks, never the whole table at once
    changed_since / take_evicted   what an incremental export upserts / deletes
    save(dir) -> digests           the store's own files; committed(dir, digests) after
    load(dir | file, digests)      the commit; load reads what either store saved
    load_rows(chunks, extras)      the same from a stream (a restore at another world size)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from terarec.config import StoreConfig
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.types import RowBlock, RowChunk, StoreStats, TierStats


@runtime_checkable
class EmbeddingStore(Protocol):
    """int64 key -> embedding row, optimizer state and counters; whole key arrays in
    and out (see ``store.MemoryStore`` for the semantics every store keeps)."""

    row_dim: int
    state_dim: int
    optimizer: SparseOptimizer
    config: StoreConfig
    # A new key's row is ``store.init_rows(key, row_dim, config.init_std, seed)``.
    seed: int
    # True when ``prefetch`` reads rows ahead (a disk tier); False: a no-op.
    prefetches: bool
    # What ``save`` writes: "arrays" (one to_arrays file) or "tiered" (slab snapshot).
    saved_format: str

    # -- the pass ---------------------------------------------------------------------
    def pull(self, keys: np.ndarray, show: np.ndarray, click: np.ndarray,
             pass_id: int) -> tuple[RowBlock, np.ndarray]: ...

    def push(self, keys: np.ndarray, block: RowBlock) -> None: ...

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def prefetch(self, keys: np.ndarray) -> int: ...

    def end_pass(self, pass_id: int) -> int: ...

    def evict(self, keys: np.ndarray) -> int: ...

    # -- incremental export -------------------------------------------------------------
    def track_evictions(self) -> None: ...

    def take_evicted(self) -> np.ndarray: ...

    def changed_since(self, pass_id: int) -> tuple[np.ndarray, np.ndarray]: ...

    # -- whole-store reads and persistence ----------------------------------------------
    def iter_sorted(self, chunk_rows: int = ...) -> Iterator[RowChunk]: ...

    def save(self, dst: Path) -> dict[str, str]: ...

    def committed(self, path: Path, digests: dict[str, str]) -> None: ...

    def load(self, src: Path, digests: dict[str, str] | None = None) -> None: ...

    def to_arrays(self) -> dict[str, np.ndarray]: ...

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None: ...

    def load_rows(self, chunks: Iterable[RowChunk], extras: dict[str, np.ndarray]) -> None:
        """Replace the content by row chunks read one at a time (distinct keys) and the
        store-wide arrays of ``to_arrays`` (counters, admission candidates)."""
        ...

    # -- sizes ------------------------------------------------------------------------------
    def __len__(self) -> int: ...

    @property
    def value_bytes(self) -> int: ...

    def stats(self) -> StoreStats: ...

    def tier_stats(self) -> TierStats | None: ...

    def close(self) -> None:
        """Release what the store holds beyond its Python objects (a tiered store's
        folder lock and mapped slabs), so another store can use its folder; the store
        is not used afterwards."""
        ...
