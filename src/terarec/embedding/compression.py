"""Compressed row values for the store: fewer bytes per value, fewer values per key.

``CodedRows`` stands in for the store's ``float32[slots, row_dim]`` values array. It is
indexed like one (``rows[slots]`` decodes, ``rows[slots] = values`` encodes), so code that
reads or writes rows by slot keeps working, while each row is kept as the bytes of
``quant.encode_rows`` at its precision. Training never sees codes: pull decodes into the
float32 working set, push encodes back (with stochastic rounding if asked, so small
updates survive on average). Optimizer state stays float32 next to the codes: it is read
and written in the same places, and quantising Adagrad accumulators or Adam moments
changes the optimizer's arithmetic, not just its storage.

Variable-length rows: a key's *width class* follows its show count. Rare keys keep only
the first few columns, frequent ones the full row::

    FrequencyClasses(widths=(1, 4, 16), promote_at=(10, 100))
        shows <  10  -> 1 value      (columns 1.. read as zero)
        shows < 100  -> 4 values
        otherwise    -> 16 values

Each class has its own pool of fixed-size encoded rows, so a rare key costs the bytes of
its short row, not of a padded full one. Rows are read zero-padded to ``row_dim``. When a
key is promoted its row is re-homed in the wider pool with zeros in the new columns, so
the model's output does not change at that moment; the working set then lets the
gradient reach the new columns (see ``RowBlock.widths``).

Narrow rows are where a row-wise scale and bias cost most: int8 needs 8 tail bytes, so a
1-value int8 row takes 9 bytes against 2 for fp16. A class's precision therefore falls
back to fp16 wherever fp16 takes no more bytes (it is also the finer format there).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from terarec.embedding.quant import PRECISIONS, Precision, decode_rows, encode_rows, row_bytes
from terarec.kernels import grown

STORE_PRECISIONS: tuple[Precision, ...] = ("fp32", "fp16", "int8", "int4")


@dataclass(frozen=True)
class FrequencyClasses:
    """Width classes by show count: ``widths`` ascending (the last is the full row),
    ``promote_at[i]`` the show count from which a key has at least ``widths[i + 1]``."""

    widths: tuple[int, ...]
    promote_at: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        w, t = self.widths, self.promote_at
        if not w or any(x < 1 for x in w) or list(w) != sorted(set(w)):
            raise ValueError(f"variable dims: widths must be strictly ascending positive "
                             f"integers, got {w}")
        if len(t) != len(w) - 1:
            raise ValueError(f"variable dims: {len(w) - 1} promotion thresholds needed for "
                             f"widths {w}, got {len(t)}: {t}")
        if list(t) != sorted(set(t)) or any(x <= 0 for x in t):
            raise ValueError(f"variable dims: promotion show counts must be strictly "
                             f"ascending and positive, got {t}")

    @classmethod
    def from_config(cls, row_dim: int, variable_dims: tuple[int, ...],
                    promote_at: tuple[float, ...]) -> FrequencyClasses:
        """Classes from ``StoreConfig.variable_dims`` (the widths below the full row)."""
        if any(d >= row_dim for d in variable_dims):
            raise ValueError(f"variable_dims {variable_dims} must all be below the row width "
                             f"{row_dim}")
        return cls(tuple(int(d) for d in variable_dims) + (row_dim,),
                   tuple(float(x) for x in promote_at))

    def classify(self, show: np.ndarray) -> np.ndarray:
        """Class index (int8) of keys with these show counts."""
        return np.searchsorted(np.asarray(self.promote_at, np.float64),
                               np.asarray(show, np.float64), side="right").astype(np.int8)


def class_precision(precision: Precision, width: int) -> Precision:
    """``precision``, or fp16 where a row of ``width`` takes no more bytes in fp16."""
    if precision in ("fp32", "fp16"):
        return precision
    return "fp16" if row_bytes("fp16", width) <= row_bytes(precision, width) else precision


class _Pool:
    """Fixed-size encoded rows with recycled positions."""

    def __init__(self, nbytes: int, capacity: int = 16) -> None:
        self.codes = np.zeros((capacity, nbytes), np.uint8)
        self._free = np.empty(0, np.int64)
        self._top = 0  # positions below it were handed out at least once

    @property
    def used(self) -> int:
        return self._top - len(self._free)

    def alloc(self, n: int) -> np.ndarray:
        reuse = min(n, len(self._free))
        pos = np.concatenate([self._free[len(self._free) - reuse:],
                              np.arange(self._top, self._top + n - reuse, dtype=np.int64)])
        self._free = self._free[:len(self._free) - reuse]
        self._top += n - reuse
        self.codes = grown(self.codes, self._top)
        return pos

    def free(self, pos: np.ndarray) -> None:
        self._free = np.concatenate([self._free, pos.astype(np.int64)])


class CodedRows:
    """Row values of a store kept encoded, indexed by slot like a float32 array.

    ``rows[slots]`` -> ``float32[n, row_dim]`` (short rows zero-padded);
    ``rows[slots] = values`` encodes each row at its slot's class (columns past its
    width are dropped); a slot never assigned a class gets the narrowest class that
    holds its nonzero columns. ``set_class`` places rows in a class explicitly and
    ``release`` frees evicted slots.
    """

    def __init__(self, row_dim: int, precision: Precision = "fp32", *,
                 classes: FrequencyClasses | None = None,
                 class_precisions: tuple[Precision, ...] = (), stochastic: bool = False,
                 seed: int = 0, capacity: int = 16) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
        self.row_dim = row_dim
        self.classes = classes or FrequencyClasses((row_dim,))
        if self.classes.widths[-1] != row_dim:
            raise ValueError(f"the widest class must be the full row ({row_dim}), got "
                             f"{self.classes.widths}")
        widths = self.classes.widths
        if class_precisions and len(class_precisions) != len(widths):
            raise ValueError(f"{len(widths)} class precisions needed for widths {widths}, "
                             f"got {class_precisions}")
        for p in class_precisions:
            if p not in PRECISIONS:
                raise ValueError(f"unknown precision {p!r}; expected one of {PRECISIONS}")
        self.precisions: tuple[Precision, ...] = tuple(class_precisions) or tuple(
            class_precision(precision, w) for w in widths)
        self.class_bytes = tuple(row_bytes(p, w) for p, w in zip(self.precisions, widths,
                                                                 strict=True))
        self.stochastic = stochastic
        self._rng = np.random.default_rng(seed)
        # One class: the pool is indexed by slot, no per-slot bookkeeping.
        self._direct = len(widths) == 1
        self.pools = [_Pool(b, capacity if self._direct else 16) for b in self.class_bytes]
        self.cls = np.full(0 if self._direct else capacity, -1, np.int8)
        # int32 positions: 2**31 rows per class and process, 4 bytes a key instead of 8.
        self.pos = np.full(0 if self._direct else capacity, -1, np.int32)
        self._direct_live = 0

    # -- array-like access --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.pools[0].codes) if self._direct else len(self.cls)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self), self.row_dim)

    def grow(self, capacity: int) -> None:
        """Room for slots ``0 .. capacity - 1``."""
        if capacity <= len(self):
            return
        if self._direct:
            pool = self.pools[0]
            pool.codes = grown(pool.codes, capacity, double=False)
            return
        for name in ("cls", "pos"):
            setattr(self, name, grown(getattr(self, name), capacity, fill=-1, double=False))

    def __getitem__(self, slots) -> np.ndarray:
        slots = self._slots(slots)
        if self._direct:
            return decode_rows(self.pools[0].codes[slots], self.precisions[0], self.row_dim)
        out = np.zeros((len(slots), self.row_dim), np.float32)
        cls = self.cls[slots]
        for c, width in enumerate(self.classes.widths):
            mask = cls == c
            if mask.any():
                codes = self.pools[c].codes[self.pos[slots[mask]]]
                out[mask, :width] = decode_rows(codes, self.precisions[c], width)
        return out

    def __setitem__(self, slots, values) -> None:
        slots = self._slots(slots)
        values = np.broadcast_to(np.asarray(values, np.float32), (len(slots), self.row_dim))
        if self._direct:
            self.pools[0].codes[slots] = self._encode(values, 0)
            return
        unassigned = self.cls[slots] < 0
        if unassigned.any():
            self.set_class(slots[unassigned], self._narrowest(values[unassigned]))
        cls = self.cls[slots]
        for c, width in enumerate(self.classes.widths):
            mask = cls == c
            if mask.any():
                self.pools[c].codes[self.pos[slots[mask]]] = self._encode(
                    values[mask, :width], c)

    # -- classes ------------------------------------------------------------------------
    def widths_of(self, slots: np.ndarray) -> np.ndarray:
        """Stored width (int32) of each slot's row."""
        if self._direct:
            return np.full(len(slots), self.row_dim, np.int32)
        widths = np.asarray(self.classes.widths, np.int32)
        return widths[np.maximum(self.cls[slots], 0)]

    def set_class(self, slots: np.ndarray, classes: np.ndarray) -> np.ndarray:
        """Move rows to ``classes`` (values kept, zero-padded or cut); returns the mask of
        slots whose class changed. Unassigned slots get a zero row in their class."""
        slots = self._slots(slots)
        classes = np.asarray(classes, np.int8)
        if self._direct:
            return np.zeros(len(slots), bool)
        old = self.cls[slots]
        moved = old != classes
        if not moved.any():
            return moved
        slots, classes, old = slots[moved], classes[moved], old[moved]
        assigned = old >= 0
        values = np.zeros((len(slots), self.row_dim), np.float32)
        values[assigned] = self[slots[assigned]]
        for c in range(len(self.pools)):
            leaving = old == c
            if leaving.any():
                self.pools[c].free(self.pos[slots[leaving]])
        for c in range(len(self.pools)):
            joining = classes == c
            if joining.any():
                self.pos[slots[joining]] = self.pools[c].alloc(int(joining.sum()))
        self.cls[slots] = classes
        self[slots] = values
        return moved

    def release(self, slots: np.ndarray) -> None:
        """Forget evicted slots' rows (their pool positions are reused)."""
        slots = self._slots(slots)
        if self._direct:
            self.pools[0].codes[slots] = 0
            return
        for c in range(len(self.pools)):
            leaving = self.cls[slots] == c
            if leaving.any():
                self.pools[c].free(self.pos[slots[leaving]])
        self.cls[slots] = -1
        self.pos[slots] = -1

    # -- encoded bytes, for tiers that move rows without re-encoding them ----------------
    @property
    def variable(self) -> bool:
        """True when rows have more than one width class."""
        return not self._direct

    def read_codes(self, slots: np.ndarray, out: np.ndarray) -> None:
        """Copy the encoded rows of ``slots`` into ``out`` (``uint8[n, >= max class
        bytes]``), each in its first ``class_bytes[class]`` bytes; the rest is untouched."""
        slots = self._slots(slots)
        if self._direct:
            out[:, :self.class_bytes[0]] = self.pools[0].codes[slots]
            return
        cls = self.cls[slots]
        for c, nbytes in enumerate(self.class_bytes):
            sel = np.flatnonzero(cls == c)
            if len(sel):
                out[sel, :nbytes] = self.pools[c].codes[self.pos[slots[sel]]]

    def write_codes(self, slots: np.ndarray, classes: np.ndarray, codes: np.ndarray) -> None:
        """Store encoded rows as they are: row i of class ``classes[i]`` is the first
        ``class_bytes[classes[i]]`` bytes of ``codes[i]``. Moving a row between tiers this
        way never re-encodes it, so its decoded values do not move."""
        slots = self._slots(slots)
        if self._direct:
            self.pools[0].codes[slots] = codes[:, :self.class_bytes[0]]
            return
        classes = np.asarray(classes, np.int8)
        old = self.cls[slots]
        moved = old != classes
        for c, pool in enumerate(self.pools):
            leaving = moved & (old == c)
            if leaving.any():
                pool.free(self.pos[slots[leaving]])
        for c, pool in enumerate(self.pools):
            joining = moved & (classes == c)
            if joining.any():
                self.pos[slots[joining]] = pool.alloc(int(joining.sum()))
        self.cls[slots] = classes
        for c, nbytes in enumerate(self.class_bytes):
            sel = np.flatnonzero(classes == c)
            if len(sel):
                self.pools[c].codes[self.pos[slots[sel]]] = codes[sel, :nbytes]

    def slot_arrays(self) -> list[np.ndarray]:
        """The arrays indexed by slot: moving a row to another slot moves their entries
        (the codes with one class; class and pool position with several)."""
        return [self.pools[0].codes] if self._direct else [self.cls, self.pos]

    def truncate(self, n: int) -> None:
        """Only slots below ``n`` hold rows now (rows were moved down through
        ``slot_arrays``): forget the slots past them and repack each pool into the
        positions in use, so the pools shrink with the rows."""
        if self._direct:
            return
        self.cls[n:] = -1
        self.pos[n:] = -1
        cls = self.cls[:n]
        for c, pool in enumerate(self.pools):
            live = np.flatnonzero(cls == c)
            codes = np.zeros((max(16, len(live)), pool.codes.shape[1]), np.uint8)
            codes[:len(live)] = pool.codes[self.pos[live]]
            pool.codes, pool._free, pool._top = codes, np.empty(0, np.int64), len(live)
            self.pos[live] = np.arange(len(live), dtype=np.int32)

    # -- sizes --------------------------------------------------------------------------
    def value_bytes(self, live_slots: np.ndarray) -> int:
        """Encoded bytes (values + scale/bias) held by the rows of ``live_slots``."""
        if self._direct:
            return len(live_slots) * self.class_bytes[0]
        return int(np.asarray(self.class_bytes)[self.cls[live_slots]].sum())

    def class_counts(self, live_slots: np.ndarray) -> np.ndarray:
        """Keys per width class."""
        if self._direct:
            return np.array([len(live_slots)], np.int64)
        return np.bincount(self.cls[live_slots], minlength=len(self.pools)).astype(np.int64)

    @property
    def overhead_bytes_per_slot(self) -> int:
        """Bookkeeping per slot on top of the codes (class and pool position)."""
        return 0 if self._direct else self.cls.itemsize + self.pos.itemsize

    # -- helpers ------------------------------------------------------------------------
    def _encode(self, values: np.ndarray, c: int) -> np.ndarray:
        return encode_rows(values, self.precisions[c], stochastic=self.stochastic,
                           rng=self._rng)

    def _narrowest(self, values: np.ndarray) -> np.ndarray:
        """Narrowest class whose width holds every nonzero column of each row."""
        nonzero = values != 0
        used = np.where(nonzero.any(axis=1),
                        self.row_dim - np.argmax(nonzero[:, ::-1], axis=1), 0)
        return np.searchsorted(np.asarray(self.classes.widths), used, side="left").astype(
            np.int8)

    def _slots(self, slots) -> np.ndarray:
        if isinstance(slots, slice):
            return np.arange(*slots.indices(len(self)), dtype=np.int64)
        slots = np.asarray(slots)
        if slots.dtype == bool:
            return np.flatnonzero(slots)
        return slots.astype(np.int64, copy=False).reshape(-1)


def make_row_values(row_dim: int, precision: Precision, variable_dims: tuple[int, ...],
                    promote_at: tuple[float, ...], *, class_precisions: tuple[str, ...] = (),
                    stochastic: bool = False, seed: int = 0,
                    capacity: int = 16) -> CodedRows | None:
    """The store's coded values, or None where plain float32 rows are asked for."""
    if precision not in STORE_PRECISIONS:
        raise ValueError(f"store precision must be one of {STORE_PRECISIONS}, got "
                         f"{precision!r} (1-2 bit codes are for export only)")
    if precision == "fp32" and not variable_dims and not class_precisions:
        return None
    classes = FrequencyClasses.from_config(row_dim, variable_dims, promote_at)
    return CodedRows(row_dim, precision, classes=classes,
                     class_precisions=tuple(class_precisions),  # type: ignore[arg-type]
                     stochastic=stochastic, seed=seed, capacity=capacity)
