"""The device tier: a row cache resident on the training device across passes.

Without it every pass copies its whole working set host -> device and back, so a hot row
crosses PCIe twice per pass. With a budget (``--device-budget 40GB``) the hottest rows and
their optimizer state stay on the device; the store stays the source of truth for
everything else (counts, admission, eviction) and holds a stale copy of a cached row until
the row leaves the cache or the store is synced (checkpoint, export)::

    stage pass p     store.pull(keys)  counts shows/clicks, admits (as without a cache)
                     hits   <- cache slots on the device (decoded from the cache's codec)
                     misses <- rows pass p-1 trained and left here for pass p, or
                               rows read ahead while pass p-1 trained (pinned host buffer,
                               copied on a side stream: stored rows, and fresh rows of
                               keys not stored yet), checked against what pull
                               returned; the rest, and misses' state unless still at
                               its initial value, copied now
    train            plain working-set lookups, fused optimizer in backward (unchanged)
    write back       keys of the next pass first (known from its plan), then LFU over
                     cached + pass rows (total shows while cached):
                     kept rows are encoded into their slots, not pushed;
                     rows that do not fit, and displaced dirty rows, are pushed
                     (pushed pass rows the next pass needs stay until it is staged)
    end_pass         keys the store evicted are dropped from the cache (no write-back)
    sync (ckpt)      every dirty row is pushed; it stays cached, now clean

Rows keep the store's codec on the device: fp32, fp16, or int8 with an fp32 row scale
and bias (the layout of ``quant.encode_rows``, same rounding, tested byte for byte), so a
cached row rounds at the end of each pass exactly where the store would round it.

When the store reads row values at pass end (group lasso pruning, L2-norm eviction), or
has a disk tier (which holds a pass's cold rows until they are pushed), the cache writes
every trained row through: the store sees every trained value, and hits still skip the
copy to the device.

The same code runs on any torch device; with ``--device cpu`` the "device" is host memory
and the copies are plain copies, which is how CI tests every line of the policy.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from terarec.config import StoreConfig, parse_bytes
from terarec.embedding.compression import class_precision
from terarec.embedding.index import KeyIndex, unique_inverse
from terarec.embedding.protocol import EmbeddingStore
from terarec.embedding.quant import INT_ROW_LIMIT, decode_rows, encode_rows
from terarec.embedding.store import init_rows
from terarec.embedding.types import RowBlock
from terarec.types import Batch

CACHED_PRECISIONS = ("fp32", "fp16", "int8")
_INT8_TAIL = 8  # fp32 scale + fp32 bias per int8 row


def codec_bytes(precision: str, dim: int) -> int:
    """Device bytes of one row's values in the cache's codec."""
    return {"fp32": 4 * dim, "fp16": 2 * dim, "int8": dim + _INT8_TAIL}[precision]


# -- the row codec, in torch ops (quant.encode_rows / decode_rows, bit for bit) -------------
@dataclass
class CodedTensor:
    """Rows in a codec: ``values`` float32 / float16 [n, D], or uint8 codes [n, D] with
    float32 ``scale`` and ``bias`` [n] (int8)."""

    values: torch.Tensor
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None


def encode(rows: torch.Tensor, precision: str) -> CodedTensor:
    """``rows`` (float32 [n, D]) in ``precision``; non-finite rows are refused (the store
    refuses them too, so nothing non-finite reaches a checkpoint from the cache)."""
    if precision == "fp32":
        return CodedTensor(rows.clone())
    if len(rows) and not bool(torch.isfinite(rows).all()):
        raise ValueError("device cache: a trained row holds a non-finite value; lower the "
                         "sparse learning rate")
    if precision == "fp16":
        if len(rows) and float(rows.abs().max()) > 65504.0:
            raise ValueError("device cache: a row holds a value beyond +-65504, which fp16 "
                             "cannot store")
        return CodedTensor(rows.to(torch.float16))
    row_min = rows.amin(dim=1) if len(rows) else rows.new_zeros(0)
    row_max = rows.amax(dim=1) if len(rows) else rows.new_zeros(0)
    if len(rows) and float(torch.maximum(-row_min, row_max).max()) > INT_ROW_LIMIT:
        raise ValueError(f"device cache: a row holds a value beyond +-{INT_ROW_LIMIT:g}, "
                         f"which {precision} rows cannot store")
    exact = (row_max.double() - row_min.double()) / 255.0
    scale = exact.float()
    low = scale.double() < exact  # rounded up, so the grid reaches the row maximum
    scale = torch.where(low, torch.nextafter(scale, torch.full_like(scale, float("inf"))),
                        scale)
    scale64 = scale.double()
    inv = torch.where(scale64 > 0, 1.0 / scale64.clamp_min(1e-300),
                      torch.zeros_like(scale64))
    q = ((rows - row_min[:, None]).double() * inv[:, None] + 0.5).trunc().clamp(0, 255)
    return CodedTensor(q.to(torch.uint8), scale, row_min.clone())


def decode(coded: CodedTensor) -> torch.Tensor:
    """float32 rows of ``coded`` (int8: ``bias + scale * code`` in float32)."""
    if coded.scale is None or coded.bias is None:
        return coded.values.to(torch.float32)
    return coded.bias[:, None] + coded.scale[:, None] * coded.values.to(torch.float32)


def pass_keys(upcoming: list[Batch] | np.ndarray | object) -> np.ndarray | None:
    """The unique keys of an upcoming pass: its plan's keys, or those of its batches."""
    keys = getattr(upcoming, "keys", None)
    if isinstance(keys, np.ndarray):
        return keys
    if isinstance(upcoming, np.ndarray):
        return upcoming
    if isinstance(upcoming, list) and upcoming:
        return unique_inverse(np.concatenate([b.sparse.values.numpy() for b in upcoming]))[0]
    return None


@dataclass
class DeviceCacheStats:
    """Figures since the cache was made (``bytes``: host <-> device traffic)."""

    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0     # rows and state copied to the device
    hidden_bytes: int = 0  # of which copied ahead, while the previous pass trained
    d2h_bytes: int = 0     # rows and state copied back (evicted, synced)
    passes: int = 0
    prefetch_s: float = 0.0
    carried: int = 0       # misses served by rows the last pass left on the device

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def hidden_share(self) -> float:
        return self.hidden_bytes / self.h2d_bytes if self.h2d_bytes else 0.0


class _ReadAhead(threading.Thread):
    """Reads the next pass's miss rows from the store and copies them to the device on a
    side stream, while the current pass trains; errors re-raised on join."""

    def __init__(self, cache: DeviceRowCache, store: EmbeddingStore, keys: np.ndarray,
                 after: threading.Thread | None) -> None:
        super().__init__(name="terarec-device-read-ahead", daemon=True)
        self.cache, self.store, self.keys, self.after = cache, store, keys, after
        self.error: BaseException | None = None
        self.host: np.ndarray | None = None
        self.rows: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None

    def run(self) -> None:
        try:
            start = time.perf_counter()
            if self.after is not None:  # the disk tier's read-ahead first: rows in RAM
                self.after.join()
            values, found = self.store.lookup(self.keys)
            # Keys the store does not hold yet get fresh rows if admitted: those depend
            # on the key alone (as the store makes and encodes them).
            fresh = np.flatnonzero(~found)
            if len(fresh):
                values[fresh] = self.cache.fresh_rows(self.keys[fresh], self.store)
            self.host = values
            self.rows, self.event = self.cache._to_device(self.host, side=True)
            self.cache.stats.prefetch_s += time.perf_counter() - start
        except BaseException as exc:  # handed to the training thread
            self.error = exc

    def result(self) -> tuple[np.ndarray, np.ndarray, torch.Tensor] | None:
        self.join()
        if self.error is not None:
            raise self.error
        if self.rows is None or self.host is None:
            return None
        if self.event is not None:  # the training stream reads what the side stream wrote
            stream = torch.cuda.current_stream(self.rows.device)
            stream.wait_event(self.event)
            self.rows.record_stream(stream)
        return self.keys, self.host, self.rows


class DeviceRowCache:
    """Rows (values in the store's codec, optimizer state fp32) kept on ``device`` across
    passes, at most ``budget`` bytes of them; see the module docstring."""

    def __init__(self, row_dim: int, state_dim: int, budget: int | str,
                 device: torch.device | str, store_config: StoreConfig,
                 writes_through: bool = False) -> None:
        c = store_config
        if c.precision not in CACHED_PRECISIONS:
            raise ValueError(f"--device-budget: rows at precision {c.precision!r} are not "
                             f"kept on the device; use one of {CACHED_PRECISIONS}")
        if c.variable_dims:
            raise ValueError("--device-budget: variable-length rows (--variable-dims) are "
                             "not kept on the device")
        if c.stochastic_rounding:
            raise ValueError("--device-budget: stochastic rounding is not done on the "
                             "device; drop --stochastic-rounding")
        self.row_dim, self.state_dim = row_dim, state_dim
        # As the store keeps them: narrow int8 rows are fp16 there (fewer bytes).
        self.precision = class_precision(c.precision, row_dim)
        self.device = torch.device(device)
        self.budget = parse_bytes(budget)
        self.row_bytes = codec_bytes(self.precision, row_dim) + 4 * state_dim
        self.capacity = self.budget // self.row_bytes
        if self.capacity < 1:
            raise ValueError(f"--device-budget {budget}: one row takes {self.row_bytes} bytes "
                             "on the device")
        # The store decides on row values at pass end: every trained row goes through.
        self.writes_through = writes_through
        self.index = KeyIndex(1024)
        self._alloc(0)
        self.show = np.zeros(0, np.float64)   # total shows while cached (LFU score)
        self.last = np.zeros(0, np.int64)     # last pass that used the row (tie-break)
        self.dirty = np.zeros(0, np.bool_)    # newer than the store's copy
        self.stats = DeviceCacheStats()
        self.store: EmbeddingStore | None = None
        self._ahead: _ReadAhead | None = None
        self._upcoming: np.ndarray | None = None  # the next pass's keys, when known
        # Pass rows pushed but needed by the next pass: (keys sorted, values as pushed,
        # device values, state as pushed, device state), used where pull agrees.
        self._carry: tuple[np.ndarray, np.ndarray, torch.Tensor, np.ndarray,
                           torch.Tensor] | None = None
        self._side = (torch.cuda.Stream(self.device) if self.device.type == "cuda" else None)
        self.peak_bytes = 0

    # -- storage ------------------------------------------------------------------------
    def _alloc(self, n: int) -> None:
        dev, d = self.device, self.row_dim
        dtype = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.uint8}
        self.values = torch.zeros((n, d), dtype=dtype[self.precision], device=dev)
        self.scale = (torch.zeros(n, device=dev) if self.precision == "int8" else None)
        self.bias = (torch.zeros(n, device=dev) if self.precision == "int8" else None)
        self.state = torch.zeros((n, self.state_dim), device=dev)

    @property
    def slots(self) -> int:
        return self.values.shape[0]

    def _grow(self, n: int) -> None:
        """Room for slots < ``n`` (doubling, at most ``capacity`` slots)."""
        if n <= self.slots:
            return
        size = min(max(n, 2 * self.slots), max(n, self.capacity))
        old = (self.values, self.scale, self.bias, self.state)
        keep = self.slots
        self._alloc(size)
        self.values[:keep] = old[0]
        if self.scale is not None and old[1] is not None and old[2] is not None:
            self.scale[:keep], self.bias[:keep] = old[1], old[2]  # type: ignore[index]
        self.state[:keep] = old[3]
        for name, fill in (("show", 0.0), ("last", 0), ("dirty", False)):
            arr = getattr(self, name)
            grown = np.full(size, fill, arr.dtype)
            grown[:keep] = arr
            setattr(self, name, grown)

    @property
    def nbytes(self) -> int:
        """Device bytes the cache holds (allocated slots)."""
        return self.slots * self.row_bytes

    def __len__(self) -> int:
        return len(self.index)

    def _read(self, slots: np.ndarray) -> torch.Tensor:
        """Decoded float32 rows at ``slots``."""
        s = torch.from_numpy(slots).to(self.device)
        return decode(CodedTensor(self.values.index_select(0, s),
                                  None if self.scale is None else self.scale.index_select(0, s),
                                  None if self.bias is None else self.bias.index_select(0, s)))

    def _write(self, slots: np.ndarray, rows: torch.Tensor, state: torch.Tensor) -> None:
        s = torch.from_numpy(slots).to(self.device)
        coded = encode(rows, self.precision)
        self.values.index_copy_(0, s, coded.values)
        if self.scale is not None and self.bias is not None:
            assert coded.scale is not None and coded.bias is not None
            self.scale.index_copy_(0, s, coded.scale)
            self.bias.index_copy_(0, s, coded.bias)
        self.state.index_copy_(0, s, state)

    def fresh_rows(self, keys: np.ndarray, store: EmbeddingStore) -> np.ndarray:
        """The rows ``store`` gives ``keys`` when it admits them, decoded."""
        rows = init_rows(keys, self.row_dim, store.config.init_std, store.seed)
        if self.precision == "fp32":
            return rows
        return decode_rows(encode_rows(rows, self.precision), self.precision, self.row_dim)

    def _to_device(self, host: np.ndarray, side: bool = False
                   ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """``host`` rows on the device: on CUDA through a pinned buffer, copied without
        blocking (on the side stream when ``side``; the event marks the copy's end)."""
        t = torch.from_numpy(np.ascontiguousarray(host, np.float32))
        if self.device.type != "cuda":
            return t.to(self.device, copy=True), None
        t = t.pin_memory()
        stream = self._side if side and self._side is not None else torch.cuda.current_stream(
            self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):  # any thread
            out = t.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return out, event

    # -- the pass -----------------------------------------------------------------------
    def bind(self, store: EmbeddingStore) -> None:
        """Serve ``store``; a cache that served another store first returns its rows."""
        if self.store is not None and self.store is not store:
            self.sync(self.store)
            self.clear()
        self.store = store

    def read_ahead(self, store: EmbeddingStore, upcoming: object, current: np.ndarray,
                   after: threading.Thread | None = None) -> None:
        """Start copying the rows of the upcoming pass's keys that are neither cached nor
        in the current pass (so nothing trains them meanwhile) to the device, in a thread:
        they land while the current pass trains. ``after``: a thread to wait for first
        (the disk tier's own read-ahead)."""
        keys = pass_keys(upcoming)
        if keys is None or not len(keys):
            return
        self._join_ahead()  # one read-ahead at a time
        self._upcoming = np.sort(keys)  # kept first at write-back: hits next pass
        keys = keys[self.index.lookup(keys) < 0]
        if len(current):
            keys = keys[~np.isin(keys, current)]
        keys = np.sort(keys)
        if len(keys):
            self._ahead = _ReadAhead(self, store, keys, after)
            self._ahead.start()

    def _join_ahead(self) -> tuple[np.ndarray, np.ndarray, torch.Tensor] | None:
        """The read-ahead's rows (waiting for them), taken: the next one starts afresh."""
        ahead, self._ahead = self._ahead, None
        return ahead.result() if ahead is not None else None

    def _wait_ahead(self) -> None:
        """Wait for the read-ahead to stop reading the store; its rows stay for staging
        (none of its keys is written back meanwhile: they were neither cached nor in
        the pass, and rows the store evicts and admits again are caught by ``assemble``)."""
        if self._ahead is not None:
            self._ahead.join()

    def assemble(self, keys: np.ndarray, block: RowBlock, pass_id: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass's (weights, state) on the device, row 0 the zero row, then ``keys``'
        rows: cached ones from the cache, the others from ``block`` (what pull returned;
        rows read ahead are used where they still equal it)."""
        n, d = len(keys), self.row_dim
        weights = torch.zeros((n + 1, d), device=self.device)
        state = torch.zeros((n + 1, self.state_dim), device=self.device)
        slots = self.index.lookup(keys)
        hit = slots >= 0
        miss = np.flatnonzero(~hit)
        todo = np.ones(len(miss), np.bool_)        # values still to copy
        todo_state = np.ones(len(miss), np.bool_)  # state still to copy
        carry, self._carry = self._carry, None
        if carry is not None:  # rows the last pass trained and pushed: still here
            c_keys, c_host, c_rows, c_state_host, c_state = carry
            ok, pos = _same(c_keys, c_host, keys[miss], block.values[miss])
            ok[ok] = (c_state_host[pos[ok]] == block.state[miss[ok]]).all(axis=1)
            _place(weights, miss[ok] + 1, c_rows, pos[ok])
            _place(state, miss[ok] + 1, c_state, pos[ok])
            todo &= ~ok
            todo_state &= ~ok
            self.stats.carried += int(ok.sum())
        ahead = self._join_ahead()
        if ahead is not None:
            a_keys, a_host, a_rows = ahead
            ok, pos = _same(a_keys, a_host, keys[miss[todo]], block.values[miss[todo]])
            _place(weights, miss[todo][ok] + 1, a_rows, pos[ok])
            self.stats.hidden_bytes += int(ok.sum()) * 4 * d
            self.stats.h2d_bytes += int(ok.sum()) * 4 * d
            todo[np.flatnonzero(todo)[ok]] = False
        if todo.any():
            rows = miss[todo]
            dev_rows, _ = self._to_device(block.values[rows])
            weights.index_copy_(0, torch.from_numpy(rows + 1).to(self.device), dev_rows)
            self.stats.h2d_bytes += len(rows) * 4 * d
        if todo_state.any() and self.state_dim and self.store is not None:
            # A state still at its initial value (a new key's) is filled in on the device.
            init = self.store.optimizer.init_state(1, d)[0]
            rows = miss[todo_state]
            fresh = (block.state[rows] == init).all(axis=1)
            if fresh.any():
                state[torch.from_numpy(rows[fresh] + 1).to(self.device)] = torch.from_numpy(
                    init).to(self.device)
                todo_state[np.flatnonzero(todo_state)[fresh]] = False
        if todo_state.any() and self.state_dim:
            rows = miss[todo_state]
            dev_state, _ = self._to_device(block.state[rows])
            state.index_copy_(0, torch.from_numpy(rows + 1).to(self.device), dev_state)
            self.stats.h2d_bytes += len(rows) * 4 * self.state_dim
        if hit.any():
            dst = torch.from_numpy(np.flatnonzero(hit) + 1).to(self.device)
            weights.index_copy_(0, dst, self._read(slots[hit]))
            state.index_copy_(0, dst, self.state.index_select(
                0, torch.from_numpy(slots[hit]).to(self.device)))
            self.last[slots[hit]] = pass_id
        self.stats.hits += int(hit.sum())
        self.stats.misses += len(miss)
        self._note_peak(weights, state)
        return weights, state

    def overlay(self, keys: np.ndarray, weights: torch.Tensor) -> None:
        """Read-only staging (scoring): in ``weights`` (row 0 the zero row, then the
        store's rows of ``keys``), cached keys' rows are replaced by the newer ones."""
        slots = self.index.lookup(keys)
        hit = slots >= 0
        if hit.any():
            weights.index_copy_(0, torch.from_numpy(np.flatnonzero(hit) + 1).to(
                weights.device), self._read(slots[hit]).to(weights.device))

    def write_back(self, store: EmbeddingStore, keys: np.ndarray, weights: torch.Tensor,
                   state: torch.Tensor, show: np.ndarray, pass_id: int) -> None:
        """After training a pass on ``keys`` (rows 1.. of ``weights`` / ``state``, with
        this pass's ``show`` counts): keep the hottest rows of cache + pass on the device,
        push the rest to ``store``."""
        self._wait_ahead()  # nothing reads the store while it changes
        n = len(keys)
        slots = self.index.lookup(keys)
        hit = slots >= 0
        score = show.astype(np.float64)
        score[hit] += self.show[slots[hit]]
        c_keys, c_slots = self.index.items()
        in_pass = np.zeros(self.slots, np.bool_)
        in_pass[slots[hit]] = True
        rest = ~in_pass[c_slots]
        o_keys, o_slots = c_keys[rest], c_slots[rest]
        cand_score = np.concatenate([score, self.show[o_slots]])
        cand_last = np.concatenate([np.full(n, pass_id, np.int64), self.last[o_slots]])
        cand_key = np.concatenate([keys, o_keys])
        keep = np.zeros(len(cand_key), np.bool_)
        upcoming, self._upcoming = self._upcoming, None
        needed = (np.isin(cand_key, upcoming, assume_unique=True) if upcoming is not None
                  else np.zeros(len(cand_key), np.bool_))
        order = np.lexsort((cand_key, cand_last, cand_score, needed))  # most kept last
        keep[order[max(0, len(order) - self.capacity):]] = True
        keep_pass, keep_other = keep[:n], keep[n:]

        push_keys, push_rows, push_state = [], [], []
        # Pass rows that do not stay: trained values straight back.
        out = np.flatnonzero(~keep_pass)
        carry = None
        if len(out):
            idx = torch.from_numpy(out + 1).to(self.device)
            push_keys.append(keys[out])
            push_rows.append(weights.index_select(0, idx))
            push_state.append(state.index_select(0, idx))
            if upcoming is not None:  # the next pass trains them again: they stay here
                carry = np.flatnonzero(needed[:n][out])
        # Cached rows displaced: their device copy is the newest one when dirty.
        gone = o_slots[~keep_other]
        dirty = gone[self.dirty[gone]]
        if len(dirty):
            push_keys.append(o_keys[~keep_other][self.dirty[gone]])
            push_rows.append(self._read(dirty))
            push_state.append(self.state.index_select(0, torch.from_numpy(dirty).to(
                self.device)))
        freed = np.concatenate([slots[out][hit[out]], gone])
        self.index.remove(np.concatenate([keys[out][hit[out]], o_keys[~keep_other]]))
        self.show[freed] = 0
        self.dirty[freed] = False
        # Pass rows that stay: encoded into their slots (a new one where not cached).
        stay = np.flatnonzero(keep_pass)
        if len(stay):
            new_slots, _ = self.index.lookup_or_insert(keys[stay])
            self._grow(self.index.slot_bound)
            idx = torch.from_numpy(stay + 1).to(self.device)
            rows, st = weights.index_select(0, idx), state.index_select(0, idx)
            self._write(new_slots, rows, st)
            self.show[new_slots] = score[stay]
            self.last[new_slots] = pass_id
            self.dirty[new_slots] = not self.writes_through
            if self.writes_through:
                push_keys.append(keys[stay])
                push_rows.append(rows)
                push_state.append(st)
        if push_keys:
            pushed = self._push(store, np.concatenate(push_keys), torch.cat(push_rows),
                                torch.cat(push_state))
            if carry is not None and len(carry):  # the pass rows come first in the push
                sel = carry[np.argsort(keys[out][carry])]
                dev = torch.from_numpy(sel).to(self.device)
                rows = push_rows[0].index_select(0, dev)
                host = pushed.values[sel]
                if self.precision != "fp32":  # as the store will give them back
                    rows = decode(encode(rows, self.precision))
                    host = decode(encode(torch.from_numpy(host), self.precision)).numpy()
                self._carry = (keys[out][sel], host, rows, pushed.state[sel],
                               push_state[0].index_select(0, dev))
        self.stats.passes += 1
        self._note_peak(weights, state)

    def _push(self, store: EmbeddingStore, keys: np.ndarray, rows: torch.Tensor,
              state: torch.Tensor) -> RowBlock:
        block = RowBlock(rows.cpu().numpy(), state.cpu().numpy())
        self.stats.d2h_bytes += block.values.nbytes + block.state.nbytes
        store.push(keys, block)
        return block

    def end_pass(self, store: EmbeddingStore, evicted: int) -> None:
        """The store evicted ``evicted`` keys at pass end: drop those cached (their rows
        are gone; a key admitted again starts afresh, as without a cache)."""
        if not evicted or not len(self.index):
            return
        keys, slots = self.index.items()
        _, found = store.lookup(keys)
        if (~found).any():
            self.index.remove(keys[~found])
            self.show[slots[~found]] = 0
            self.dirty[slots[~found]] = False

    def sync(self, store: EmbeddingStore | None = None) -> int:
        """Push every dirty row to the store (before a checkpoint or an export); the
        rows stay cached, now clean. Returns the number of rows pushed."""
        store = store if store is not None else self.store
        self._wait_ahead()
        if store is None or not len(self.index):
            return 0
        keys, slots = self.index.items()
        dirty = self.dirty[slots]
        keys, slots = keys[dirty], slots[dirty]
        if len(keys):
            s = torch.from_numpy(slots).to(self.device)
            self._push(store, keys, self._read(slots), self.state.index_select(0, s))
            self.dirty[slots] = False
        return len(keys)

    def clear(self) -> None:
        """Forget every row (after the store was replaced or loaded)."""
        self._join_ahead()
        self._carry = self._upcoming = None
        self.index = KeyIndex(1024)
        self._alloc(0)
        self.show = np.zeros(0, np.float64)
        self.last = np.zeros(0, np.int64)
        self.dirty = np.zeros(0, np.bool_)

    def _note_peak(self, weights: torch.Tensor, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(self.device))
        else:  # what the device would hold: the cache and one working set
            self.peak_bytes = max(self.peak_bytes, self.nbytes + weights.numel() * 4
                                  + state.numel() * 4)


def _same(src_keys: np.ndarray, src_host: np.ndarray, keys: np.ndarray,
          rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which ``keys`` (with their rows as pull gave them) a read-ahead source holds
    with the same values (a key evicted and admitted again since has fresh ones), and
    where: (mask over ``keys``, position in the source)."""
    if not len(src_keys) or not len(keys):
        return np.zeros(len(keys), np.bool_), np.zeros(len(keys), np.int64)
    pos = np.minimum(np.searchsorted(src_keys, keys), len(src_keys) - 1)
    ok = src_keys[pos] == keys
    ok[ok] = (src_host[pos[ok]] == rows[ok]).all(axis=1)
    return ok, pos


def _place(dst: torch.Tensor, rows: np.ndarray, src: torch.Tensor, pos: np.ndarray) -> None:
    """``dst[rows] = src[pos]`` on the device."""
    if len(rows):
        dev = dst.device
        dst.index_copy_(0, torch.from_numpy(rows).to(dev),
                        src.index_select(0, torch.from_numpy(pos).to(dev)))


def reads_values(config: StoreConfig, group_lasso: float) -> bool:
    """Whether the store reads row values at pass end (pruning, L2 eviction)."""
    by_norm = config.evict_score == "l2" and (config.max_keys is not None
                                              or config.max_store_bytes is not None)
    return bool(group_lasso) or config.evict_l2_below is not None or by_norm


def make_device_cache(budget: int | str | None, store: EmbeddingStore,
                      device: torch.device) -> DeviceRowCache | None:
    """The device cache ``--device-budget`` asks for (None without one), bound to ``store``."""
    if budget is None:
        return None
    # A store with a disk tier holds a pass's cold rows until they are pushed: every
    # trained row goes back to it (hits still skip the copy to the device).
    through = store.prefetches or reads_values(store.config,
                                               store.optimizer.config.group_lasso)
    cache = DeviceRowCache(store.row_dim, store.state_dim, budget, device, store.config,
                           writes_through=through)
    cache.bind(store)
    return cache
