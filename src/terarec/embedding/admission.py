"""Admission: which keys absent from the store get a row now, and what is remembered of
the others.

Every policy answers ``admit(keys, show, click, pass)`` for the unique absent keys of a
pass with the keys admitted now and the shows and clicks they gathered in earlier passes
(the store seeds their counters with them). Keys not admitted train against the shared
zero row; what a policy keeps of them is its only per-key cost::

    policy          config                                  state of waiting keys
    all             admit_min_count <= 1                     none
    exact count     admit_min_count / admit_min_clicks       hash table: 44-76 B per key
    sketch count    ... + admit_sketch_bytes                 fixed: a count-min sketch
    probability     admit_probability                        none (a hash per key and pass)

The sketch is a count-min sketch with conservative update (Estan and Varghese):
``depth`` rows of saturating counters as narrow as the thresholds allow (2 bits for a
count of 2), one plane for shows and one for clicks when a click threshold is set. Its
estimate never undercounts, so a key is never admitted later than an exact count would
admit it; collisions admit some keys early. Its RAM is fixed by ``admit_sketch_bytes``
whatever the stream, where the exact table grows with every key ever seen once.

State that a resumed run needs (so that it admits exactly the keys an uninterrupted one
would) comes and goes as arrays named ``cand_*`` (rows of waiting keys, ordered by
``cand_keys``) and ``admission_sketch`` (store-wide: every rank of a re-sharded run gets
the sum of the saved sketches, an over-estimate, which admission tolerates).
"""

from __future__ import annotations

from typing import Protocol

import numba
import numpy as np

from terarec.config import StoreConfig, parse_bytes
from terarec.embedding.index import KeyIndex
from terarec.kernels import GOLDEN_GAMMA, grown, splitmix64, splitmix64_array

SKETCH_ARRAY = "admission_sketch"
SKETCH_DEPTH = 4
SKETCH_MAX = 255  # the widest counters, a byte, saturate here


def is_admission_array(name: str) -> bool:
    """Whether a saved store array is admission state (``Admission.arrays``)."""
    return name.startswith("cand_") or name == SKETCH_ARRAY


class Admission(Protocol):
    """What a store asks of its admission policy."""

    # Every key gets a row on first sight: the store skips admission entirely.
    admits_all: bool

    def admit(self, keys: np.ndarray, show: np.ndarray, click: np.ndarray,
              pass_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Of the unique absent ``keys`` (with this pass's shows and clicks): the keys
        admitted now, in ``keys`` order, and their shows and clicks of earlier passes."""
        ...

    def expire(self, cutoff: int) -> None:
        """Forget waiting keys last seen in pass ``cutoff`` or before (TTL)."""
        ...

    @property
    def nbytes(self) -> int:
        """RAM held for keys not admitted yet."""
        ...

    @property
    def candidate_count(self) -> int:
        """Keys waiting with per-key state (0 where the policy keeps none)."""
        ...

    def arrays(self) -> dict[str, np.ndarray]: ...

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None: ...


def _nothing(n: int) -> np.ndarray:
    return np.zeros(n, np.float32)


def no_candidates() -> dict[str, np.ndarray]:
    """The candidate arrays of a policy that keeps no waiting keys: empty, so that every
    saved store has the same columns (and files read the same as before the policies)."""
    return {"cand_keys": np.empty(0, np.int64), "cand_show": _nothing(0),
            "cand_click": _nothing(0), "cand_seen": np.empty(0, np.int32)}


class _Stateless:
    """A policy that remembers nothing between passes: nothing to expire or checkpoint."""

    nbytes = 0
    candidate_count = 0

    def expire(self, cutoff: int) -> None:
        pass

    def arrays(self) -> dict[str, np.ndarray]:
        return no_candidates()

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        pass


class AdmitAll(_Stateless):
    """Every key is admitted on first sight; nothing kept."""

    admits_all = True

    def admit(self, keys: np.ndarray, show: np.ndarray, click: np.ndarray,
              pass_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return keys, _nothing(len(keys)), _nothing(len(keys))


class ExactCount:
    """Exact shows and clicks of every waiting key in a hash table; a key is admitted once
    it has ``min_show`` shows and ``min_click`` clicks."""

    admits_all = False

    def __init__(self, min_show: float, min_click: float = 0.0) -> None:
        self.min_show = min_show
        self.min_click = min_click
        self._load(np.empty(0, np.int64), {})

    def _load(self, keys: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        n = len(keys)
        self._index = KeyIndex.from_items(keys, np.arange(n, dtype=np.int64)) if n \
            else KeyIndex(16)
        size = _capacity(n)
        self._show = np.zeros(size, np.float32)
        self._click = np.zeros(size, np.float32)
        self._seen = np.zeros(size, np.int32)
        if n:
            self._show[:n] = arrays["cand_show"]
            self._click[:n] = arrays["cand_click"]
            self._seen[:n] = arrays["cand_seen"]

    def admit(self, keys: np.ndarray, show: np.ndarray, click: np.ndarray,
              pass_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        slots, _ = self._index.lookup_or_insert(keys)
        need = _capacity(self._index.slot_bound)
        self._show = grown(self._show, need)
        self._click = grown(self._click, need)
        self._seen = grown(self._seen, need)
        self._show[slots] += show
        self._click[slots] += click
        self._seen[slots] = pass_id
        ok = self._show[slots] >= self.min_show
        if self.min_click > 0:
            ok &= self._click[slots] >= self.min_click
        admitted = keys[ok]
        earlier_show = self._show[slots[ok]] - show[ok]
        earlier_click = self._click[slots[ok]] - click[ok]
        freed = self._index.remove(admitted)
        self._show[freed] = 0
        self._click[freed] = 0
        return admitted, earlier_show, earlier_click

    def expire(self, cutoff: int) -> None:
        keys, slots = self._index.items()
        freed = self._index.remove(keys[self._seen[slots] <= cutoff])
        self._show[freed] = 0
        self._click[freed] = 0

    @property
    def nbytes(self) -> int:
        return self._index.nbytes + self._show.nbytes * 3

    @property
    def candidate_count(self) -> int:
        return len(self._index)

    def arrays(self) -> dict[str, np.ndarray]:
        keys, slots = self._index.items()
        order = np.argsort(keys, kind="stable")
        keys, slots = keys[order], slots[order]
        return {"cand_keys": keys, "cand_show": self._show[slots],
                "cand_click": self._click[slots], "cand_seen": self._seen[slots]}

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self._load(arrays.get("cand_keys", np.empty(0, np.int64)), arrays)


def _capacity(slots: int) -> int:
    """Rows of the candidate arrays for ``slots`` slots: a power of two (at least 16),
    so that a table loaded from a checkpoint has the capacity growth gives it, and a
    resumed run's RAM, which the memory budget counts, is what the uninterrupted run's
    was."""
    return 1 << max(4, (max(slots, 1) - 1).bit_length())


@numba.njit(nogil=True, cache=True, inline="always")
def _get(cells, i, bits):
    per = 8 // bits
    shift = (i % per) * bits
    return (np.int64(cells[i // per]) >> shift) & ((1 << bits) - 1)


@numba.njit(nogil=True, cache=True, inline="always")
def _set(cells, i, bits, value):
    per = 8 // bits
    shift = (i % per) * bits
    mask = ((1 << bits) - 1) << shift
    old = np.int64(cells[i // per])
    cells[i // per] = np.uint8((old & ~mask) | (value << shift))


@numba.njit(nogil=True, cache=True)
def _sketch_add(cells, keys, counts, salts, width, bits):
    """Conservative update of one plane (``depth`` rows of ``width`` counters of ``bits``
    bits, packed in bytes) by ``counts``; returns each key's estimate after it."""
    depth = salts.shape[0]
    cap = (1 << bits) - 1
    out = np.empty(keys.shape[0], np.float32)
    idx = np.empty(depth, np.int64)
    w = np.uint64(width)
    for i in range(keys.shape[0]):
        est = cap
        for j in range(depth):
            idx[j] = j * width + np.int64(splitmix64(np.uint64(keys[i]) ^ salts[j]) % w)
            est = min(est, _get(cells, idx[j], bits))
        new = min(est + np.int64(counts[i]), cap)
        for j in range(depth):
            if _get(cells, idx[j], bits) < new:
                _set(cells, idx[j], bits, new)
        out[i] = new
    return out


def counter_bits(threshold: float) -> int:
    """Bits per sketch counter: the fewest of 1, 2, 4, 8 that count up to ``threshold``
    (a count past the threshold changes no decision, so counters saturate there)."""
    return next(b for b in (1, 2, 4, 8) if (1 << b) - 1 >= threshold)


class SketchCount:
    """Shows (and clicks, with a click threshold) of waiting keys in a count-min sketch of
    ``nbytes`` bytes; thresholds as ``ExactCount``'s, on the sketch's estimates.

    Counters are as narrow as the thresholds allow (2 bits for a count of 2 or 3): four
    times the counters of a byte each in the same RAM, so far fewer collisions. A new
    row's earlier shows are the estimate, which saturates there."""

    admits_all = False

    def __init__(self, nbytes: int, min_show: float, min_click: float = 0.0,
                 seed: int = 0, depth: int = SKETCH_DEPTH) -> None:
        if max(min_show, min_click) > SKETCH_MAX:
            raise ValueError(f"admission thresholds up to {SKETCH_MAX} fit the sketch's "
                             f"counters; got show {min_show}, click {min_click}")
        self.min_show = min_show
        self.min_click = min_click
        self.planes = 2 if min_click > 0 else 1
        self.depth = depth
        self.bits = counter_bits(max(min_show, min_click))
        per_plane = int(nbytes) // self.planes * (8 // self.bits)
        self.width = max(1, per_plane // depth)
        plane_bytes = -(-depth * self.width * self.bits // 8)
        self._cells = np.zeros((self.planes, plane_bytes), np.uint8)
        base = np.arange(1, self.planes * depth + 1, dtype=np.uint64) * np.uint64(GOLDEN_GAMMA)
        self._salts = (splitmix64_array(base ^ np.uint64(seed))
                       .reshape(self.planes, depth))

    def admit(self, keys: np.ndarray, show: np.ndarray, click: np.ndarray,
              pass_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        keys = np.ascontiguousarray(keys, np.int64)
        shows = _sketch_add(self._cells[0], keys, np.ascontiguousarray(show, np.float32),
                            self._salts[0], self.width, self.bits)
        ok = shows >= self.min_show
        clicks = _nothing(len(keys))
        if self.planes == 2:
            clicks = _sketch_add(self._cells[1], keys,
                                 np.ascontiguousarray(click, np.float32), self._salts[1],
                                 self.width, self.bits)
            ok &= clicks >= self.min_click
        earlier_show = np.maximum(shows[ok] - show[ok], 0).astype(np.float32)
        earlier_click = np.maximum(clicks[ok] - click[ok], 0).astype(np.float32)
        return keys[ok], earlier_show, earlier_click

    def expire(self, cutoff: int) -> None:
        """A sketch cannot forget single keys; its counts stay."""

    @property
    def nbytes(self) -> int:
        return int(self._cells.nbytes)

    candidate_count = 0

    def counters(self) -> np.ndarray:
        """The counters unpacked, one byte each: ``[planes, depth * width]``."""
        per = 8 // self.bits
        shifts = (np.arange(per, dtype=np.uint8) * self.bits)
        out = (self._cells[:, :, None] >> shifts) & np.uint8((1 << self.bits) - 1)
        return out.reshape(self.planes, -1)[:, :self.depth * self.width]

    def arrays(self) -> dict[str, np.ndarray]:
        # Unpacked in checkpoints, a byte per counter: re-sharding sums the ranks'
        # sketches counter by counter.
        return {**no_candidates(), SKETCH_ARRAY: self.counters()}

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        saved = arrays.get(SKETCH_ARRAY)
        if saved is None:
            self._cells[:] = 0
            return
        shape = (self.planes, self.depth * self.width)
        if saved.shape != shape:
            raise ValueError(f"saved admission sketch has shape {tuple(saved.shape)}, this "
                             f"store's is {shape}: keep --admit-sketch-bytes and the "
                             "admission thresholds of the run being resumed")
        cap = (1 << self.bits) - 1
        counts = np.minimum(saved, cap).astype(np.uint8)
        per = 8 // self.bits
        padded = np.zeros((self.planes, self._cells.shape[1] * per), np.uint8)
        padded[:, :shape[1]] = counts
        parts = padded.reshape(self.planes, -1, per) << (np.arange(per, dtype=np.uint8)
                                                         * self.bits)
        self._cells[:] = np.bitwise_or.reduce(parts, axis=2)


class Probability(_Stateless):
    """Each show of a new key admits it with probability ``p`` (Monolith's and DeepRec's
    probabilistic filter): a key with ``s`` shows in a pass is admitted with probability
    ``1 - (1 - p)^s``. The draw is a hash of (key, pass, seed), so nothing is kept per
    key and every shard or resumed run draws alike."""

    admits_all = False

    def __init__(self, p: float, seed: int = 0) -> None:
        self.p = p
        self.seed = seed

    def admit(self, keys: np.ndarray, show: np.ndarray, click: np.ndarray,
              pass_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        salt = np.uint64(((self.seed * 1_000_003 + pass_id + 1) * GOLDEN_GAMMA)
                         & ((1 << 64) - 1))
        z = splitmix64_array(np.asarray(keys, np.int64).view(np.uint64) ^ salt)
        u = (z >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)
        ok = u < 1.0 - (1.0 - self.p) ** np.asarray(show, np.float64)
        return keys[ok], _nothing(int(ok.sum())), _nothing(int(ok.sum()))



def make_admission(config: StoreConfig, seed: int = 0) -> Admission:
    """The admission policy ``config`` asks for (``StoreConfig`` refuses combinations that
    mean nothing, e.g. a probability with a count threshold)."""
    if config.admit_probability is not None:
        return Probability(config.admit_probability, seed)
    if config.admit_min_count <= 1 and config.admit_min_clicks <= 0:
        return AdmitAll()
    if config.admit_sketch_bytes is not None:
        return SketchCount(parse_bytes(config.admit_sketch_bytes), config.admit_min_count,
                           config.admit_min_clicks, seed)
    return ExactCount(config.admit_min_count, config.admit_min_clicks)
