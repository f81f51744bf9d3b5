"""The values the ``EmbeddingStore`` protocol passes in and out: rows of some keys,
key-ordered chunks of a whole store, and its figures. They sit below every store so that
the interface (protocol.py) names what it returns without importing an implementation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RowBlock:
    """Rows of some keys, in the order of those keys."""

    values: np.ndarray
    state: np.ndarray
    # Stored width of each row when rows have variable length: columns past it are zero
    # and must stay zero in training. None: every row is full width.
    widths: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.values)


@dataclass
class RowChunk:
    """Consecutive rows of a store in key order (``iter_sorted``): what a checkpoint or an
    export takes, values decoded to fp32."""

    keys: np.ndarray       # int64 [n], increasing
    values: np.ndarray     # float32 [n, row_dim]
    state: np.ndarray      # float32 [n, S]
    show: np.ndarray       # float32 [n]
    click: np.ndarray      # float32 [n]
    last_seen: np.ndarray  # int32 [n]

    def __len__(self) -> int:
        return len(self.keys)

    def columns(self) -> dict[str, np.ndarray]:
        """The ``to_arrays`` row columns of this chunk."""
        return {"keys": self.keys, "values": self.values, "state": self.state,
                "show": self.show, "click": self.click, "last_seen": self.last_seen}


@dataclass
class StoreStats:
    keys: int
    candidates: int
    admitted: int
    evicted: int
    bytes: int
    value_bytes: int = 0  # encoded values incl. row scale/bias; no optimizer state
    pruned: int = 0  # keys dropped because group lasso zeroed their row (part of evicted)
    rejected: int = 0  # absent keys a pass asked for and admission turned away
    admission_bytes: int = 0  # RAM of the admission state (candidate table or sketch)


@dataclass
class TierStats:
    """Where the rows are and what moving them cost, for logs and ``terarec inspect``."""

    memory_keys: int
    memory_capacity: int
    memory_bytes: int
    disk_keys: int
    disk_allocated_bytes: int
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
