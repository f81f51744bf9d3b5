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
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
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
from terarec.export.reader import VersionReader
from terarec.export.storage import Storage
from terarec.models.base import CTRModel
from terarec.serving.features import request_batch
from terarec.serving.metrics import ServingMetrics
from terarec.serving.rows import RowCache, ShardedRows, VersionRows
from terarec.types import Batch, FeatureSchema

log = logging.getLogger(__name__)


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

    def batch(self, context: Mapping[str, Any], records: Sequence[Mapping[str, Any]]) -> Batch:
        """Raw request values -> the Batch training would have built from the same row."""
        if self.features is None:
            return request_batch(context, records, self.schema)
        rows = self.features.apply_records([{**context, **r} for r in records])
        return request_batch({}, rows, self.schema)

    @cached_property
    def feature_set(self) -> frozenset[str]:
        return frozenset(self.feature_names)


class NoVersionError(RuntimeError):
    """Nothing has been loaded yet: the export is empty or every version was refused."""


class ServingEngine:
    """Serves the newest good version under ``uri`` and follows new ones.

    ``cache_rows`` bounds the hot-key cache; ``cache_dir`` is where remote (non-local)
    files are copied so shards can be memory-mapped (a temp folder by default; local
    exports are mapped in place).
    """

    def __init__(self, uri: str | Path, *, storage_options: dict[str, Any] | None = None,
                 cache_rows: int = 1_000_000, cache_dir: str | Path | None = None,
                 metrics: ServingMetrics | None = None) -> None:
        self.storage = Storage(uri, storage_options)
        self.metrics = metrics or ServingMetrics()
        self.cache_rows = cache_rows
        self._own_cache_dir = cache_dir is None and not self.storage.is_local
        self.cache_dir = (Path(tempfile.mkdtemp(prefix="terarec-serve-"))
                          if self._own_cache_dir else Path(cache_dir) if cache_dir else None)
        self.reader = VersionReader(self.storage, self.cache_dir)
        self.current: ServedVersion | None = None
        self.cache: RowCache | None = None
        self.refused: dict[str, str] = {}
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    # -- loading ------------------------------------------------------------------------
    def load_full(self, manifest: Manifest) -> ServedVersion:
        if manifest.kind != "full":
            raise ExportError(f"{manifest.name}: expected a full version, got a "
                              f"{manifest.kind}")
        schema = self.reader.schema(manifest)
        model = self.reader.network(manifest, schema)
        try:
            base = ShardedRows(self.reader.shards(manifest), manifest.row_dim)
        except ValueError as exc:
            raise ExportError(f"{manifest.name}: {exc}") from None
        mean = [f.pooling == "mean" for f in schema.categorical]
        config = self.reader.features(manifest)
        lookup, raw_schema = None, None
        if config is not None and config.tables.tables:
            lookup, raw_schema = FeatureLookup(config.tables), config.base_schema
        return ServedVersion(manifest, schema, model, VersionRows(base),
                             torch.tensor(mean) if any(mean) else None,
                             features=lookup, raw_schema=raw_schema)

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
        upserts, rows, deleted = self.reader.delta(manifest)
        touched = np.concatenate([state.touched, upserts, deleted])
        return ServedVersion(manifest, state.schema, model,
                             state.rows.with_delta(upserts, rows, deleted), state.mean_fields,
                             touched, state.features, state.raw_schema)

    def _manifest(self, name: str) -> Manifest:
        return self.reader.manifest(name)

    def _refuse(self, name: str, reason: str) -> None:
        if name not in self.refused:
            log.error("refusing version %s: %s", name, reason)
            self.refused[name] = reason
            self.metrics.refused.inc()

    def _build(self, target: Manifest) -> ServedVersion | None:
        """The newest good state on the way to ``target``: from the current version when
        ``target`` continues its chain, else from ``target``'s full version."""
        current = self.current
        chain = target.chain
        if current is not None and chain[:len(current.manifest.chain)] == current.manifest.chain:
            state, todo = current, chain[len(current.manifest.chain):]
            state = ServedVersion(state.manifest, state.schema, state.model, state.rows,
                                  state.mean_fields, features=state.features,
                                  raw_schema=state.raw_schema)  # touched: this refresh's
        else:
            if target.base in self.refused:
                self._refuse(target.name, f"its full version {target.base} was refused")
                return None
            try:
                state = self.load_full(self._manifest(target.base))
            except ExportError as exc:
                self._refuse(target.base, str(exc))
                self._refuse(target.name, f"its full version {target.base} was refused")
                return None
            todo = target.deltas
        for name in todo:
            if name in self.refused:
                self._refuse(target.name, f"it builds on refused version {name}")
                break
            try:
                state = self.apply_delta(state, self._manifest(name))
            except ExportError as exc:
                self._refuse(name, str(exc))
                if name != target.name:
                    self._refuse(target.name, f"it builds on refused version {name}")
                break
        return state

    def refresh(self) -> bool:
        """Load the newest version if there is one; True when a new version was swapped in."""
        with self._refresh_lock:
            try:
                name = self.reader.latest()
            except (OSError, ExportError) as exc:
                log.warning("cannot read %s: %s", self.storage.uri, exc)
                return False
            current = self.current
            if name is None or name in self.refused or (current and name == current.name):
                return False
            try:
                target = self._manifest(name)
            except ExportError as exc:
                self._refuse(name, str(exc))
                return False
            if current is not None and target.version <= current.version:
                return False
            state = self._build(target)
            if state is None or (current is not None and state.name == current.name):
                return False
            self._swap(state)
            return True

    def _swap(self, state: ServedVersion) -> None:
        """Make ``state`` the served version; cached rows follow it in the same step."""
        current = self.current
        same_base = current is not None and current.manifest.base == state.manifest.base
        touched = np.unique(state.touched) if same_base else np.empty(0, np.int64)
        fresh_rows, _ = state.rows.lookup(touched)  # computed before taking the lock
        with self._lock:
            if self.cache is None or not same_base or self.cache.row_dim != state.rows.row_dim:
                self.cache = RowCache(self.cache_rows, state.rows.row_dim)
            else:
                self.cache.refresh(touched, fresh_rows)
            self.current = state
        if not same_base:
            self.reader.prune_downloads(state.manifest.chain)
        self.metrics.served(state.version, state.manifest.created)
        log.info("serving version %s (%s on %s, %d overlay rows)", state.name,
                 state.manifest.kind, state.manifest.base, state.rows.overlay_rows)

    # -- polling --------------------------------------------------------------------------
    def start_polling(self, interval_s: float) -> None:
        """Check for new versions every ``interval_s`` seconds in a background thread."""
        if self._poller is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.refresh()
                except Exception:  # keep serving whatever happens to one refresh
                    log.exception("refresh failed; still serving the previous version")

        self._poller = threading.Thread(target=loop, name="terarec-poll", daemon=True)
        self._poller.start()

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=10)
            self._poller = None
        if self._own_cache_dir and self.cache_dir is not None:
            shutil.rmtree(self.cache_dir, ignore_errors=True)

    # -- scoring --------------------------------------------------------------------------
    def served(self) -> ServedVersion:
        current = self.current
        if current is None:
            raise NoVersionError(f"no model version loaded from {self.storage.uri} yet")
        return current

    def _rows_for(self, version: ServedVersion, keys: np.ndarray) -> np.ndarray:
        """Rows of unique ``keys`` from the cache, then the version's own rows."""
        with self._lock:
            cache = self.cache if version is self.current else None
            if cache is None:
                return version.rows.lookup(keys)[0]
            slots, hit = cache.get(keys)
            rows = np.empty((len(keys), version.rows.row_dim), np.float32)
            rows[hit] = cache.values[slots[hit]]
            miss = np.flatnonzero(~hit)
            if len(miss):
                rows[miss] = version.rows.lookup(keys[miss])[0]
                cache.put(keys[miss], rows[miss])
        self.metrics.cache_counts(len(keys), len(keys) - len(miss))
        return rows

    @torch.no_grad()
    def score_batch(self, batch: Batch, version: ServedVersion | None = None) -> np.ndarray:
        """Click probabilities for a batch of global keys, as ``Trainer.predict_batches``
        computes them (unknown keys pool as zero rows)."""
        version = version or self.served()
        sparse = batch.sparse
        uniq, inverse = unique_inverse(sparse.values.numpy())
        weights = torch.zeros(len(uniq) + 1, version.rows.row_dim)
        weights[1:] = torch.from_numpy(self._rows_for(version, uniq))
        local = sparse.with_values(torch.from_numpy(inverse + 1))
        ws = WorkingSet(uniq, weights, None, [], None,
                        StagingStats(len(inverse), len(uniq), len(uniq)))
        emb = ws.lookup(local, version.mean_fields)
        probs = torch.sigmoid(version.model(batch.dense, emb))
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
