"""Eviction: which keys a store drops at pass end.

Policies are applied in a fixed order, each to the rows the ones before it left::

    ttl         evict_after_passes   last seen ``N`` or more passes ago
    l2          evict_l2_below       row's L2 norm below X (DeepRec's L2-weight eviction)
    show        evict_show_below     fewer than X shows, not seen in this pass (LFU)
    capacity    max_keys /           the lowest-scored rows until the store fits
                max_store_bytes      (evict_score: lfu = fewest shows, lru = longest
                                     unseen, l2 = smallest norm; ties by key)

A store hands the policies a ``RowView`` of its rows: keys and last-seen pass at once,
shows and norms only when a policy asks (a tiered store reads its disk-only rows for
them, a chunk at a time); a store over a disk key index hands them its rows a key
range at a time instead (``apply_eviction_streamed``: the same keys selected, RAM for a
range, not for every key). The store evicts what they select as it evicts anything:
evicted keys go into the next incremental export as deletions.

Store bytes (``store_bytes``) count what a row costs wherever it lives: its values as
encoded, optimizer state, show, click, last-seen and the key, 8 B; no index overhead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from terarec.config import StoreConfig, parse_bytes

if TYPE_CHECKING:
    from terarec.embedding.protocol import EmbeddingStore

# Bytes per row besides its values and optimizer state: show, click, last seen, key.
ROW_OVERHEAD_BYTES = 4 + 4 + 4 + 8
# Rows of variable length differ in size: a byte target is checked again this many times.
BYTE_TARGET_ROUNDS = 3


def store_bytes(store: EmbeddingStore) -> int:
    """Bytes of the store's rows (see the module docstring)."""
    return int(store.value_bytes) + len(store) * (4 * store.state_dim + ROW_OVERHEAD_BYTES)


def row_norms(values: np.ndarray) -> np.ndarray:
    """L2 norm of each row of ``values`` (float32, computed in float64)."""
    return np.sqrt(np.einsum("ij,ij->i", values, values, dtype=np.float64)).astype(np.float32)


class RowView:
    """A store's rows as eviction sees them, in one fixed order: ``keys`` and
    ``last_seen`` given, ``show`` and ``norm`` loaded on first use."""

    def __init__(self, keys: np.ndarray, last_seen: np.ndarray,
                 load_show: Callable[[], np.ndarray], load_norm: Callable[[], np.ndarray],
                 bytes_per_row: float) -> None:
        self.keys = keys
        self.last_seen = last_seen
        self._load_show, self._load_norm = load_show, load_norm
        self._show: np.ndarray | None = None
        self._norm: np.ndarray | None = None
        self.bytes_per_row = bytes_per_row

    @property
    def show(self) -> np.ndarray:
        if self._show is None:
            self._show = self._load_show()
        return self._show

    @property
    def norm(self) -> np.ndarray:
        if self._norm is None:
            self._norm = self._load_norm()
        return self._norm

    def __len__(self) -> int:
        return len(self.keys)

    def without(self, drop: np.ndarray) -> RowView:
        """The rows not in mask ``drop``."""
        keep = ~drop
        view = RowView(self.keys[keep], self.last_seen[keep],
                       lambda: self.show[keep], lambda: self.norm[keep], self.bytes_per_row)
        view._show = None if self._show is None else self._show[keep]
        view._norm = None if self._norm is None else self._norm[keep]
        return view


class EvictionPolicy(Protocol):
    def select(self, rows: RowView, pass_id: int) -> np.ndarray:
        """Mask of ``rows`` to evict after pass ``pass_id``."""
        ...


@dataclass(frozen=True)
class TTL:
    passes: int

    def select(self, rows: RowView, pass_id: int) -> np.ndarray:
        return rows.last_seen <= pass_id - self.passes


@dataclass(frozen=True)
class NormBelow:
    threshold: float

    def select(self, rows: RowView, pass_id: int) -> np.ndarray:
        return rows.norm < self.threshold


@dataclass(frozen=True)
class ShowBelow:
    """Rarely shown keys, once they had a pass to come back in."""

    threshold: float

    def select(self, rows: RowView, pass_id: int) -> np.ndarray:
        return (rows.show < self.threshold) & (rows.last_seen < pass_id)


@dataclass(frozen=True)
class Capacity:
    """At most ``max_keys`` rows and ``max_bytes`` store bytes: the lowest-scored go."""

    max_keys: int | None
    max_bytes: int | None
    score: str = "lfu"

    def keep(self, rows: RowView) -> int:
        return self.keep_of(len(rows), rows.bytes_per_row)

    def keep_of(self, n: int, bytes_per_row: float) -> int:
        """How many of ``n`` rows of ``bytes_per_row`` store bytes each may stay."""
        if self.max_keys is not None:
            n = min(n, self.max_keys)
        if self.max_bytes is not None and bytes_per_row > 0:
            n = min(n, int(self.max_bytes // bytes_per_row))
        return n

    def scores(self, rows: RowView) -> tuple[np.ndarray, ...]:
        """Sort keys, most significant last (``np.lexsort``): low scores go first."""
        if self.score == "lfu":
            return rows.keys, rows.last_seen, rows.show
        if self.score == "lru":
            return rows.keys, rows.show, rows.last_seen
        if self.score == "l2":
            return rows.keys, rows.norm
        raise ValueError(f"evict_score {self.score!r}: expected lfu, lru or l2")

    def select(self, rows: RowView, pass_id: int) -> np.ndarray:
        drop = np.zeros(len(rows), np.bool_)
        n_out = len(rows) - self.keep(rows)
        if n_out > 0:
            drop[np.lexsort(self.scores(rows))[:n_out]] = True
        return drop


def make_eviction(config: StoreConfig) -> list[EvictionPolicy]:
    """The policies ``config`` asks for, in the order they apply."""
    policies: list[EvictionPolicy] = []
    if config.evict_after_passes is not None:
        policies.append(TTL(config.evict_after_passes))
    if config.evict_l2_below is not None:
        policies.append(NormBelow(config.evict_l2_below))
    if config.evict_show_below is not None:
        policies.append(ShowBelow(config.evict_show_below))
    if config.max_keys is not None or config.max_store_bytes is not None:
        policies.append(Capacity(
            config.max_keys,
            None if config.max_store_bytes is None else parse_bytes(config.max_store_bytes),
            config.evict_score))
    return policies


def apply_eviction(policies: list[EvictionPolicy], view: Callable[[], RowView],
                   evict: Callable[[np.ndarray], int], pass_id: int) -> int:
    """Run ``policies`` over the rows ``view`` gives and ``evict`` what they select;
    returns the number of keys evicted. A byte target is checked again afterwards (rows
    of variable length differ in size) and met within a few rounds."""
    if not policies:
        return 0
    rows = view()
    total = 0
    for policy in policies:
        if not len(rows):
            break
        drop = policy.select(rows, pass_id)
        if drop.any():
            total += evict(rows.keys[drop])
            rows = rows.without(drop)
    last = policies[-1]
    if isinstance(last, Capacity) and last.max_bytes is not None:
        for _ in range(BYTE_TARGET_ROUNDS):
            rows = view()
            if not len(rows) or len(rows) * rows.bytes_per_row <= last.max_bytes:
                break
            drop = last.select(rows, pass_id)
            if not drop.any():
                break
            total += evict(rows.keys[drop])
    return total


def apply_eviction_streamed(policies: list[EvictionPolicy],
                            parts: Callable[[], Iterator[RowView]],
                            size: Callable[[], tuple[int, int]],
                            evict: Callable[[np.ndarray], int], pass_id: int) -> int:
    """``apply_eviction`` over rows seen a part at a time (a disk key index's key ranges),
    selecting exactly the same keys, so RAM holds one part, the keys selected and, for
    ``Capacity``, its best candidates so far instead of every row at once.

    ``parts()`` yields every row once, in any order, each call; ``size()`` is the store's
    (rows, store bytes). The per-row policies (TTL, L2, shows) are decided part by part;
    ``Capacity``, which must come last, keeps the lowest-scored rows over a second scan of
    the rows the others leave. Keys are evicted after the scans, which they do not change.
    """
    if not policies:
        return 0
    last = policies[-1]
    capacity = last if isinstance(last, Capacity) else None
    per_row = policies[:-1] if capacity is not None else policies
    if any(isinstance(p, Capacity) for p in per_row):
        raise ValueError("Capacity must be the last eviction policy")
    rows, total_bytes = size()
    bytes_per_row = total_bytes / max(rows, 1)

    def survivors(part: RowView) -> tuple[RowView, np.ndarray]:
        drop = np.zeros(len(part), np.bool_)
        for policy in per_row:  # per-row decisions: the order of the policies is moot
            drop |= policy.select(part, pass_id)
        return part.without(drop), part.keys[drop]

    dropped, left = [], 0
    for part in parts():
        kept, gone = survivors(part)
        dropped.append(gone)
        left += len(kept)
    total = 0
    chosen = np.concatenate(dropped) if dropped else np.empty(0, np.int64)
    if capacity is not None:
        out = left - capacity.keep_of(left, bytes_per_row)
        if out > 0:
            chosen = np.concatenate([chosen, _lowest(capacity, parts, out, survivors)])
    if len(chosen):
        total += evict(chosen)
    if capacity is None or capacity.max_bytes is None:
        return total
    for _ in range(BYTE_TARGET_ROUNDS):  # rows of variable length: check again
        rows, total_bytes = size()
        if not rows or total_bytes <= capacity.max_bytes:
            break
        out = rows - capacity.keep_of(rows, total_bytes / rows)
        if out <= 0:
            break
        total += evict(_lowest(capacity, parts, out, lambda p: (p, p.keys[:0])))
    return total


def _lowest(capacity: Capacity, parts: Callable[[], Iterator[RowView]], out: int,
            survivors: Callable[[RowView], tuple[RowView, np.ndarray]]) -> np.ndarray:
    """Keys of the ``out`` lowest-scored surviving rows in ``capacity``'s order (the rows
    ``np.lexsort(capacity.scores(...))[:out]`` picks over all of them at once): candidates
    are merged part by part, and once there are ``out`` of them a part's rows are first
    filtered against the worst one kept."""
    best: tuple[np.ndarray, ...] | None = None
    for part in parts():
        kept, _ = survivors(part)
        if not len(kept):
            continue
        cols = capacity.scores(kept)
        if best is not None and len(best[0]) == out:
            better = _before(cols, tuple(c[-1] for c in best))
            if not better.any():
                continue
            cols = tuple(c[better] for c in cols)
        if best is not None:
            cols = tuple(np.concatenate([b, c]) for b, c in zip(best, cols, strict=True))
        order = np.lexsort(cols)[:out]
        best = tuple(c[order] for c in cols)
    return best[0] if best is not None else np.empty(0, np.int64)


def _before(cols: tuple[np.ndarray, ...], worst: tuple[object, ...]) -> np.ndarray:
    """Rows that sort before ``worst`` in ``np.lexsort(cols)`` order (the last column most
    significant; the first, the keys, unique)."""
    before = np.zeros(len(cols[0]), np.bool_)
    equal = np.ones(len(cols[0]), np.bool_)
    for col, w in zip(reversed(cols), reversed(worst), strict=True):
        before |= equal & (col < w)
        equal &= col == w
    return before
