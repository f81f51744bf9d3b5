"""The disk tier: every row of the store in fixed-size records in memory-mapped slab files.

Why this layout: measured on 10M rows of 64 B with batches of 100k keys and a warm page
cache, a key-value store with one entry per key reads 0.2 M keys/s (rocksdict), 0.5 M
(lmdb) or 0.4 M (sqlite) -- a Python object per key. Fixed slots in memory-mapped files,
addressed by a compiled ``KeyIndex`` held in RAM, read 9.2 M rows/s: a read is one copy
from the page cache. ``pread``/``pwrite`` per row were measured at 0.3 M rows/s here (one
system call each), so the slabs are mapped.

Layout (``slab_rows`` a power of two, so a slot splits with a shift and a mask)::

    slot s  ->  slab s >> shift,  record s & mask
    slab-000000.bin  float32 [slab_rows, width]      slab-000001.bin ...
    record: values | state[S] | show | click | last_seen (int32 bits)

The values part holds the row as the memory tier keeps it (``RecordLayout``): fp32 floats,
or the bytes of ``quant.encode_rows`` at the row's precision padded to whole words, so an
int8 row of 64 values takes 72 bytes here instead of 256.

Slots come from the ``KeyIndex`` (dense, recycled after removal), so the files stay
compact; growing the table adds a slab file and never moves a row. Writes mark their
slab dirty, which is what lets a checkpoint take only the slabs changed since the
previous one (``snapshot``). A checkpoint hard-links the live slab files instead of copying
them, and the first write to a slab that a checkpoint shares copies that slab (64 MB) to a
new file first (copy on write at slab granularity): a checkpoint costs no disk until
training changes its slabs, so a table larger than half the free disk can be checkpointed.

RAM per key (``key_index="ram"``): the ``KeyIndex`` (16 B per bucket at 25-50 % load:
32-64 B per key) plus a 4 B mirror of ``last_seen`` so TTL eviction never scans the files.
With ``key_index="disk"`` the keys live in sorted run files next to the slabs
(``keyindex.RunIndex``): about 1 B of RAM per key, plus the keys in play.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import mmap
import os
import shutil
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from safetensors import safe_open
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file as save_numpy

from terarec.embedding.compression import CodedRows, FrequencyClasses
from terarec.embedding.index import KeyIndex
from terarec.embedding.keyindex import RunIndex, read_run_items
from terarec.embedding.quant import decode_rows, encode_rows, row_bytes
from terarec.io import NotWritableError, sha256_file, try_lock_file
from terarec.kernels import grown

SLAB_BYTES = 64 << 20
# Slab blocks allocated ahead of the highest slot in use, per fallocate call.
RESERVE_BYTES = 4 << 20
INDEX_FILE = "index.safetensors"
KEY_INDEXES = ("ram", "disk")


def record_width(row_dim: int, state_dim: int) -> int:
    """float32 words per fp32 record: values, optimizer state, show, click, last_seen."""
    return row_dim + state_dim + 3


@dataclass(frozen=True)
class RecordLayout:
    """How a store's rows sit in fixed-size float32 records::

        values[value_words] | state[state_dim] | show | click | last_seen (int32 bits)

    The values are the bytes of ``quant.encode_rows`` at the row's class precision and
    width (for plain fp32 rows, the floats themselves), zero-padded to whole words: the
    bytes the memory tier's ``CodedRows`` holds, so rows move between the tiers without
    being re-encoded. A row's width class follows from its show count (classes only grow
    with it), so records carry no class field; each has room for the widest class.
    The last three words come last in every layout, so counts read without the layout.
    """

    row_dim: int
    state_dim: int
    precisions: tuple[str, ...] = ("fp32",)
    widths: tuple[int, ...] = ()  # class widths, ascending; () means (row_dim,)
    promote_at: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.widths:
            object.__setattr__(self, "widths", (self.row_dim,))
        if len(self.precisions) != len(self.widths) or self.widths[-1] != self.row_dim:
            raise ValueError(f"record layout: {len(self.widths)} classes of widths "
                             f"{self.widths} (the last must be {self.row_dim}) need one "
                             f"precision each, got {self.precisions}")

    @classmethod
    def for_values(cls, values: np.ndarray | CodedRows, state_dim: int) -> RecordLayout:
        """The layout of a store whose values array is ``values``."""
        if not isinstance(values, CodedRows):
            return cls(values.shape[1], state_dim)
        return cls(values.row_dim, state_dim, tuple(values.precisions),
                   tuple(values.classes.widths), tuple(values.classes.promote_at))

    # -- shape --------------------------------------------------------------------------
    @property
    def plain(self) -> bool:
        """fp32 rows of one width: values are the record's first ``row_dim`` words."""
        return self.precisions == ("fp32",)

    @property
    def class_bytes(self) -> tuple[int, ...]:
        return tuple(row_bytes(p, w) for p, w in zip(self.precisions, self.widths,  # type: ignore[arg-type]
                                                      strict=True))

    @property
    def value_words(self) -> int:
        return -(-max(self.class_bytes) // 4)

    @property
    def width(self) -> int:
        return self.value_words + self.state_dim + 3

    @property
    def show_col(self) -> int:
        return self.value_words + self.state_dim

    # -- classes ------------------------------------------------------------------------
    def classes(self, show: np.ndarray) -> np.ndarray:
        """Width class (int8) of rows with these show counts."""
        if len(self.widths) == 1:
            return np.zeros(len(show), np.int8)
        return FrequencyClasses(self.widths, self.promote_at).classify(show)

    def widths_of(self, rec: np.ndarray) -> np.ndarray:
        """Stored width (int32) of each record's row."""
        return np.asarray(self.widths, np.int32)[self.classes(rec[:, self.show_col])]

    # -- values -------------------------------------------------------------------------
    def values(self, rec: np.ndarray) -> np.ndarray:
        """Decoded float32 ``[n, row_dim]`` values of records (short rows zero-padded)."""
        if self.plain:
            return np.ascontiguousarray(rec[:, :self.row_dim])
        codes = np.ascontiguousarray(rec).view(np.uint8)
        if len(self.widths) == 1:
            return decode_rows(codes[:, :self.class_bytes[0]], self.precisions[0],  # type: ignore[arg-type]
                               self.row_dim)
        out = np.zeros((len(rec), self.row_dim), np.float32)
        cls = self.classes(rec[:, self.show_col])
        for c, (p, w, nbytes) in enumerate(zip(self.precisions, self.widths,
                                               self.class_bytes, strict=True)):
            sel = np.flatnonzero(cls == c)
            if len(sel):
                out[sel, :w] = decode_rows(codes[sel, :nbytes], p, w)  # type: ignore[arg-type]
        return out

    def set_values(self, rec: np.ndarray, values: np.ndarray, rows: np.ndarray | None = None,
                   *, stochastic: bool = False, rng: np.random.Generator | None = None) -> None:
        """Encode ``values`` into records ``rows`` of the C-ordered ``rec`` (all when None),
        each at the class of its record's show count."""
        rows = np.arange(len(rec)) if rows is None else np.asarray(rows)
        if rows.dtype == bool:
            rows = np.flatnonzero(rows)
        if self.plain:
            rec[rows, :self.row_dim] = values
            return
        codes = rec.view(np.uint8)
        cls = self.classes(rec[rows, self.show_col])
        for c, (p, w, nbytes) in enumerate(zip(self.precisions, self.widths,
                                               self.class_bytes, strict=True)):
            sel = np.flatnonzero(cls == c)
            if len(sel):
                codes[rows[sel], :nbytes] = encode_rows(values[sel, :w], p,  # type: ignore[arg-type]
                                                        stochastic=stochastic, rng=rng)

    # -- whole records ------------------------------------------------------------------
    def decode(self, rec: np.ndarray, values: bool = True) -> dict[str, np.ndarray]:
        """Records as ``MemoryStore.to_arrays`` columns (``values`` decoded unless asked
        not to, e.g. for counts only)."""
        v, s = self.value_words, self.state_dim
        out = {"state": np.ascontiguousarray(rec[:, v:v + s]),
               "show": np.ascontiguousarray(rec[:, v + s]),
               "click": np.ascontiguousarray(rec[:, v + s + 1]),
               "last_seen": np.ascontiguousarray(rec[:, v + s + 2]).view(np.int32)}
        if values:
            out = {"values": self.values(rec), **out}
        return out

    def encode(self, arrays: dict[str, np.ndarray], *, stochastic: bool = False,
               rng: np.random.Generator | None = None) -> np.ndarray:
        """Records from ``MemoryStore.to_arrays`` columns."""
        n = len(arrays["show"])
        rec = np.zeros((n, self.width), np.float32)
        v, s = self.value_words, self.state_dim
        rec[:, v:v + s] = arrays["state"]
        rec[:, v + s] = arrays["show"]
        rec[:, v + s + 1] = arrays["click"]
        rec[:, v + s + 2] = np.ascontiguousarray(arrays["last_seen"], np.int32).view(np.float32)
        self.set_values(rec, np.asarray(arrays["values"], np.float32), stochastic=stochastic,
                        rng=rng)
        return rec

    # -- persistence --------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"row_dim": self.row_dim, "state_dim": self.state_dim,
                           "precisions": list(self.precisions), "widths": list(self.widths),
                           "promote_at": list(self.promote_at)})

    @classmethod
    def from_json(cls, text: str) -> RecordLayout:
        d = json.loads(text)
        return cls(int(d["row_dim"]), int(d["state_dim"]), tuple(d["precisions"]),
                   tuple(int(w) for w in d["widths"]),
                   tuple(float(x) for x in d["promote_at"]))

    def describe(self) -> str:
        if len(self.widths) == 1:
            rows = f"{self.precisions[0]} rows of {self.row_dim}"
        else:
            rows = "rows of widths " + ", ".join(
                f"{w} ({p})" for w, p in zip(self.widths, self.precisions, strict=True)) + \
                f" promoted at {list(self.promote_at)} shows"
        return f"{rows} with {self.state_dim} optimizer state floats"


@intrinsic
def _as_pointer(typingctx, address):
    """An int64 address as a raw pointer, so a kernel can view any mapped slab."""
    sig = types.voidptr(address)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return sig, codegen


@numba.njit(nogil=True, inline="always")
def _record(bases, s, shift, mask, width):
    # Slab base addresses in an int64 array: measured 8-14 M rows/s against 1.2-1.5 M
    # for a typed list of the mapped arrays (a reference count per access).
    address = bases[s >> shift] + (s & mask) * width * 4
    return numba.carray(_as_pointer(address), (width,), np.float32)


@numba.njit(nogil=True, cache=True)
def _gather(bases, slots, order, shift, mask, out):
    """out[order[i]] = record at slots[order[i]]: ``order`` sorts the slots, so the files
    are read front to back (measured 3x faster than in key order)."""
    width = out.shape[1]
    for i in range(order.shape[0]):
        k = order[i]
        s = slots[k]
        if s >= 0:
            src = _record(bases, s, shift, mask, width)
            for j in range(width):
                out[k, j] = src[j]


@numba.njit(nogil=True, cache=True)
def _page_runs(bases, slots, order, shift, mask, row_bytes, page, starts, lengths):
    """The pages under the records at ``slots[order]`` (sorted slots) as runs of adjacent
    pages: (start address, bytes) into ``starts`` / ``lengths``; returns the run count.
    Addresses rise within a slab only: the slabs' maps may lie in any order."""
    n = 0
    end = np.int64(-1)
    for i in range(order.shape[0]):
        s = slots[order[i]]
        if s < 0:
            continue
        address = bases[s >> shift] + (s & mask) * row_bytes
        lo = address // page * page
        hi = (address + row_bytes + page - 1) // page * page
        if n and starts[n - 1] <= lo <= end:
            if hi > end:
                lengths[n - 1] += hi - end
                end = hi
            continue
        starts[n] = lo
        lengths[n] = hi - lo
        end = hi
        n += 1
    return n


@numba.njit(nogil=True, cache=True)
def _scatter(bases, slots, order, shift, mask, rows, dirty):
    width = rows.shape[1]
    for i in range(order.shape[0]):
        k = order[i]
        s = slots[k]
        dst = _record(bases, s, shift, mask, width)
        for j in range(width):
            dst[j] = rows[k, j]
        dirty[s >> shift] = True


@dataclass
class DiskStats:
    keys: int
    slabs: int
    allocated_bytes: int
    index_bytes: int
    rows_read: int
    rows_written: int
    read_s: float
    write_s: float


class DiskTier:
    """int64 key -> one fixed-size float32 record in slab files under ``path``.

    The folder is scratch space owned by this object: it starts empty (stale files from an
    earlier process are removed) and its content is only trusted again through
    ``restore`` from a committed snapshot.
    """

    def __init__(self, path: str | Path, width: int, slab_bytes: int = SLAB_BYTES,
                 mapped_bytes: int = 64 << 20, layout: RecordLayout | None = None,
                 key_index: str = "ram", buffer_keys: int = 1 << 20) -> None:
        if key_index not in KEY_INDEXES:
            raise ValueError(f"key_index {key_index!r}: expected one of {KEY_INDEXES}")
        self.path = Path(path)
        self.width = int(width)
        if layout is not None and layout.width != self.width:
            raise ValueError(f"records of {self.width} floats, layout needs {layout.width}")
        # What the records hold, saved with snapshots so a reader decodes them right.
        self.layout = layout
        # Slab pages a read or write maps count in the process's resident set until they
        # are unmapped (they stay in the page cache): unmap after this many bytes.
        self.mapped_bytes = int(mapped_bytes)
        rows = max(1024, slab_bytes // (4 * self.width))
        self.shift = int(rows).bit_length() - 1
        self.slab_rows = 1 << self.shift
        self.mask = self.slab_rows - 1
        self.path.mkdir(parents=True, exist_ok=True)
        lock_fd = _lock_folder(self.path)
        self._unlock = weakref.finalize(self, os.close, lock_fd)
        for old in self.path.glob("slab-*.bin"):
            old.unlink()
        self.index = KeyIndex(16)
        self.last_seen = np.zeros(16, np.int32)
        # key_index="disk": every key in sorted runs beside the slabs (no RAM index or
        # last-seen mirror: ``index`` stays empty, ``last_seen`` unused).
        self.runs = RunIndex(self.path, buffer_keys) if key_index == "disk" else None
        self._maps: list[np.memmap] = []
        self._reserved = 0  # slots whose file blocks are allocated (``_reserve``)
        self._bases = np.zeros(0, np.int64)  # address of each mapped slab, for the kernels
        self._dirty = np.zeros(0, np.bool_)
        # Slabs whose file a snapshot also links: copied before they are written again.
        self._shared = np.zeros(0, np.bool_)
        self.slabs_copied = 0
        self.rows_read = 0
        self.rows_written = 0
        self.read_s = 0.0
        self.write_s = 0.0

    # -- files --------------------------------------------------------------------------
    def slab_path(self, i: int) -> Path:
        return self.path / f"slab-{i:06d}.bin"

    def _open_slab(self, i: int) -> None:
        path = self.slab_path(i)
        size = self.slab_rows * self.width * 4
        if not path.exists() or path.stat().st_size != size:
            with open(path, "ab") as fh:
                fh.truncate(size)  # sparse: blocks are allocated when written
        mm = np.memmap(path, np.float32, "r+", shape=(self.slab_rows, self.width))
        # Rows are read at random: no read-ahead, and no mapping of the 15 neighbouring
        # pages on each fault (they would count in the process's resident set).
        _mapping(mm).madvise(mmap.MADV_RANDOM)
        self._maps.append(mm)
        self._bases = np.array([m.ctypes.data for m in self._maps], np.int64)
        dirty = np.zeros(len(self._maps), np.bool_)
        dirty[:len(self._dirty)] = self._dirty
        dirty[-1] = True
        self._dirty = dirty
        self._shared = grown(self._shared, len(self._maps), double=False)

    def _map(self, i: int) -> None:
        """(Re)map slab ``i`` after its file was replaced."""
        mm = np.memmap(self.slab_path(i), np.float32, "r+", shape=(self.slab_rows, self.width))
        _mapping(mm).madvise(mmap.MADV_RANDOM)
        _mapping(self._maps[i]).close()
        self._maps[i] = mm
        self._bases[i] = mm.ctypes.data

    def _own_slabs(self, slots: np.ndarray) -> None:
        """Give each slab of ``slots`` that a snapshot shares a file of its own before it is
        written: the snapshot's file keeps the bytes it was hashed with."""
        if not self._shared.any():
            return
        touched = np.unique(slots[slots >= 0] >> self.shift)
        for i in touched[self._shared[touched]]:
            self._unshare(int(i))

    def _unshare(self, i: int) -> None:
        path = self.slab_path(i)
        tmp = path.with_name(path.name + ".copy")
        # The rows in use and the blocks reserved ahead of them (``_reserve``): the copy
        # allocates them all, so writes through the mapping never meet a hole.
        rows = min(self.slab_rows, max(self._reserved, self.slot_bound) - i * self.slab_rows)
        try:
            _copy_prefix(path, tmp, max(0, rows) * self.width * 4)
            with open(tmp, "ab") as fh:
                fh.truncate(self.slab_rows * self.width * 4)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise NotWritableError(
                    errno.ENOSPC, f"cannot write {self.path}: no space left on device to "
                    f"copy slab {path.name}, which a checkpoint shares, before writing it"
                ) from None
            raise
        os.replace(tmp, path)
        self._map(i)
        self._shared[i] = False
        self.slabs_copied += 1

    def _ensure_slots(self, bound: int) -> None:
        while len(self._maps) * self.slab_rows < bound:
            self._open_slab(len(self._maps))
        if bound > self._reserved:
            self._reserve(bound)
        if self.runs is None:
            self.last_seen = grown(self.last_seen, bound)

    def _reserve(self, bound: int) -> None:
        """Allocate the slabs' file blocks for slots below ``bound`` (and some ahead).
        Slabs are sparse files written through mappings: on a full disk the first store to
        a hole is a SIGBUS that kills the process without a word, so the blocks are
        claimed here, where no space is an error naming the file."""
        row = 4 * self.width
        end = min(len(self._maps) * self.slab_rows, bound + max(1, RESERVE_BYTES // row))
        try:
            self._allocate(self._reserved, end)
        except OSError as exc:  # room for the rows, maybe, if not for the blocks ahead
            if exc.errno != errno.ENOSPC:
                raise
            end = bound
            try:
                self._allocate(self._reserved, end)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise NotWritableError(
                    errno.ENOSPC, f"cannot write {self.path}: no space left on device for "
                    f"{(end - self._reserved) * row:,} B more of the disk tier's rows"
                ) from None
        self._reserved = end

    def _allocate(self, start: int, end: int) -> None:
        """posix_fallocate the blocks of slots ``start`` to ``end`` in their slabs."""
        row = 4 * self.width
        while start < end:
            slab = start >> self.shift
            stop = min(end, (slab + 1) * self.slab_rows)
            fd = os.open(self.slab_path(slab), os.O_RDWR)
            try:
                os.posix_fallocate(fd, (start & self.mask) * row, (stop - start) * row)
            finally:
                os.close(fd)
            start = stop

    def close(self) -> None:
        """Unmap the slabs (the folder stays locked: ``restore`` maps them again)."""
        self._bases = np.zeros(0, np.int64)
        self._reserved = 0
        for mm in self._maps:
            _mapping(mm).close()
        self._maps = []
        if self.runs is not None:
            self.runs.close()

    def release(self) -> None:
        """Unmap the slabs and unlock the folder for another store."""
        self.close()
        self._unlock()

    # -- rows ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.index) if self.runs is None else len(self.runs)

    @property
    def slot_bound(self) -> int:
        return self.index.slot_bound if self.runs is None else self.runs.slot_bound

    def slots(self, keys: np.ndarray) -> np.ndarray:
        """Slots of distinct ``keys`` (-1 where absent)."""
        return self.index.lookup(keys) if self.runs is None else self.runs.lookup(keys)

    def plan(self, keys: np.ndarray) -> np.ndarray:
        """``slots`` of the next pass's keys, resolved ahead (the disk key index keeps
        them in its hot level until that pass ends)."""
        return self.index.lookup(keys) if self.runs is None else self.runs.plan(keys)

    def __contains__(self, key: int) -> bool:
        return bool(self.slots(np.array([key], np.int64))[0] >= 0)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        return self.slots(keys) >= 0

    def read(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Records of ``keys`` (zeros where absent) and the found mask."""
        slots = self.slots(keys)
        return self.read_slots(slots), slots >= 0

    @property
    def _chunk_rows(self) -> int:
        """Rows per kernel call: what maps at most ``mapped_bytes`` of slab pages."""
        page_span = 4096 * (2 + 4 * self.width // 4096)
        return max(256, self.mapped_bytes // page_span)

    def _chunks(self, slots: np.ndarray, prefetch: bool = False):
        """Positions of ``slots`` in slot order, in chunks; after each chunk, the slab
        pages it mapped (one contiguous address range per slab) are unmapped again.
        ``prefetch`` (reads): the next chunk's pages are asked for before this chunk is
        read, so that the disk sees thousands of reads at once rather than one page
        fault at a time: a table larger than the page cache, read in key order, is
        otherwise read at one page per disk round trip (docs/tiered-store.md)."""
        order = np.argsort(slots, kind="stable")
        order = order[slots[order] >= 0]
        step = self._chunk_rows
        if prefetch and len(order):
            self._prefetch(slots, order[:step])
        for start in range(0, len(order), step):
            part = order[start:start + step]
            if prefetch and start + step < len(order):
                self._prefetch(slots, order[start + step:start + 2 * step])
            yield part
            self._unmap(int(slots[part[0]]), int(slots[part[-1]]))

    def _prefetch(self, slots: np.ndarray, part: np.ndarray) -> None:
        """Start reading the pages of the records at ``slots[part]`` (MADV_WILLNEED:
        into the page cache, not this process's resident set)."""
        starts = np.empty(len(part), np.int64)
        lengths = np.empty(len(part), np.int64)
        n = _page_runs(self._bases, slots, part, self.shift, self.mask, 4 * self.width,
                       mmap.PAGESIZE, starts, lengths)
        for address, size in zip(starts[:n].tolist(), lengths[:n].tolist(), strict=True):
            madvise(address, size, mmap.MADV_WILLNEED)

    def _unmap(self, first: int, last: int) -> None:
        row = 4 * self.width
        for slab in range(first >> self.shift, (last >> self.shift) + 1):
            lo = (first & self.mask) * row if slab == first >> self.shift else 0
            hi = ((last & self.mask) + 1) * row if slab == last >> self.shift else \
                self.slab_rows * row
            lo -= lo % mmap.PAGESIZE
            _mapping(self._maps[slab]).madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def read_slots(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Records at ``slots`` (zeros where a slot is -1), into ``out`` if given."""
        t0 = time.perf_counter()
        slots = np.ascontiguousarray(slots, np.int64)
        if out is None:
            out = np.zeros((len(slots), self.width), np.float32)
        else:
            out[slots < 0] = 0
        if len(slots) and len(self._bases):
            for part in self._chunks(slots, prefetch=True):
                _gather(self._bases, slots, part, self.shift, self.mask, out)
        self.rows_read += int((slots >= 0).sum())
        self.read_s += time.perf_counter() - t0
        return out

    def write(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Insert or overwrite the records of ``keys`` (unique)."""
        if not len(keys):
            return
        t0 = time.perf_counter()
        records = np.ascontiguousarray(records, np.float32)
        if self.runs is not None:
            slots = self.runs.assign(keys, records[:, -1].view(np.int32))
        else:
            slots = self.index.lookup(keys)
            new = slots < 0
            if new.any():  # insert only the new keys: the index reserves room per new key
                slots[new], _ = self.index.lookup_or_insert(keys[new])
        self._ensure_slots(self.slot_bound)
        self._own_slabs(slots)
        for part in self._chunks(slots):
            _scatter(self._bases, slots, part, self.shift, self.mask, records, self._dirty)
        if self.runs is None:
            self.last_seen[slots] = records[:, -1].view(np.int32)
        self.rows_written += len(keys)
        self.write_s += time.perf_counter() - t0

    def remove(self, keys: np.ndarray) -> np.ndarray:
        """Drop ``keys``; returns the mask of those that were present. Their slots are
        recycled, so the stale record is overwritten by the next key that takes it."""
        if self.runs is not None:
            return self.runs.remove(keys) >= 0
        slots = self.index.remove(keys)
        present = slots >= 0
        self.last_seen[slots[present]] = 0
        return present

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (key, slot): slot order (RAM index) or key order (disk index)."""
        return self.index.items() if self.runs is None else self.runs.items()

    def seen_items(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every (key, slot, last_seen), from the mirror or the runs."""
        if self.runs is not None:
            return self.runs.items_seen()
        keys, slots = self.index.items()
        return keys, slots, self.last_seen[slots]

    def end_pass(self) -> None:
        """Pass end: the disk key index flushes its changes and forgets the keys not
        planned for the next pass; slab pages are unmapped."""
        if self.runs is not None:
            self.runs.end_pass()
        self.release_pages()

    def release_pages(self) -> None:
        """Unmap the slab pages this process touched (they stay in the page cache): keeps
        the process's resident set bounded by one pass of disk traffic, not the table."""
        for mm in self._maps:
            _mapping(mm).madvise(mmap.MADV_DONTNEED)
        if self.runs is not None:
            self.runs.release_pages()

    def flush(self) -> None:
        """Write dirty mapped pages to the files and wait for them (msync)."""
        for mm in self._maps:
            mm.flush()

    # -- stats --------------------------------------------------------------------------
    @property
    def ram_bytes(self) -> int:
        """RAM this tier holds per key: its index and the last-seen mirror."""
        if self.runs is not None:
            return self.runs.nbytes
        return self.index.nbytes + self.last_seen.nbytes

    @property
    def fixed_bytes(self) -> int:
        """RAM the budget reserves for the key index: a RAM index twice (its size after
        the next doubling) and its mirror; the disk index's directories and its hot level's
        reservation (``RunIndex.reserved_bytes``)."""
        if self.runs is not None:
            return self.runs.reserved_bytes
        return 2 * self.index.nbytes + self.last_seen.nbytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes the slab files take on disk (allocated blocks): a slab is a sparse file
        created at its full size, so its apparent size says nothing of the rows held."""
        return sum(self.slab_path(i).stat().st_blocks * 512 for i in range(len(self._maps)))

    def stats(self) -> DiskStats:
        return DiskStats(len(self), len(self._maps), self.allocated_bytes, self.ram_bytes,
                         self.rows_read, self.rows_written, self.read_s, self.write_s)

    # -- snapshots ----------------------------------------------------------------------
    def snapshot(self, dst: Path, previous: Path | None,
                 previous_digests: dict[str, str]) -> dict[str, str]:
        """Write the tier into the empty folder ``dst``; returns {file name: sha256}.

        Slabs unchanged since the snapshot in ``previous`` are hard-linked from it (the
        files of a committed snapshot are never written again); the others are
        hard-linked from the live files after an msync, and marked shared, so that the
        next write to one copies it first (``_unshare``). Where ``dst`` is on another
        filesystem they are copied. Every file is fsynced by the caller's commit.
        """
        self.flush()
        dst.mkdir(parents=True, exist_ok=True)
        digests: dict[str, str] = {}
        for i in range(len(self._maps)):
            name = self.slab_path(i).name
            old = previous / name if previous is not None else None
            if (not self._dirty[i] and old is not None and old.exists()
                    and name in previous_digests):
                os.link(old, dst / name)
                digests[name] = previous_digests[name]
            else:
                try:
                    os.link(self.slab_path(i), dst / name)
                    self._shared[i] = True
                except OSError as exc:
                    if exc.errno != errno.EXDEV:
                        raise
                    used = min(self.slab_rows, self.slot_bound - i * self.slab_rows)
                    _copy_prefix(self.slab_path(i), dst / name, max(0, used) * self.width * 4)
                digests[name] = sha256_file(dst / name)
        meta = np.array([self.width, self.slab_rows, len(self._maps)], np.int64)
        metadata = {"layout": self.layout.to_json()} if self.layout else {}
        if self.runs is not None:
            # The immutable runs are hard-linked; the index file lists them.
            arrays, manifest = self.runs.snapshot(dst)
            metadata["key_runs"] = manifest
            for name in self.runs.snapshot_files(manifest):  # not ``runs.runs``: merged since
                digests[name] = previous_digests.get(name) or sha256_file(dst / name)
            arrays = {"keys": np.empty(0, np.int64), "slots": np.empty(0, np.int64),
                      **arrays}
        else:
            keys, slots = self.index.items()
            arrays = {"keys": keys, "slots": slots}
        save_numpy({**arrays, "meta": meta}, str(dst / INDEX_FILE),
                   metadata=metadata or None)
        digests[INDEX_FILE] = sha256_file(dst / INDEX_FILE)
        return digests

    def mark_clean(self) -> None:
        """The last snapshot is committed: from now on only slabs written again differ."""
        self._dirty[:] = False

    def restore(self, src: Path) -> None:
        """Replace the live tier by the snapshot in ``src``: its slab files are hard-linked
        (shared until written, ``_unshare``), copied where they are shorter than a slab
        (older snapshots held only the rows in use) or on another filesystem."""
        arrays = load_numpy(str(src / INDEX_FILE))
        width, slab_rows, n_slabs = (int(x) for x in arrays["meta"])
        if self.layout is not None:
            saved = snapshot_layout(src, self.layout.row_dim, self.layout.state_dim)
            if saved != self.layout:
                raise ValueError(
                    f"{src}: the snapshot holds {saved.describe()}; this store keeps "
                    f"{self.layout.describe()}. Use the settings it was trained with "
                    "(--precision, --variable-dims, --promote-at, optimizer), or load it "
                    "into an in-memory store, which re-encodes rows")
        if width != self.width:
            raise ValueError(f"{src}: records of {width} floats, this store uses {self.width}")
        self.close()
        for old in self.path.glob("slab-*.bin"):
            old.unlink()
        self.shift = int(slab_rows).bit_length() - 1
        self.slab_rows, self.mask = slab_rows, slab_rows - 1
        self._dirty = np.zeros(0, np.bool_)
        self._shared = np.zeros(0, np.bool_)
        full = self.slab_rows * self.width * 4
        linked = np.zeros(n_slabs, np.bool_)
        for i in range(n_slabs):
            slab_file = src / self.slab_path(i).name
            if slab_file.stat().st_size == full:
                try:
                    os.link(slab_file, self.slab_path(i))
                    linked[i] = True
                except OSError as exc:
                    if exc.errno != errno.EXDEV:
                        raise
            if not linked[i]:
                shutil.copyfile(slab_file, self.slab_path(i))
            self._open_slab(i)
        self._dirty[:] = False
        self._shared[:n_slabs] = linked
        manifest = _key_runs(src)
        if self.runs is not None and manifest is not None:
            self.runs.restore(src, arrays, manifest)
            return
        keys, slots = snapshot_key_slots(src, arrays)
        seen = np.zeros(len(slots), np.int32)
        for lo in range(0, len(slots), 1 << 20):
            part = slots[lo:lo + (1 << 20)]
            seen[lo:lo + len(part)] = self.read_slots(part)[:, -1].view(np.int32)
        self.release_pages()
        if self.runs is not None:
            self.runs.load_items(keys, slots, seen)
            return
        self.index = KeyIndex.from_items(keys, slots)
        self.last_seen = np.zeros(max(16, self.index.slot_bound), np.int32)
        self.last_seen[slots] = seen


def _key_runs(src: Path) -> str | None:
    """The run manifest of a snapshot written with the disk key index, else None."""
    with safe_open(str(Path(src) / INDEX_FILE), "np") as fh:
        return (fh.metadata() or {}).get("key_runs")


def snapshot_key_slots(src: Path, arrays: dict[str, np.ndarray] | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Every (key, slot) of a disk snapshot, whichever key index wrote it (the runs are
    merged: O(keys) RAM, for readers and restores into a RAM index)."""
    arrays = arrays if arrays is not None else load_numpy(str(Path(src) / INDEX_FILE))
    manifest = _key_runs(src)
    if manifest is None:
        return arrays["keys"], arrays["slots"]
    keys, slots, _ = read_run_items(Path(src), manifest)
    return keys, slots


def snapshot_key_count(src: Path) -> int:
    """Keys in a disk snapshot, without reading them."""
    manifest = _key_runs(src)
    if manifest is not None:
        return int(json.loads(manifest)["size"])
    with safe_open(str(Path(src) / INDEX_FILE), "np") as fh:
        return int(fh.get_slice("keys").get_shape()[0])


def _lock_folder(path: Path) -> int:
    """Hold an exclusive lock on ``path`` for this process's lifetime: a second store on
    the same folder would wipe and overwrite the first one's rows."""
    fd = try_lock_file(path / ".lock")
    if fd is None:
        raise RuntimeError(f"{path}: store folder in use by another process")
    return fd


def _copy_prefix(src: Path, dst: Path, nbytes: int) -> None:
    """Copy the first ``nbytes`` of ``src``: a slab's rows past the highest slot in use
    are empty and stay out of checkpoints (``restore`` extends the file again)."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        offset = 0
        while offset < nbytes:
            sent = os.sendfile(fout.fileno(), fin.fileno(), offset, nbytes - offset)
            if sent == 0:
                raise OSError(f"{src}: shorter than {nbytes} bytes")
            offset += sent


def snapshot_layout(src: Path, row_dim: int | None = None,
                    state_dim: int | None = None) -> RecordLayout:
    """The record layout of the disk snapshot in ``src``. Snapshots from before layouts
    were recorded hold fp32 rows: their layout follows from ``row_dim`` and the record
    width. ``row_dim`` / ``state_dim``, when given, must match the saved layout."""
    with safe_open(str(src / INDEX_FILE), "np") as fh:
        text = (fh.metadata() or {}).get("layout")
        width = int(fh.get_tensor("meta")[0])
    if text is None:
        if row_dim is None:
            raise ValueError(f"{src}: fp32 snapshot without a layout; row_dim needed")
        layout = RecordLayout(row_dim, width - row_dim - 3)
    else:
        layout = RecordLayout.from_json(text)
    if (row_dim is not None and row_dim != layout.row_dim) or (
            state_dim is not None and state_dim != layout.state_dim):
        raise ValueError(f"{src}: the snapshot holds {layout.describe()}, expected rows of "
                         f"{row_dim} with {state_dim} optimizer state floats")
    if layout.width != width:
        raise ValueError(f"{src}: records of {width} floats do not match "
                         f"{layout.describe()} ({layout.width} floats)")
    return layout


def read_snapshot_rows(src: Path, row_dim: int | None = None, state_dim: int | None = None,
                       values: bool = True, chunk: int = 1 << 20):
    """Yield (keys, columns) chunks of a disk snapshot, decoded through its layout
    (``RecordLayout.decode``): the one way records are read outside the store."""
    layout = snapshot_layout(Path(src), row_dim, state_dim)
    for keys, rec in read_snapshot_records(Path(src), chunk):
        yield keys, layout.decode(rec, values=values)


def read_snapshot_records(src: Path, chunk: int = 1 << 20):
    """Yield (keys, records) chunks of a disk snapshot without loading it whole."""
    arrays = load_numpy(str(src / INDEX_FILE))
    width, slab_rows, _ = (int(x) for x in arrays["meta"])
    keys, slots = snapshot_key_slots(src, arrays)
    order = np.argsort(slots, kind="stable")
    keys, slots = keys[order], slots[order]
    shift = int(slab_rows).bit_length() - 1
    for start in range(0, len(keys), chunk):
        k, s = keys[start:start + chunk], slots[start:start + chunk]
        out = np.empty((len(k), width), np.float32)
        for slab in np.unique(s >> shift):
            sel = (s >> shift) == slab
            path = src / f"slab-{int(slab):06d}.bin"
            rows = path.stat().st_size // (4 * width)
            mm = np.memmap(path, np.float32, "r", shape=(rows, width))
            out[sel] = mm[s[sel] & (slab_rows - 1)]
            del mm
        yield k, out


def iter_snapshot_sorted(src: Path, chunk_rows: int = 1 << 16):
    """Yield (keys, records) chunks of a disk snapshot in increasing key order.

    RAM: the snapshot's key index (16 B per key, as a live store holds it) and its key
    order (8 B per key), plus one chunk; each chunk reads its records front to back by
    slot, and the slab pages it mapped are unmapped again after it.
    """
    src = Path(src)
    arrays = load_numpy(str(src / INDEX_FILE))
    width, slab_rows, _ = (int(x) for x in arrays["meta"])
    keys, slots = snapshot_key_slots(src, arrays)
    order = np.argsort(keys, kind="stable")
    shift = int(slab_rows).bit_length() - 1
    for lo in range(0, len(order), max(1, chunk_rows)):
        sel = order[lo:lo + chunk_rows]
        k, s = keys[sel], slots[sel]
        out = np.empty((len(k), width), np.float32)
        slab_of = s >> shift
        for slab in np.unique(slab_of):
            at = np.flatnonzero(slab_of == slab)
            at = at[np.argsort(s[at], kind="stable")]
            path = src / f"slab-{int(slab):06d}.bin"
            mm = np.memmap(path, np.float32, "r", shape=(path.stat().st_size // (4 * width),
                                                         width))
            out[at] = mm[s[at] & (slab_rows - 1)]
            del mm
        yield k, out


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def madvise(address: int, size: int, advice: int) -> None:
    """madvise(2) on a raw address range: part of a numpy array or of a slab's map,
    which Python's ``mmap.madvise`` cannot name."""
    _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), advice)


def _mapping(mm: np.memmap) -> mmap.mmap:
    """The mmap under a numpy memmap, for madvise / close (numpy keeps it private)."""
    return mm._mmap  # type: ignore[attr-defined]
