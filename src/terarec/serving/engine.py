"""The serving engine: load exported versions, follow new deltas, score requests.

A version is built off to the side (files fetched and verified, dense weights loaded into
a fresh network, delta rows merged into a new overlay) and then swapped in by replacing
one reference under a lock, while requests keep scoring against whichever version they
started with. A version that fails any check (missing or half-written manifest, checksum
mismatch, broken chain, shapes that do not fit) is refused and logged; the engine keeps
the newest good state, including the good prefix of a chain of deltas.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from terarec.autofeature.lookup import FeatureLookup
from terarec.embedding.index import unique_inverse
from terarec.embedding.working_set import StagingStats, WorkingSet
from terarec.export.format import ExportError, Manifest
from terarec.export.reader import IncompleteVersionError, VersionReader, newest_readable
from terarec.export.storage import Storage
from terarec.io import ScratchDir, atomic_write_text
from terarec.models.base import CTRModel
from terarec.serving.dense import Forward, OnnxForwards, torch_forward
from terarec.serving.features import request_batch
from terarec.serving.metrics import ServingMetrics
from terarec.serving.rows import (
    DamagedRowsError,
    FallbackRows,
    RowCache,
    RowSource,
    ShardedRows,
    VersionRows,
)
from terarec.types import Batch, FeatureSchema

log = logging.getLogger(__name__)
# How often a server sharing a swap notice with others checks it (a stat of one file).
NOTICE_POLL_S = 0.05
# The poller's longest single wait: an interval of inf (never look again) or 1e12 s would
# overflow the wait's timeout.
MAX_POLL_WAIT_S = 60.0


@dataclass
class ServedVersion:
    """Everything one version needs to score: schema, network and rows. Never mutated."""

    manifest: Manifest
    schema: FeatureSchema
    model: CTRModel
    rows: VersionRows
    mean_fields: torch.Tensor | None
    # Keys whose rows changed against the version this one was built from (for the cache).
    touched: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    # AutoFeature tables the model was trained with, joined onto every request's raw values.
    features: FeatureLookup | None = None
    raw_schema: FeatureSchema | None = None
    # Rows the version's own do not hold (a cold tier): asked for the keys ``rows``
    # does not find. None: a key ``rows`` lacks is a zero row.
    cold_rows: RowSource | None = None
    # The network's forward pass as served (``serving/dense.py``); None: ``model``.
    forward: Forward | None = None

    @cached_property
    def logits(self) -> Forward:
        """Logits ``[B]`` of (dense, pooled rows): ``forward``, else the network."""
        return self.forward or torch_forward(self.model)

    @cached_property
    def source(self) -> RowSource:
        """Where the request path reads this version's rows (behind the hot cache)."""
        return self.rows if self.cold_rows is None else FallbackRows(self.rows,
                                                                     self.cold_rows)

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> int:
        return self.manifest.version

    @cached_property
    def feature_names(self) -> tuple[str, ...]:
        """What a request may send: the raw fields (features are computed, not sent)."""
        return tuple(f.name for f in (self.raw_schema or self.schema).fields)

    def batch(self, context: Mapping[str, Any], records: Sequence[Mapping[str, Any]],
              row_names: frozenset[str] | None = None) -> Batch:
        """Raw request values -> the Batch training would have built from the same row
        (``row_names``: the records' keys, where the caller has them)."""
        if self.features is None:
            return request_batch(context, records, self.schema, row_names)
        rows = self.features.apply_records([{**context, **r} for r in records])
        return request_batch({}, rows, self.schema)

    @cached_property
    def feature_set(self) -> frozenset[str]:
        return frozenset(self.feature_names)

    @cached_property
    def numeric_names(self) -> frozenset[str]:
        """The numeric fields a request may send."""
        return frozenset(f.name for f in (self.raw_schema or self.schema).numeric)

    @cached_property
    def list_names(self) -> frozenset[str]:
        """The multi-valued fields a request may send (sequences, separated tags): a v2
        tensor may give each row's values as a list (``serving/kserve.py``)."""
        return frozenset(f.name for f in (self.raw_schema or self.schema).categorical
                         if f.separator is not None)


def _take(rows: np.ndarray, where: np.ndarray) -> np.ndarray:
    """``rows[where]`` (shape ``[*where.shape, row_dim]``) by ``ndarray.take``."""
    return rows.take(where.ravel(), axis=0).reshape(*where.shape, rows.shape[1])


def _reason(exc: Exception) -> str:
    """Why a version was refused: an ExportError's message, or what a malformed manifest
    lacked."""
    if isinstance(exc, ExportError):
        return str(exc)
    return f"malformed manifest ({type(exc).__name__}: {exc})"


class NoVersionError(RuntimeError):
    """Nothing has been loaded yet: the export is empty or every version was refused."""


class DamagedVersionError(NoVersionError):
    """The served version's local files were damaged underneath the server (a shard
    copy truncated in place) and it could not be reloaded from the export at once:
    requests are answered 503 until a refresh does, rather than the process dying of
    SIGBUS."""


class ServingEngine:
    """Serves the newest good version under ``uri`` and follows new ones.

    ``cache_rows`` bounds the hot-key cache. Every file served is first copied into
    ``cache_dir`` (a private temp folder by default) and verified there against the
    manifest (``VersionReader.fetch``), so shards are memory-mapped from copies nobody
    else writes: the export can be truncated, rewritten or deleted underneath a running
    server. A version whose files are incomplete is retried for ``incomplete_timeout_s``.
    With ``onnx`` each version's network runs on ONNX Runtime where its scores match
    PyTorch's (``serving/dense.py``), else on PyTorch.
    """

    def __init__(self, uri: str | Path, *, storage_options: dict[str, Any] | None = None,
                 cache_rows: int = 1_000_000, cache_dir: str | Path | None = None,
                 metrics: ServingMetrics | None = None,
                 incomplete_timeout_s: float = 60.0,
                 swap_notice: str | Path | None = None, onnx: bool = True) -> None:
        self.storage = Storage(uri, storage_options)
        # Run each version's network with ONNX Runtime where it agrees with PyTorch.
        self._onnx = OnnxForwards() if onnx else None
        # Several servers of one export (``serve --workers``) share a notice file: each
        # writes it after a swap, and the others look for a new version as soon as it
        # changes, so all of them serve a new version within one poll of the first.
        self.swap_notice = Path(swap_notice) if swap_notice is not None else None
        self.metrics = metrics or ServingMetrics()
        self.cache_rows = cache_rows
        self.incomplete_timeout_s = incomplete_timeout_s
        # A default folder is removed on close, or by the next server if this one is
        # killed (io.ScratchDir); a folder given by the caller is kept.
        self._scratch = (ScratchDir(tempfile.gettempdir(), "terarec-serve")
                         if cache_dir is None else None)
        self.cache_dir = self._scratch.path if self._scratch else Path(cache_dir)  # type: ignore[arg-type]
        self.reader = VersionReader(self.storage, self.cache_dir)
        self.current: ServedVersion | None = None
        self.cache: RowCache | None = None
        # Refused versions: name -> reason, and the refused manifest's creation time (a
        # version re-exported under the same name is a new one).
        self.refused: dict[str, str] = {}
        self._refused_created: dict[str, float | None] = {}
        # Incomplete versions being retried: (name, created) -> first seen (monotonic).
        self._pending: dict[tuple[str, float | None], float] = {}
        # Versions still incomplete after ``incomplete_timeout_s``: listed in ``refused``
        # (logged and counted once) but still retried, and loaded once their files are.
        self._late: set[tuple[str, float | None]] = set()
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        # Run after each poll's refresh (the item index follows the served version).
        self.poll_hooks: list[Callable[[], object]] = []
        # A served version whose local copies were found damaged: reloaded next refresh.
        self._damaged: ServedVersion | None = None

    # -- loading ------------------------------------------------------------------------
    def load_full(self, manifest: Manifest) -> ServedVersion:
        if manifest.kind != "full":
            raise ExportError(f"{manifest.name}: expected a full version, got a "
                              f"{manifest.kind}")
        schema = self.reader.schema(manifest)
        model = self.reader.network(manifest, schema)
        rows = self._full_rows(manifest)
        mean = [f.pooling == "mean" for f in schema.sparse_fields]
        config = self.reader.features(manifest)
        lookup, raw_schema = None, None
        if config is not None and config.tables.tables:
            lookup, raw_schema = FeatureLookup(config.tables), config.base_schema
        return ServedVersion(manifest, schema, model, rows,
                             torch.tensor(mean) if any(mean) else None,
                             features=lookup, raw_schema=raw_schema,
                             forward=self._forward(model, schema, manifest.row_dim))

    def _forward(self, model: CTRModel, schema: FeatureSchema, row_dim: int) -> Forward:
        """The forward pass a new version serves with (built while it loads)."""
        built = None if self._onnx is None else self._onnx.build(model, schema, row_dim)
        return built or torch_forward(model)

    def _full_rows(self, manifest: Manifest) -> VersionRows:
        """The row source of a full version: its shards, memory-mapped."""
        try:
            return VersionRows(ShardedRows(self.reader.shards(manifest), manifest.row_dim))
        except ValueError as exc:
            raise ExportError(f"{manifest.name}: {exc}") from None

    def _delta_rows(self, state: ServedVersion, manifest: Manifest
                    ) -> tuple[VersionRows, np.ndarray]:
        """``state``'s rows with delta ``manifest`` applied, and the keys it touched."""
        upserts, rows, deleted = self.reader.delta(manifest)
        return (state.rows.with_delta(upserts, rows, deleted),
                np.concatenate([upserts, deleted]))

    def apply_delta(self, state: ServedVersion, manifest: Manifest) -> ServedVersion:
        """``state`` with delta ``manifest`` applied, as a new ServedVersion."""
        if manifest.kind != "delta" or manifest.data.get("parent") != state.name:
            raise ExportError(f"{manifest.name}: not a delta on {state.name} "
                              f"(kind {manifest.kind}, parent {manifest.data.get('parent')})")
        for key in ("schema", "model", "row_dim"):
            if manifest.data[key] != state.manifest.data[key]:
                raise ExportError(f"{manifest.name}: {key} differs from its base "
                                  f"{state.manifest.base}")
        model = self.reader.network(manifest, state.schema)
        rows, changed = self._delta_rows(state, manifest)
        touched = np.concatenate([state.touched, changed])
        return ServedVersion(manifest, state.schema, model, rows, state.mean_fields,
                             touched, state.features, state.raw_schema, state.cold_rows,
                             self._forward(model, state.schema, manifest.row_dim))

    def _manifest(self, name: str) -> Manifest:
        return self.reader.manifest(name)

    def _refuse(self, name: str, reason: str, created: float | None = None) -> None:
        if self._is_refused(name, created):
            return
        self._late.discard((name, created))
        log.error("refusing version %s: %s", name, reason)
        self.refused[name] = reason
        self._refused_created[name] = created
        self._pending.pop((name, created), None)
        self.metrics.refused.inc()

    def _is_refused(self, name: str, created: float | None) -> bool:
        return (name in self.refused and self._refused_created.get(name) == created
                and (name, created) not in self._late)

    def _incomplete(self, name: str, created: float | None,
                    exc: IncompleteVersionError) -> bool:
        """Note that version ``name`` is incomplete; True once it has been so for
        ``incomplete_timeout_s``. It is then listed as refused, but still retried at every
        refresh: files that arrive late (a slow copy) are loaded when they do, and the
        deltas after it with them, rather than the server staying on an old version until
        the next full one."""
        now = time.monotonic()
        first = self._pending.setdefault((name, created), now)
        if now - first >= self.incomplete_timeout_s:
            if (name, created) not in self._late:
                reason = f"files still incomplete after {now - first:.0f} s ({exc})"
                log.error("refusing version %s for now: %s; retrying it at every poll",
                          name, reason)
                self._late.add((name, created))
                self.refused[name] = reason
                self._refused_created[name] = created
                self.metrics.refused.inc()
            return True
        if first == now:
            log.warning("version %s is incomplete (%s); retrying for up to %.0f s", name,
                        exc, self.incomplete_timeout_s)
        return False

    def _complete(self, name: str, created: float | None) -> None:
        """Version ``name`` loaded: no longer pending, nor refused if it was late."""
        self._pending.pop((name, created), None)
        if (name, created) in self._late:
            self._late.discard((name, created))
            self.refused.pop(name, None)
            self._refused_created.pop(name, None)
            log.warning("version %s is complete after all; loaded", name)

    def _continues(self, target: Manifest) -> bool:
        """Whether ``target`` extends the served chain: same names, and the served head
        still in the export unchanged (not deleted, not re-exported under its name)."""
        current = self.current
        if current is None:
            return False
        served = current.manifest
        if target.chain[:len(served.chain)] != served.chain:
            return False
        if target.name == served.name:
            return target.created == served.created
        try:
            return self._manifest(served.name).created == served.created
        except ExportError:
            return False

    def _build(self, target: Manifest, continues: bool) -> ServedVersion | None:
        """The newest good state on the way to ``target``: from the current version when
        ``target`` continues its chain, else from ``target``'s full version. Stops at the
        first incomplete version (retried at the next refresh) or refused one."""
        current = self.current
        chain = target.chain
        if continues and current is not None:
            state, todo = current, chain[len(current.manifest.chain):]
            state = ServedVersion(state.manifest, state.schema, state.model, state.rows,
                                  state.mean_fields, features=state.features,
                                  raw_schema=state.raw_schema,
                                  cold_rows=state.cold_rows,
                                  forward=state.forward)  # touched: this refresh's
        else:
            base_created: float | None = None
            try:
                base = target if target.kind == "full" else self._manifest(target.base)
                base_created = base.created
                if self._is_refused(base.name, base_created):
                    raise ExportError(f"version {base.name} was refused")
                state = self.load_full(base)
                self._complete(base.name, base_created)
            except IncompleteVersionError as exc:
                self._incomplete(target.base, base_created, exc)
                if target.base != target.name and self._is_refused(target.base, base_created):
                    self._refuse(target.name, f"its full version {target.base} was refused",
                                 target.created)
                return None
            except (ValueError, KeyError, TypeError) as exc:  # ExportError or malformed
                self._refuse(target.base, _reason(exc), base_created)
                if target.base != target.name:
                    self._refuse(target.name, f"its full version {target.base} was refused",
                                 target.created)
                return None
            todo = target.deltas
        for name in todo:
            created: float | None = None
            try:
                manifest = target if name == target.name else self._manifest(name)
                created = manifest.created
                if self._is_refused(name, created):
                    self._refuse(target.name, f"it builds on refused version {name}",
                                 target.created)
                    break
                state = self.apply_delta(state, manifest)
                self._complete(name, created)
            except IncompleteVersionError as exc:
                self._incomplete(name, created, exc)  # retried at the next refresh
                break
            except (ValueError, KeyError, TypeError) as exc:
                self._refuse(name, _reason(exc), created)
                if name != target.name:
                    self._refuse(target.name, f"it builds on refused version {name}",
                                 target.created)
                break
        return state

    def refresh(self) -> bool:
        """Load the newest version if there is one; True when a new version was swapped in.

        A newest version numbered at or below the served one is taken when the export was
        recreated (the served version is gone from it or was re-exported), and ignored
        otherwise."""
        with self._refresh_lock:
            try:
                name = self.reader.latest()
            except (OSError, ExportError) as exc:
                log.warning("cannot read %s: %s", self.storage.uri, exc)
                return False
            target = None if name is None else self._target(name)
            if target is None:
                return False
            name = target.name
            current = self.current
            damaged = current is not None and current is self._damaged
            if self._is_refused(name, target.created) or (
                    current is not None and name == current.name and not damaged
                    and target.created == current.manifest.created):
                return False
            continues = not damaged and self._continues(target)
            recreated = current is not None and not continues and (
                damaged or not self._same_export(target))
            if current is not None and not recreated and target.version <= current.version:
                return False
            state = self._build(target, continues)
            if state is None or (current is not None and not recreated
                                 and state.version <= current.version):
                return False  # nothing newer than the served version could be built
            if damaged:
                assert current is not None
                log.warning("reloaded from %s: version %s (the local copy of %s was "
                            "damaged)", self.storage.uri, state.name, current.name)
            elif recreated:
                assert current is not None
                log.warning("%s was recreated (served version %s is gone or was "
                            "re-exported); switching to its version %s", self.storage.uri,
                            current.name, state.name)
            if current is None:
                self._warm_up(state)
            self._swap(state, reuse_cache=continues)
            return True

    def _warm_up(self, state: ServedVersion) -> None:
        """Run the request path on two one-row requests (every value missing; every
        value ``"1"``) before the first version is served: compiled kernels (hashing,
        unique keys, the hot cache's index) are loaded or compiled here, not on the
        first client's request. ``state`` is not served yet, so no cache or metric is
        touched."""
        try:
            for record in ({}, dict.fromkeys(state.feature_names, "1")):
                batch = state.batch({}, [record])
                state.logits(batch.dense, self.pooled(batch, state))
            cache, row = RowCache(1, state.rows.row_dim), np.zeros((1, state.rows.row_dim),
                                                                   np.float32)
            for key in (1, 2):  # the second evicts the first
                cache.put(np.full(1, key, np.int64), row)
                cache.get(np.full(1, key, np.int64))
        except Exception:  # a failed warm-up only costs the first request its compile
            log.exception("warm-up of version %s failed", state.name)

    def _target(self, newest: str) -> Manifest | None:
        """The manifest of version ``newest``, or of the newest older readable one
        (``newest_readable``): each unreadable one passed over is refused."""
        return newest_readable(self.storage, newest, self._manifest, self._refuse)

    def _same_export(self, target: Manifest) -> bool:
        """Whether the served version is still in the export as it was served."""
        current = self.current
        if current is None:
            return False
        try:
            return self._manifest(current.name).created == current.manifest.created
        except ExportError:
            return False

    def _swap(self, state: ServedVersion, reuse_cache: bool = True) -> None:
        """Make ``state`` the served version; cached rows follow it in the same step (the
        cache is kept only when ``state`` continues the served chain)."""
        current = self.current
        same_base = (reuse_cache and current is not None
                     and current.manifest.base == state.manifest.base)
        touched = np.unique(state.touched) if same_base else np.empty(0, np.int64)
        fresh_rows, _ = state.rows.lookup(touched)  # computed before taking the lock
        with self._lock:
            if self.cache is None or not same_base or self.cache.row_dim != state.rows.row_dim:
                self.cache = RowCache(self.cache_rows, state.rows.row_dim)
            else:
                self.cache.refresh(touched, fresh_rows)
            self.current = state
            self._damaged = None
        if not same_base:
            self.reader.prune_downloads(state.manifest.chain)
        if self.swap_notice is not None:
            try:
                atomic_write_text(self.swap_notice, f"{state.name} {state.manifest.created}")
            except OSError as exc:
                log.warning("cannot write the swap notice %s: %s", self.swap_notice, exc)
        self.metrics.served(state.version, state.manifest.created)
        log.info("serving version %s (%s on %s, %d overlay rows)", state.name,
                 state.manifest.kind, state.manifest.base, state.rows.overlay_rows)

    # -- polling --------------------------------------------------------------------------
    def start_polling(self, interval_s: float) -> None:
        """Check for new versions every ``interval_s`` seconds in a background thread."""
        if self._poller is not None:
            return
        self._stop.clear()

        step = min(interval_s, MAX_POLL_WAIT_S if self.swap_notice is None else NOTICE_POLL_S)

        def loop() -> None:
            notice = self._notice_stamp()
            due = time.monotonic() + interval_s
            while not self._stop.wait(step):
                stamp = self._notice_stamp()
                if time.monotonic() < due and stamp == notice:
                    continue
                notice, due = stamp, time.monotonic() + interval_s
                try:
                    self.refresh()
                except Exception:  # keep serving whatever happens to one refresh
                    log.exception("refresh failed; still serving the previous version")
                for hook in self.poll_hooks:
                    try:
                        hook()
                    except Exception:
                        log.exception("poll hook %r failed", hook)

        self._poller = threading.Thread(target=loop, name="terarec-poll", daemon=True)
        self._poller.start()

    def _notice_stamp(self) -> int | None:
        """When the swap notice last changed (None: no notice, or not written yet)."""
        if self.swap_notice is None:
            return None
        try:
            return self.swap_notice.stat().st_mtime_ns
        except OSError:
            return None

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=10)
            self._poller = None
        if self._scratch is not None:
            self._scratch.close()

    # -- scoring --------------------------------------------------------------------------
    def served(self) -> ServedVersion:
        current = self.current
        if current is None:
            raise NoVersionError(f"no model version loaded from {self.storage.uri} yet")
        return current

    def _rows_for(self, version: ServedVersion, keys: np.ndarray) -> np.ndarray:
        """Rows of unique ``keys`` from the hot cache, then the version's row source."""
        with self._lock:
            cache = self.cache if version is self.current else None
            if cache is None:
                return version.source.lookup(keys)[0]
            slots, hit = cache.get(keys)
            rows = np.empty((len(keys), version.rows.row_dim), np.float32)
            rows[hit] = cache.values[slots[hit]]
            miss = np.flatnonzero(~hit)
            if len(miss):
                rows[miss] = version.source.lookup(keys[miss])[0]
                cache.put(keys[miss], rows[miss])
        self.metrics.cache_counts(len(keys), len(keys) - len(miss))
        return rows

    def _slot_rows(self, version: ServedVersion, keys: np.ndarray, where: np.ndarray
                   ) -> np.ndarray:
        """``rows[where]`` for the rows of unique ``keys`` (``where``: positions among
        them). When every key is cached (the usual request), gathered from the cache in
        one step, without the rows of ``keys``; else from ``_rows_for``'s. Gathered with
        ``take``, several times faster than fancy indexing with a 2-d index."""
        with self._lock:
            cache = self.cache if version is self.current else None
            if cache is not None and len(keys):
                slots, hit = cache.get(keys)
                if hit.all():
                    gathered = _take(cache.values, slots[where])  # a copy, under the lock
                    self.metrics.cache_counts(len(keys), len(keys))
                    return gathered
        return _take(self._rows_for(version, keys), where)

    def pooled(self, batch: Batch, version: ServedVersion) -> torch.Tensor:
        """``[B, F, row_dim]``: the batch's keys looked up once each (unique keys of the
        whole batch) and pooled per field with the training lookup code
        (``_pooled_rows``). A version whose mapped files were damaged underneath is
        reloaded from the export there and then, and the rows read from the reloaded
        copy; ``DamagedVersionError`` when that fails (retried at every refresh)."""
        try:
            return self._pooled_rows(batch, version)
        except DamagedRowsError as exc:
            if self._damaged is not version and self.current is version:
                self._damaged = version
                self.metrics.refused.inc()
                log.error("version %s: its local files were damaged (%s); reloading it "
                          "from %s", version.name, exc, self.storage.uri)
                self.refresh()  # copied and verified again, now
            again = self.current
            if again is not None and again is not version and again.name == version.name \
                    and again.manifest.created == version.manifest.created:
                return self._pooled_rows(batch, again)  # the same rows, reloaded
            raise DamagedVersionError(f"version {version.name} is being reloaded: its "
                                      f"local files were damaged ({exc})") from None

    def _pooled_rows(self, batch: Batch, version: ServedVersion) -> torch.Tensor:
        """``pooled``'s rows.

        With one key per (field, sample), the usual request, pooling is the row itself
        (sum or mean of one), so the rows are gathered straight into ``[B, F, row_dim]``
        in numpy: no padded weight table, no torch calls."""
        sparse = batch.sparse
        uniq, inverse = unique_inverse(sparse.values.numpy())
        if sparse.one_per_slot:
            fields, b = sparse.num_fields, sparse.batch_size
            where = inverse.reshape(fields, b).T  # [B, F] positions among ``uniq``
            return torch.from_numpy(self._slot_rows(version, uniq, where))
        weights = torch.zeros(len(uniq) + 1, version.rows.row_dim)
        weights[1:] = torch.from_numpy(self._rows_for(version, uniq))
        local = sparse.with_values(torch.from_numpy(inverse + 1))
        ws = WorkingSet(uniq, weights, None, [], None,
                        StagingStats(len(inverse), len(uniq), len(uniq)))
        return ws.lookup(local, version.mean_fields)

    @torch.inference_mode()
    def score_batch(self, batch: Batch, version: ServedVersion | None = None) -> np.ndarray:
        """Click probabilities for a batch of global keys, as ``Trainer.predict_batches``
        computes them (unknown keys pool as zero rows; to ``dense.TOLERANCE`` where ONNX
        Runtime runs the network)."""
        version = version or self.served()
        emb = self.pooled(batch, version)
        probs = torch.sigmoid(version.logits(batch.dense, emb))
        self.metrics.scored_rows.inc(len(batch))
        return probs.numpy()

    def score_records(self, records: Sequence[Mapping[str, Any]],
                      context: Mapping[str, Any] | None = None) -> tuple[np.ndarray, int]:
        """Scores of raw feature dicts (each merged with ``context``), hashed with the
        served schema; and the version that scored them."""
        version = self.served()
        batch = version.batch(context or {}, records)
        return self.score_batch(batch, version), version.version

    def wait_for_version(self, timeout_s: float) -> bool:
        """Poll until a version is loaded (startup on an export still being written)."""
        deadline = time.monotonic() + timeout_s
        while self.current is None and time.monotonic() < deadline:
            self.refresh()
            if self.current is None:
                time.sleep(0.2)
        return self.current is not None
