"""One key pipeline for several models: a shared key index, each model its own rows.

K models trained on the same passes (the trials of a search) see the same keys with the
same counts, so the key side of a store is the same for all of them: key -> slot, shows,
clicks, last pass seen, admission candidates, TTL eviction. ``SharedKeys`` keeps that
side once; each model's ``SharedRowsStore`` keeps only its own values and per-key
optimizer state, indexed by the shared slots::

    SharedKeys           index (key -> slot)  show  click  last_seen  candidates
                               |
    SharedRowsStore 0    values[slot] (width d0)   state[slot]
    SharedRowsStore 1    values[slot] (width d1)   state[slot]      ...

K models cost K x (values + optimizer state) and one key side, not K whole stores.

The key work is done once per pass: the first view to ``pull`` pass p runs admission
and counting, the others take its slots; the first to call ``end_pass(p)`` evicts, the
others see the same eviction. Because every view then holds exactly the rows a store of
its own would hold (fresh rows depend only on (key, seed)), each model trains bit for
bit as it would alone. The key side is a ``MemoryStore`` with zero-width rows, so its
admission and eviction are the store's own.

What cannot share a key side: rows of variable width (their class follows per-model
counts), group lasso (it evicts per model, when that model's row reaches zero), eviction
by row norm or store bytes (they depend on each model's rows) and the tiered store (its
disk tier keeps its own index); ``sharing_refusal`` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from terarec.config import SparseOptimizerConfig, StoreConfig
from terarec.embedding.compression import CodedRows, make_row_values
from terarec.embedding.index import KeyIndex
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.store import MemoryStore, grow_rows, init_rows
from terarec.embedding.types import RowBlock


def sharing_refusal(store: StoreConfig, optimizer: SparseOptimizerConfig) -> str | None:
    """Why a store with this configuration cannot use a shared key side (None: it can)."""
    if store.tiered:
        return "a tiered store (--memory-budget / --store-dir) keeps its own disk index"
    if store.variable_dims:
        return "variable-width rows (--variable-dims) pick widths from per-model counts"
    if optimizer.group_lasso:
        return "group lasso evicts a model's rows when they reach zero"
    if store.evict_l2_below is not None or store.max_store_bytes is not None or (
            store.max_keys is not None and store.evict_score == "l2"):
        return "eviction by row norm or by store bytes depends on each model's rows"
    if (store.admit_min_clicks or store.admit_sketch_bytes is not None
            or store.admit_probability is not None or store.evict_show_below is not None
            or store.max_keys is not None):
        return ("only count admission (--admit-min-count) and TTL eviction "
                "(--evict-after-passes) are shared across models so far")
    return None


def key_side_config(store: StoreConfig) -> tuple:
    """The store settings the key side depends on: stores share a key side only when
    these are equal (admission and eviction by counts, age and key count)."""
    return (store.admit_min_count, store.admit_min_clicks, store.admit_sketch_bytes,
            store.admit_probability, store.evict_after_passes, store.evict_show_below,
            store.max_keys, store.evict_score)


@dataclass
class PassSlots:
    """One pass's key work, shared by every view: slots of the admitted keys (in the
    pulled keys' order), the admission mask, and the rows created in the pass."""

    keys: np.ndarray
    slots: np.ndarray
    admitted: np.ndarray
    created_keys: np.ndarray
    created_slots: np.ndarray


class SharedKeys:
    """The key side of several stores: index, counts, admission, eviction, done once a
    pass however many views pull (see the module doc)."""

    def __init__(self, config: StoreConfig, seed: int = 0) -> None:
        self.config = config
        # The key side holds no values: its rows are plain (zero-width) whatever precision
        # the views store theirs in.
        plain = replace(config, precision="fp32", variable_dims=(), promote_at=(),
                        class_precisions=())
        self.keys = MemoryStore(0, SparseOptimizer(SparseOptimizerConfig(name="sgd")),
                                plain, seed=seed)
        self.keys.track_evictions()
        self._pulled: tuple[int, PassSlots] | None = None
        self._ended: tuple[int, int, np.ndarray] | None = None
        # Slots of key arrays looked up read-only (a validation set every model scores),
        # kept until the index changes: {id(keys): (keys, slots)}.
        self._looked_up: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def index(self) -> KeyIndex:
        return self.keys.index

    @property
    def slot_bound(self) -> int:
        return self.keys.index.slot_bound

    def pull(self, keys: np.ndarray, show: np.ndarray, click: np.ndarray,
             pass_id: int) -> PassSlots:
        """Admit and count the unique ``keys`` of pass ``pass_id`` once; later calls for
        the same pass (the other views) get the same slots."""
        keys = np.ascontiguousarray(keys, np.int64)
        if self._pulled is not None and self._pulled[0] == pass_id:
            done = self._pulled[1]
            if len(done.keys) != len(keys):
                raise ValueError(f"pass {pass_id}: views of one key side pulled different "
                                 "keys (models sharing keys must train the same passes)")
            if done.keys is keys or np.array_equal(done.keys, keys):
                return done
            # The same keys in another order (the pass cut into other batch sizes).
            slots = self.keys.index.lookup(keys)
            admitted = slots >= 0
            return PassSlots(keys, slots[admitted], admitted, done.created_keys,
                             done.created_slots)
        before = self.keys.index.lookup(keys)
        _, admitted = self.keys.pull(keys, show, click, pass_id)
        slots = self.keys.index.lookup(keys)
        created = admitted & (before < 0)
        done = PassSlots(keys, slots[admitted], admitted, keys[created], slots[created])
        self._pulled = (pass_id, done)
        self.changed()
        return done

    def slots_of(self, keys: np.ndarray) -> np.ndarray:
        """Read-only slots of ``keys`` (-1 where absent), looked up once per state of
        the index for an array every view asks about."""
        hit = self._looked_up.get(id(keys))
        if hit is not None and hit[0] is keys:
            return hit[1]
        slots = self.keys.index.lookup(keys)
        self._looked_up[id(keys)] = (keys, slots)
        return slots

    def changed(self) -> None:
        """The index changed (a pull, an eviction, a load): forget read-only lookups."""
        self._looked_up.clear()

    def end_pass(self, pass_id: int) -> tuple[int, np.ndarray]:
        """Evict after pass ``pass_id`` once: (keys evicted, which keys)."""
        if self._ended is None or self._ended[0] != pass_id:
            evicted = self.keys.end_pass(pass_id)
            self._ended = (pass_id, evicted, self.keys.take_evicted())
            if evicted:
                self.changed()
        return self._ended[1], self._ended[2]

    @property
    def nbytes(self) -> int:
        """RAM of the key side: index, counts and admission candidates."""
        return self.keys.nbytes + self.keys.candidate_nbytes


def _shared_attr(name: str) -> property:
    """A key-side attribute of a view: read from (and written to) its ``SharedKeys``."""

    def get(self: SharedRowsStore):
        return getattr(self.shared.keys, name)

    def put(self: SharedRowsStore, value) -> None:
        setattr(self.shared.keys, name, value)

    return property(get, put, doc=f"the shared key side's ``{name}``")


class SharedRowsStore(MemoryStore):
    """One model's view of a ``SharedKeys``: its own values and optimizer state, by the
    shared slots; everything else (index, counts, candidates, counters) is the key
    side's. An ``EmbeddingStore``: it reads, saves and loads like a ``MemoryStore``."""

    index = _shared_attr("index")
    show = _shared_attr("show")
    click = _shared_attr("click")
    last_seen = _shared_attr("last_seen")
    admission = _shared_attr("admission")
    eviction = _shared_attr("eviction")
    admitted_total = _shared_attr("admitted_total")
    evicted_total = _shared_attr("evicted_total")
    pruned_total = _shared_attr("pruned_total")
    rejected_total = _shared_attr("rejected_total")

    def __init__(self, shared: SharedKeys, row_dim: int, optimizer: SparseOptimizer,
                 config: StoreConfig | None = None, seed: int = 0) -> None:
        config = config or StoreConfig()
        why = sharing_refusal(config, optimizer.config)
        if why is not None:
            raise ValueError(f"this store cannot share a key index: {why}")
        if key_side_config(config) != key_side_config(shared.config):
            raise ValueError("a view's admission and eviction settings must be those of "
                             "its shared key side")
        self.shared = shared
        self.row_dim = row_dim
        self.optimizer = optimizer
        self.config = config
        self.seed = seed
        self.state_dim = optimizer.state_dim(row_dim)
        self._alloc(max(16, shared.slot_bound))

    def _alloc(self, capacity: int) -> None:
        """This view's own arrays: values and optimizer state."""
        c = self.config
        coded = make_row_values(self.row_dim, c.precision, (), (),
                                class_precisions=tuple(c.class_precisions),
                                stochastic=c.stochastic_rounding, seed=self.seed,
                                capacity=capacity)
        self.values = coded if coded is not None else np.zeros((capacity, self.row_dim),
                                                                np.float32)
        self.state = np.zeros((capacity, self.state_dim), np.float32)

    def ensure_rows(self, n: int) -> None:
        grow_rows(self, n, ("state",))

    @property
    def nbytes(self) -> int:
        """Bytes this view adds: its live rows' values and optimizer state (the key
        side's bytes are ``SharedKeys.nbytes``, paid once)."""
        per_row = 4 * self.state_dim
        if isinstance(self.values, CodedRows):
            per_row += self.values.overhead_bytes_per_slot
        return self.value_bytes + len(self.index) * per_row

    # -- the pass -----------------------------------------------------------------------
    def pull(self, keys: np.ndarray, show: np.ndarray, click: np.ndarray,
             pass_id: int) -> tuple[RowBlock, np.ndarray]:
        """This view's rows of the pass's admitted keys (the key work done once for all
        views); rows created in the pass start as a store of its own would start them."""
        done = self.shared.pull(keys, show, click, pass_id)
        self.ensure_rows(self.shared.slot_bound)
        if len(done.created_slots):
            self.values[done.created_slots] = init_rows(done.created_keys, self.row_dim,
                                                        self.config.init_std, self.seed)
            self.state[done.created_slots] = self.optimizer.init_state(
                len(done.created_slots), self.row_dim)
        return RowBlock(self.values[done.slots], self.state[done.slots]), done.admitted

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Read-only: values of ``keys`` (zero rows where absent) and the found mask; the
        slots are looked up once for every view."""
        slots = self.shared.slots_of(keys)
        found = slots >= 0
        values = np.zeros((len(keys), self.row_dim), np.float32)
        values[found] = self.values[slots[found]]
        return values, found

    def end_pass(self, pass_id: int) -> int:
        """TTL eviction, once for every view (the evicted slots' rows are re-initialised
        when a key reuses them)."""
        evicted, keys = self.shared.end_pass(pass_id)
        self._log_evicted(keys)
        return evicted

    def evict(self, keys: np.ndarray) -> int:
        raise TypeError("rows of a shared key index are evicted by its key side "
                        "(end_pass), for every model at once")

    def prune_zero_rows(self, pass_id: int | None = None) -> int:
        return 0  # group lasso is refused for shared keys

    # -- persistence --------------------------------------------------------------------
    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Load this view's rows; the key side is loaded from the same arrays (every view
        of a key side restores from checkpoints of the same pass, so their keys and
        counts agree, and loading them again leaves the slots as they are)."""
        keys = arrays["keys"]
        n = len(keys)
        if arrays["values"].shape != (n, self.row_dim):
            raise ValueError(f"stored rows have shape {arrays['values'].shape}, "
                             f"expected ({n}, {self.row_dim})")
        side = self.shared.keys
        current, _ = side.index.items()
        if len(current) != n or not np.array_equal(np.sort(current), keys):
            side.load_arrays({**arrays, "values": np.zeros((n, 0), np.float32),
                              "state": np.zeros((n, 0), np.float32)})
            self.shared._pulled = self.shared._ended = None
            self.shared.changed()
        slots = side.index.lookup(keys)
        self._alloc(max(16, side.index.slot_bound))
        self.values[slots] = arrays["values"]
        self.state[slots] = arrays["state"]
