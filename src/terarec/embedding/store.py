"""The embedding store: int64 key -> row of values, optimizer state and counters.

The API moves whole key arrays (``pull`` / ``push``), never single keys, so the same calls
work against a local store, a tiered one, or a remote shard owner. Admission and eviction
are policies applied here, at pass boundaries and on pull.

Row arrays (one entry per slot of the key index)::

    values     float32 [slots, row_dim]   the embedding row (a ``CodedRows`` that encodes
                                          and decodes by slot when compressed)
    state      float32 [slots, S]         per-row optimizer state (see optimizers.py)
    show       float32 [slots]            times seen
    click      float32 [slots]            positive labels seen with it
    last_seen  int32   [slots]            last pass that touched it
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numba
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file as load_numpy

from terarec.config import StoreConfig
from terarec.embedding.admission import is_admission_array, make_admission
from terarec.embedding.compression import CodedRows, FrequencyClasses, make_row_values
from terarec.embedding.eviction import (
    RowView,
    apply_eviction,
    make_eviction,
    row_norms,
    store_bytes,
)
from terarec.embedding.index import KeyIndex, iter_sorted_keys
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.types import RowBlock, RowChunk, StoreStats
from terarec.io import sha256_file
from terarec.kernels import GOLDEN_GAMMA, grown, splitmix64

if TYPE_CHECKING:
    from terarec.embedding.disk import RecordLayout

# The file a store saved in arrays form holds (``MemoryStore.save``).
ROWS_FILE = "rows.safetensors"
# Rows per chunk when a store streams itself (checkpoint loads, exports).
CHUNK_ROWS = 1 << 16
# Store-wide totals saved with the rows (summed when shards merge).
STORE_TOTALS = ("counters", "pruned", "rejected")


@numba.njit(nogil=True, cache=True)
def _init_rows(keys, dim, std, seed):
    """Uniform rows with standard deviation ``std`` that depend only on (key, seed): any
    process, shard or resumed run initialises a key alike. Uniform, as DLRM and TorchRec
    initialise tables, and cheaper than Gaussian (no log or cos per value)."""
    out = np.empty((keys.shape[0], dim), np.float32)
    half_width = std * np.sqrt(3.0)
    salt = np.uint64(seed) * np.uint64(GOLDEN_GAMMA)
    for i in range(keys.shape[0]):
        base = np.uint64(keys[i]) ^ salt
        for d in range(dim):
            z = splitmix64(base + np.uint64(d + 1) * np.uint64(0xD1B54A32D192ED03))
            u = np.float64(z >> np.uint64(11)) * (1.0 / 9007199254740992.0)
            out[i, d] = (2.0 * u - 1.0) * half_width
    return out


def init_rows(keys: np.ndarray, dim: int, std: float, seed: int) -> np.ndarray:
    return _init_rows(np.ascontiguousarray(keys, np.int64), dim, float(std), int(seed))


def arrays_file(src: Path) -> Path | None:
    """The arrays-form file of what a store saved at ``src`` (a folder written by
    ``MemoryStore.save``, or a ``to_arrays`` .safetensors file: memory-store checkpoints
    and torchrun shards from before ``save``); None for a tiered snapshot folder."""
    src = Path(src)
    if src.is_file():
        return src
    return src / ROWS_FILE if (src / ROWS_FILE).exists() else None


def iter_arrays_file(path: Path, chunk_rows: int = CHUNK_ROWS) -> Iterator[RowChunk]:
    """Row chunks of an arrays-form file (rows sorted by key), read a slice at a time."""
    with safe_open(str(path), "np") as fh:
        n = fh.get_slice("keys").get_shape()[0]
        for lo in range(0, n, max(1, chunk_rows)):
            hi = min(n, lo + chunk_rows)
            yield RowChunk(*(fh.get_slice(name)[lo:hi] for name in
                             ("keys", "values", "state", "show", "click", "last_seen")))


def store_extras(path: Path) -> dict[str, np.ndarray]:
    """The store-wide arrays of an arrays-form file: admission candidates and counters."""
    with safe_open(str(path), "np") as fh:
        return {name: fh.get_tensor(name) for name in fh.keys()  # noqa: SIM118
                if is_admission_array(name) or name in STORE_TOTALS}


def merge_sorted(parts: list[Iterator[RowChunk]],
                 chunk_rows: int = CHUNK_ROWS) -> Iterator[RowChunk]:
    """One key-ordered stream of RowChunks from several key-ordered streams with disjoint
    keys (the shards of a table): a k-way merge holding one chunk per stream.

    Rows up to the smallest "last buffered key" among the streams still running are
    final: nothing later can come before them.
    """
    chunk_rows = max(1, int(chunk_rows))
    streams = [iter(p) for p in parts]
    buffers: list[RowChunk | None] = [next(s, None) for s in streams]
    while True:
        for i, b in enumerate(buffers):  # drop empty chunks, refill
            while b is not None and not len(b):
                b = buffers[i] = next(streams[i], None)
        live = [i for i, b in enumerate(buffers) if b is not None]
        if not live:
            return
        bound = min(int(buffers[i].keys[-1]) for i in live)  # type: ignore[union-attr]
        taken = []
        for i in live:
            b = buffers[i]
            assert b is not None
            n = int(np.searchsorted(b.keys, bound, side="right"))
            taken.append(_slice(b, 0, n))
            buffers[i] = _slice(b, n, len(b)) if n < len(b) else next(streams[i], None)
        cols = {name: np.concatenate([getattr(t, name) for t in taken])
                for name in ("keys", "values", "state", "show", "click", "last_seen")}
        order = np.argsort(cols["keys"], kind="stable")
        merged = RowChunk(**{name: c[order] for name, c in cols.items()})
        for lo in range(0, len(merged), chunk_rows):
            yield _slice(merged, lo, lo + chunk_rows)


def _slice(chunk: RowChunk, lo: int, hi: int) -> RowChunk:
    return RowChunk(chunk.keys[lo:hi], chunk.values[lo:hi], chunk.state[lo:hi],
                    chunk.show[lo:hi], chunk.click[lo:hi], chunk.last_seen[lo:hi])


_SAFETENSORS_DTYPES = {np.dtype(np.int64): "I64", np.dtype(np.int32): "I32",
                       np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}


def write_arrays_file(path: Path, rows: int, row_dim: int, state_dim: int,
                      chunks: Iterator[RowChunk], extras: dict[str, np.ndarray]) -> None:
    """Write an arrays-form safetensors file (the layout ``save_numpy(to_arrays())``
    writes, readable by any safetensors reader) from key-ordered chunks holding ``rows``
    rows in all, a chunk at a time: each column's slice goes to its place in the file.

    safetensors layout: u64 header size | JSON header (tensor -> dtype, shape, byte
    range in the data) | data: the tensors back to back, in header order.
    """
    shapes = {"keys": ((rows,), np.int64), "values": ((rows, row_dim), np.float32),
              "state": ((rows, state_dim), np.float32), "show": ((rows,), np.float32),
              "click": ((rows,), np.float32), "last_seen": ((rows,), np.int32)}
    tensors: list[tuple[str, tuple[int, ...], np.dtype]] = [
        (name, shape, np.dtype(dtype)) for name, (shape, dtype) in shapes.items()]
    tensors += [(name, a.shape, a.dtype) for name, a in sorted(extras.items())]
    header: dict[str, dict] = {}
    offset = 0
    for name, shape, dtype in tensors:
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    start = 8 + len(raw)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        fh.truncate(start + offset)
        done = 0
        for chunk in chunks:
            for name, column in chunk.columns().items():
                begin = header[name]["data_offsets"][0]
                row_bytes = column.dtype.itemsize * (column.shape[1] if column.ndim > 1 else 1)
                fh.seek(start + begin + done * row_bytes)
                fh.write(np.ascontiguousarray(column, shapes[name][1]).tobytes())
            done += len(chunk)
        if done != rows:
            raise ValueError(f"{path}: {done} rows streamed, {rows} announced")
        for name, _, _ in tensors[len(shapes):]:
            fh.seek(start + header[name]["data_offsets"][0])
            fh.write(np.ascontiguousarray(extras[name]).tobytes())


class EvictionLog:
    """Keys evicted since the last export: what an incremental export deletes. Logging is
    off until ``track_evictions``, so a store nobody exports from grows no log."""

    _evicted_log: list[np.ndarray] | None = None

    def track_evictions(self) -> None:
        if self._evicted_log is None:
            self._evicted_log = []

    def _log_evicted(self, keys: np.ndarray) -> None:
        if self._evicted_log is not None and len(keys):
            self._evicted_log.append(np.asarray(keys, np.int64).copy())

    def take_evicted(self) -> np.ndarray:
        """Unique sorted keys evicted since the previous call; the log is cleared."""
        if not self._evicted_log:
            return np.empty(0, np.int64)
        keys = np.unique(np.concatenate(self._evicted_log))
        self._evicted_log = []
        return keys


def grow_rows(owner: Any, n: int, per_row: tuple[str, ...]) -> None:
    """Give ``owner.values`` (float rows or ``CodedRows``) and its per-row arrays named in
    ``per_row`` room for ``n`` slots, doubling the capacity so that repeated growth stays
    O(n); the one grow-the-arrays of the stores that keep rows by slot (``MemoryStore``,
    ``SharedRowsStore``). The first of ``per_row`` gives the current capacity."""
    cap = len(getattr(owner, per_row[0]))
    if n <= cap:
        return
    new_cap = max(n, 2 * cap)
    if isinstance(owner.values, CodedRows):
        owner.values.grow(new_cap)
    else:
        owner.values = grown(owner.values, new_cap, double=False)
    for name in per_row:
        setattr(owner, name, grown(getattr(owner, name), new_cap, double=False))


class MemoryStore(EvictionLog):
    """All rows in RAM, grown on demand; the memory tier and the single-process store."""

    saved_format = "arrays"  # what ``save`` writes: one to_arrays file
    prefetches = False  # nothing to read ahead: ``prefetch`` is a no-op

    def __init__(self, row_dim: int, optimizer: SparseOptimizer, config: StoreConfig | None = None,
                 seed: int = 0, capacity: int = 1024) -> None:
        self.row_dim = row_dim
        self.optimizer = optimizer
        self.config = config or StoreConfig()
        self.seed = seed
        self.state_dim = optimizer.state_dim(row_dim)
        self.index = KeyIndex(capacity)
        self._alloc(capacity)
        # What is kept of keys seen but not admitted yet (embedding/admission.py).
        self.admission = make_admission(self.config, seed)
        self.eviction = make_eviction(self.config)
        self.admitted_total = 0
        self.evicted_total = 0
        self.pruned_total = 0
        self.rejected_total = 0

    # -- storage ------------------------------------------------------------------------
    def _alloc(self, capacity: int) -> None:
        c = self.config
        coded = make_row_values(self.row_dim, c.precision, tuple(c.variable_dims),
                                tuple(c.promote_at), class_precisions=tuple(c.class_precisions),
                                stochastic=c.stochastic_rounding, seed=self.seed,
                                capacity=capacity)
        self.values = coded if coded is not None else np.zeros((capacity, self.row_dim),
                                                                np.float32)
        self.state = np.zeros((capacity, self.state_dim), np.float32)
        self.show = np.zeros(capacity, np.float32)
        self.click = np.zeros(capacity, np.float32)
        self.last_seen = np.zeros(capacity, np.int32)

    def ensure_rows(self, n: int) -> None:
        grow_rows(self, n, ("state", "show", "click", "last_seen"))

    def __len__(self) -> int:
        return len(self.index)

    @property
    def value_bytes(self) -> int:
        """Bytes of the live rows' values as stored (codes + row scale/bias when encoded)."""
        if isinstance(self.values, CodedRows):
            return self.values.value_bytes(self.index.items()[1])
        return len(self.index) * 4 * self.row_dim

    @property
    def nbytes(self) -> int:
        """Bytes held by live rows plus the index."""
        per_row = 4 * self.state_dim + 4 + 4 + 4
        if isinstance(self.values, CodedRows):
            per_row += self.values.overhead_bytes_per_slot
        return self.value_bytes + len(self.index) * per_row + self.index.nbytes

    @property
    def candidate_count(self) -> int:
        """Keys seen but not yet admitted, with per-key state (none under a sketch)."""
        return self.admission.candidate_count

    @property
    def candidate_nbytes(self) -> int:
        """RAM held by the admission state (candidate table or sketch)."""
        return self.admission.nbytes

    def tier_stats(self) -> None:
        """No tiers: every row is in RAM."""
        return None

    def close(self) -> None:
        """Nothing outside the heap to release: the rows go with the object."""

    def stats(self) -> StoreStats:
        return StoreStats(keys=len(self.index), candidates=self.candidate_count,
                          admitted=self.admitted_total, evicted=self.evicted_total,
                          bytes=self.nbytes, value_bytes=self.value_bytes,
                          pruned=self.pruned_total, rejected=self.rejected_total,
                          admission_bytes=self.candidate_nbytes)

    # -- admission ----------------------------------------------------------------------
    def admit(self, keys: np.ndarray, show: np.ndarray, click: np.ndarray,
               pass_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Put ``keys`` (absent from the index) through admission; return those now
        admitted with the counts they gathered in earlier passes (this pass's are added by
        pull)."""
        admitted, earlier_show, earlier_click = self.admission.admit(keys, show, click,
                                                                     pass_id)
        self.rejected_total += len(keys) - len(admitted)
        return admitted, earlier_show, earlier_click

    # -- the pass API -------------------------------------------------------------------
    def pull(self, keys: np.ndarray, show: np.ndarray, click: np.ndarray,
             pass_id: int) -> tuple[RowBlock, np.ndarray]:
        """Rows for the unique ``keys`` of a pass, counting their shows and clicks.

        Keys absent from the store go through admission; admitted new keys get fresh
        rows. Returns the rows of the admitted keys (in ``keys`` order) and the mask of
        which keys are admitted: the others train against the zero row.
        """
        keys = np.ascontiguousarray(keys, np.int64)
        if self.admission.admits_all:  # every key admitted: one probe per key
            slots, inserted = self.index.lookup_or_insert(keys)
            if inserted.any():
                self._create_rows(keys[inserted], slots[inserted],
                                  np.zeros(int(inserted.sum()), np.float32),
                                  np.zeros(int(inserted.sum()), np.float32),
                                  first_show=show[inserted])
            return self._count_and_gather(slots, show, click, pass_id), np.ones(len(keys), bool)
        slots = self.index.lookup(keys)
        missing = slots < 0
        if missing.any():
            new_keys, earlier_show, earlier_click = self.admit(
                keys[missing], show[missing], click[missing], pass_id)
            if len(new_keys):
                new_slots, _ = self.index.lookup_or_insert(new_keys)
                slots[missing] = self.index.lookup(keys[missing])
                newly = missing & (slots >= 0)  # new_keys, in ``keys`` order
                self._create_rows(new_keys, new_slots, earlier_show, earlier_click,
                                  first_show=earlier_show + show[newly])
        admitted = slots >= 0
        return self._count_and_gather(slots[admitted], show[admitted], click[admitted],
                                      pass_id), admitted

    def _create_rows(self, keys: np.ndarray, slots: np.ndarray, show: np.ndarray,
                     click: np.ndarray, first_show: np.ndarray | None = None) -> None:
        """Fresh rows; ``first_show`` (shows including this pass's) picks their width class
        when rows have variable length."""
        self.ensure_rows(self.index.slot_bound)
        if self._classes is not None:
            self.coded.set_class(slots, self._classes.classify(
                show if first_show is None else first_show))
        self.values[slots] = init_rows(keys, self.row_dim, self.config.init_std, self.seed)
        self.state[slots] = self.optimizer.init_state(len(keys), self.row_dim)
        self.show[slots] = show
        self.click[slots] = click
        self.last_seen[slots] = 0
        self.admitted_total += len(keys)

    def _count_and_gather(self, slots: np.ndarray, show: np.ndarray, click: np.ndarray,
                          pass_id: int) -> RowBlock:
        self.show[slots] += show
        self.click[slots] += click
        self.last_seen[slots] = pass_id
        block = RowBlock(self.values[slots], self.state[slots])
        if self._classes is not None:
            self.promote(slots)
            block.widths = self.coded.widths_of(slots)
        return block

    @property
    def coded(self) -> CodedRows:
        """The encoded row values; only stores that keep rows compressed have them."""
        if not isinstance(self.values, CodedRows):
            raise TypeError("this store keeps plain fp32 rows")
        return self.values

    @property
    def _classes(self) -> FrequencyClasses | None:
        """Frequency classes when rows have variable length, else None."""
        values = self.values
        if isinstance(values, CodedRows) and len(values.classes.widths) > 1:
            return values.classes
        return None

    def promote(self, slots: np.ndarray) -> None:
        """Move rows whose show count reached a wider class there (zeros in the new
        columns, so their decoded values, and the model's output, do not change)."""
        classes = self._classes
        if classes is None:
            return
        target = np.maximum(self.coded.cls[slots], classes.classify(self.show[slots]))
        self.coded.set_class(slots, target)

    def push(self, keys: np.ndarray, block: RowBlock) -> None:
        """Write back trained rows of keys previously pulled (and not evicted since)."""
        slots = self.index.lookup(keys)
        if (slots < 0).any():
            raise KeyError(f"{int((slots < 0).sum())} pushed keys are not in the store")
        self.values[slots] = block.values
        self.state[slots] = block.state

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Read-only: values of ``keys`` (zero rows where absent) and the found mask."""
        slots = self.index.lookup(keys)
        found = slots >= 0
        values = np.zeros((len(keys), self.row_dim), np.float32)
        values[found] = self.values[slots[found]]
        return values, found

    def end_pass(self, pass_id: int) -> int:
        """Apply eviction after pass ``pass_id`` (group-lasso pruning, then the policies
        of embedding/eviction.py); returns the number of keys evicted."""
        evicted = self.prune_zero_rows(pass_id) if self.optimizer.config.group_lasso else 0
        evicted += apply_eviction(self.eviction, self.row_view, self.evict, pass_id)
        ttl = self.config.evict_after_passes
        if ttl is not None:
            self.expire_candidates(pass_id - ttl)
        return evicted

    def row_view(self) -> RowView:
        """Every row, for the eviction policies."""
        keys, slots = self.index.items()
        return RowView(keys, self.last_seen[slots], lambda: self.show[slots],
                       lambda: self.norms(slots), self.bytes_per_row)

    @property
    def bytes_per_row(self) -> float:
        """Average store bytes of a row (``eviction.store_bytes``)."""
        return store_bytes(self) / max(len(self), 1)

    def norms(self, slots: np.ndarray) -> np.ndarray:
        """L2 norms of the rows at ``slots``, decoded a chunk at a time."""
        out = np.empty(len(slots), np.float32)
        for lo in range(0, len(slots), CHUNK_ROWS):
            out[lo:lo + CHUNK_ROWS] = row_norms(self.values[slots[lo:lo + CHUNK_ROWS]])
        return out

    def expire_candidates(self, cutoff: int) -> None:
        """Forget admission candidates last seen in pass ``cutoff`` or before."""
        self.admission.expire(cutoff)

    def prune_zero_rows(self, pass_id: int | None = None) -> int:
        """Drop keys whose row is exactly zero (group lasso's doing), among those seen in
        pass ``pass_id`` (all keys when None: only trained rows can have become zero)."""
        keys, slots = self.index.items()
        if pass_id is not None:
            seen = self.last_seen[slots] == pass_id
            keys, slots = keys[seen], slots[seen]
        zero = ~(self.values[slots] != 0).any(axis=1)
        pruned = self.evict(keys[zero])
        self.pruned_total += pruned
        return pruned

    def evict(self, keys: np.ndarray) -> int:
        slots = self.index.remove(keys)
        self._log_evicted(np.asarray(keys, np.int64)[slots >= 0])
        slots = slots[slots >= 0]
        if isinstance(self.values, CodedRows):
            self.values.release(slots)
        else:
            self.values[slots] = 0
        self.state[slots] = 0
        self.show[slots] = 0
        self.click[slots] = 0
        self.evicted_total += len(slots)
        return len(slots)

    # -- change tracking for incremental export --------------------------------------------
    def changed_since(self, pass_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Sorted keys (and their values) of rows touched in pass ``pass_id`` or later.

        A row's values change only in passes that pull it, and every pull stamps
        ``last_seen``, so these are all rows that may differ from an export taken before
        pass ``pass_id`` (plus rows pulled but left unchanged: a superset is safe).
        """
        keys, slots = self.index.items()
        recent = self.last_seen[slots] >= pass_id
        keys, slots = keys[recent], slots[recent]
        order = np.argsort(keys, kind="stable")
        return keys[order], self.values[slots[order]]

    def prefetch(self, keys: np.ndarray) -> int:
        """Nothing to read ahead: every row is in RAM."""
        return 0

    # -- rows as disk records (the tiered store's memory tier) ----------------------------
    def records(self, slots: np.ndarray, layout: RecordLayout) -> np.ndarray:
        """Rows at ``slots`` as ``layout`` records; encoded values are copied as bytes."""
        out = np.empty((len(slots), layout.width), np.float32)
        v, s = layout.value_words, self.state_dim
        if layout.plain:
            out[:, :v] = self.values[slots]
        else:
            out[:, :v] = 0  # the padding past a row's codes
            self.coded.read_codes(slots, out.view(np.uint8))
        out[:, v:v + s] = self.state[slots]
        out[:, v + s] = self.show[slots]
        out[:, v + s + 1] = self.click[slots]
        out[:, v + s + 2] = self.last_seen[slots].view(np.float32)
        return out

    def set_records(self, slots: np.ndarray, rec: np.ndarray, layout: RecordLayout) -> None:
        """Rows at ``slots`` from ``layout`` records: encoded values are copied as bytes,
        into the width class of the record's show count."""
        v, s = layout.value_words, self.state_dim
        if layout.plain:
            self.values[slots] = rec[:, :v]
        else:
            rec = np.ascontiguousarray(rec)
            self.coded.write_codes(slots, layout.classes(rec[:, v + s]), rec.view(np.uint8))
        self.state[slots] = rec[:, v:v + s]
        self.show[slots] = rec[:, v + s]
        self.click[slots] = rec[:, v + s + 1]
        self.last_seen[slots] = np.ascontiguousarray(rec[:, v + s + 2]).view(np.int32)

    # -- persistence --------------------------------------------------------------------
    def iter_sorted(self, chunk_rows: int = CHUNK_ROWS) -> Iterator[RowChunk]:
        """Every row in increasing key order, at most ``chunk_rows`` rows per chunk. The
        store must not change until the iteration ends (call it at a pass boundary)."""
        chunk_rows = max(1, int(chunk_rows))
        for keys in iter_sorted_keys([self.index]):
            for lo in range(0, len(keys), chunk_rows):
                k = keys[lo:lo + chunk_rows]
                slots = self.index.lookup(k)
                yield RowChunk(k, self.values[slots], self.state[slots], self.show[slots],
                               self.click[slots], self.last_seen[slots])

    def save(self, dst: Path) -> dict[str, str]:
        """Write the store into the new folder ``dst`` (one ``to_arrays`` file); returns
        {file name: sha256}."""
        dst = Path(dst)
        dst.mkdir(parents=True, exist_ok=True)
        # Streamed from iter_sorted: no second copy of the table, as to_arrays would make.
        write_arrays_file(dst / ROWS_FILE, len(self), self.row_dim, self.state_dim,
                          self.iter_sorted(), self._store_extras())
        return {ROWS_FILE: sha256_file(dst / ROWS_FILE)}

    def _store_extras(self) -> dict[str, np.ndarray]:
        """The store-wide arrays of ``to_arrays``: counters and admission candidates."""
        return {"counters": np.array([self.admitted_total, self.evicted_total], np.int64),
                "pruned": np.array([self.pruned_total], np.int64),
                "rejected": np.array([self.rejected_total], np.int64),
                **self.candidate_arrays()}

    def committed(self, path: Path, digests: dict[str, str]) -> None:
        """The folder last saved is now committed at ``path`` (nothing to remember)."""

    def load(self, src: Path, digests: dict[str, str] | None = None) -> None:
        """Replace the content by what a store saved at ``src``: a ``save`` folder of
        either store (a tiered snapshot's rows are re-encoded as this store keeps them) or
        a ``to_arrays`` file."""
        path = arrays_file(src)
        if path is not None:
            self.load_arrays(load_numpy(str(path)))
            return
        from terarec.embedding.tiered import snapshot_arrays

        self.load_arrays(snapshot_arrays(Path(src), self.row_dim, self.state_dim))

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Live rows sorted by key: the form checkpoints and exports take."""
        keys, slots = self.index.items()
        order = np.argsort(keys, kind="stable")
        keys, slots = keys[order], slots[order]
        return {
            "keys": keys,
            "values": self.values[slots],
            "state": self.state[slots],
            "show": self.show[slots],
            "click": self.click[slots],
            "last_seen": self.last_seen[slots],
            **self._store_extras(),
        }

    def candidate_arrays(self) -> dict[str, np.ndarray]:
        """The admission state (waiting keys and their counts, or the sketch): saved so
        that a resumed run admits exactly the keys an uninterrupted one would."""
        return self.admission.arrays()

    def load_candidate_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Admission state and the rejected total from saved arrays."""
        self.admission.load_arrays(arrays)
        self.rejected_total = int(arrays["rejected"].sum()) if "rejected" in arrays else 0

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.load_rows([RowChunk(*(arrays[name] for name in (
            "keys", "values", "state", "show", "click", "last_seen")))], arrays)

    def load_rows(self, chunks: Iterable[RowChunk], extras: dict[str, np.ndarray]) -> None:
        """Replace the content by ``chunks`` (rows of distinct keys) and the store-wide
        arrays in ``extras`` (counters, admission candidates), a chunk at a time: a
        restore at another world size streams each rank's share through here."""
        self._alloc(16)
        keys: list[np.ndarray] = []
        n = 0
        for chunk in chunks:
            m = len(chunk)
            if chunk.values.shape != (m, self.row_dim):
                raise ValueError(f"stored rows have shape {chunk.values.shape}, "
                                 f"expected ({m}, {self.row_dim})")
            if not m:
                continue
            self.ensure_rows(n + m)
            if self._classes is not None:
                self.coded.set_class(np.arange(n, n + m), self._classes.classify(chunk.show))
            self.values[n:n + m] = chunk.values
            self.state[n:n + m] = chunk.state
            self.show[n:n + m] = chunk.show
            self.click[n:n + m] = chunk.click
            self.last_seen[n:n + m] = chunk.last_seen
            keys.append(np.asarray(chunk.keys, np.int64))
            n += m
        self.index = KeyIndex.from_items(np.concatenate(keys) if keys else
                                         np.empty(0, np.int64), np.arange(n, dtype=np.int64))
        self._load_extras(extras)

    def _load_extras(self, arrays: dict[str, np.ndarray]) -> None:
        """Counters and admission candidates from ``to_arrays``-style arrays."""
        if "counters" in arrays:
            self.admitted_total, self.evicted_total = (int(x) for x in arrays["counters"])
        self.pruned_total = int(arrays["pruned"].sum()) if "pruned" in arrays else 0
        self.load_candidate_arrays(arrays)
