"""Serving with the sparse rows in a Redis Cluster (``terarec serve --sparse-tier``).

Each server holds the dense network and the hottest keys; the long tail is read from the
cluster (sparsetier/)::

    request keys ──> RowCache (CLOCK, as the local server) ──misses──> ClusterRows.read
                        ├── hot rows: the version's most-shown keys, in local memory
                        └── cold rows: one pipelined GET per node, hedged to a replica;
                            a key a delta touched is read under that delta's prefix

The engine follows the versions announced in the cluster (every row in), not the export's
newest; manifests, dense weights and feature tables still come from the export, verified
as the local server verifies them, and must be the ones that were published. A server
re-registers the version it serves every few seconds so that publishers keep its rows.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from redis.exceptions import RedisError

from terarec.export.format import ExportError, Manifest
from terarec.export.reader import IncompleteVersionError, VersionReader
from terarec.export.storage import Storage
from terarec.serving.engine import ServedVersion, ServingEngine
from terarec.serving.rows import ShardedRows, VersionRows
from terarec.sparsetier.control import Control
from terarec.sparsetier.layout import Layout, RowFormat
from terarec.sparsetier.tier import SparseTier, TierError, TierMetrics
from terarec.sparsetier.wire import row_keys

log = logging.getLogger(__name__)
HOT_ROW_OVERHEAD = 8  # bytes a hot row costs beyond its fp32 values (its key)
BULK_ROWS = 1 << 16  # rows per read when loading hot rows or refreshing the cache
BULK_DEADLINE_S = 10.0


class SparseReadError(RuntimeError):
    """Rows could not be read from the sparse tier within the request deadline (and the
    server runs with ``--strict-sparse``): the request fails with 503."""


class ClusterRows(VersionRows):
    """One version's rows: local hot rows, else the cluster (full version's rows, or the
    newest delta of the chain that touched the key). Immutable, like VersionRows."""

    def __init__(self, tier: SparseTier, layout: Layout, chain: list[str],
                 formats: list[RowFormat], codebooks: list[dict[int, np.ndarray]],
                 overlay_keys: np.ndarray, overlay_which: np.ndarray,
                 hot_keys: np.ndarray, hot_values: np.ndarray, deadline_s: float) -> None:
        super().__init__(ShardedRows([], formats[0].dim))
        self.tier, self.layout, self.chain = tier, layout, chain
        self.formats, self.codebooks = formats, codebooks
        self.keys = overlay_keys        # keys a delta touched, sorted ...
        self.which = overlay_which      # ... and the chain index of the newest such delta
        self.hot_keys, self.hot_values = hot_keys, hot_values
        self.deadline_s = deadline_s

    @property
    def overlay_rows(self) -> int:
        return len(self.keys)

    def hot(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mask of ``keys`` among the hot rows, their positions in ``hot_keys``)."""
        if not len(self.hot_keys) or not len(keys):
            return np.zeros(len(keys), np.bool_), np.zeros(len(keys), np.int64)
        pos = np.minimum(np.searchsorted(self.hot_keys, keys), len(self.hot_keys) - 1)
        return self.hot_keys[pos] == keys, pos

    def read(self, keys: np.ndarray, deadline_s: float | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, found, failed) of unique ``keys``: zero rows where absent, deleted or
        not read within the deadline (``failed``; default: the request deadline)."""
        deadline_s = self.deadline_s if deadline_s is None else deadline_s
        keys = np.ascontiguousarray(keys, np.int64)
        n = len(keys)
        out = np.zeros((n, self.row_dim), np.float32)
        found = np.zeros(n, np.bool_)
        failed = np.zeros(n, np.bool_)
        metrics = self.tier.metrics
        metrics.lookups.inc(n)
        hot, pos = self.hot(keys)
        if hot.any():
            out[hot] = self.hot_values[pos[hot]]
            found[hot] = True
            metrics.hot_hits.inc(int(hot.sum()))
        cold = np.flatnonzero(~hot)
        if not len(cold):
            return out, found, failed
        which = np.zeros(len(cold), np.int64)
        if len(self.keys):
            pos = np.minimum(np.searchsorted(self.keys, keys[cold]), len(self.keys) - 1)
            inside = self.keys[pos] == keys[cold]
            which[inside] = self.which[pos[inside]]
        groups = [(int(w), cold[which == w]) for w in np.unique(which)]
        # one read for the whole request when every group's keys and values have the
        # same width (version names of the same length, one codec): one pipeline per node
        widths = {(len(self.layout.rows(self.chain[w])), self.formats[w].width)
                  for w, _ in groups}
        batches = [groups] if len(widths) == 1 else [[g] for g in groups]
        for batch in batches:
            rkeys = np.concatenate([row_keys(self.layout.rows(self.chain[w]), keys[sel])
                                    for w, sel in batch])
            values, hit, miss = self.tier.read(rkeys, self.formats[batch[0][0]].width,
                                               deadline_s)
            lo = 0
            for w, sel in batch:
                part = slice(lo, lo + len(sel))
                lo += len(sel)
                ok = hit[part]
                if ok.any():
                    out[sel[ok]] = self.formats[w].decode(values[part][ok], self.codebooks[w])
                found[sel] = ok
                failed[sel] = miss[part]
        return out, found, failed

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows and found mask of any number of ``keys`` outside a request (hot rows at
        load, a delta's rows for the cache): read in chunks with a generous deadline;
        rows that cannot be read raise SparseReadError."""
        keys = np.ascontiguousarray(keys, np.int64)
        rows = np.zeros((len(keys), self.row_dim), np.float32)
        found = np.zeros(len(keys), np.bool_)
        for lo in range(0, len(keys), BULK_ROWS):
            part = slice(lo, lo + BULK_ROWS)
            rows[part], found[part], failed = self.read(keys[part], BULK_DEADLINE_S)
            if failed.any():
                raise SparseReadError(f"{int(failed.sum())} rows could not be read from the "
                                      f"sparse tier within {BULK_DEADLINE_S:.0f} s")
        return rows, found

    def with_version_delta(self, name: str, fmt: RowFormat, codebooks: dict[int, np.ndarray],
                           touched: np.ndarray) -> ClusterRows:
        """These rows with delta ``name`` (touching sorted ``touched`` keys) applied; hot
        rows it touched are read again, in the new version."""
        index = len(self.chain)
        keys = np.concatenate([self.keys, touched])
        which = np.concatenate([self.which, np.full(len(touched), index, np.int64)])
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        last = np.ones(len(keys), np.bool_)
        last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
        take = order[last]  # the newest delta of each key
        new = ClusterRows(self.tier, self.layout, [*self.chain, name],
                          [*self.formats, fmt], [*self.codebooks, codebooks], keys[take],
                          which[take], self.hot_keys, self.hot_values, self.deadline_s)
        stale = np.flatnonzero(np.isin(self.hot_keys, touched))
        if len(stale):
            values = self.hot_values.copy()
            new.hot_keys = np.empty(0, np.int64)  # read the touched ones from the cluster
            values[stale] = new.lookup(self.hot_keys[stale])[0]
            new.hot_keys, new.hot_values = self.hot_keys, values
        return new


class ClusterEngine(ServingEngine):
    """A ServingEngine whose rows live in the sparse tier at ``tier_url`` (namespace
    ``ns``), with up to ``hot_rows`` rows / ``hot_bytes`` bytes of the most-shown keys in
    local memory. ``strict``: a row not read within ``deadline_s`` fails the request
    (SparseReadError) instead of scoring as a zero row."""

    def __init__(self, uri: str | Path, tier_url: str, *, ns: str = "terarec",
                 hot_rows: int = 1_000_000, hot_bytes: int | None = None,
                 strict: bool = False, deadline_s: float = 0.1, hedge: bool = True,
                 hedge_floor_s: float = 0.002, hedge_delay_s: float | None = None,
                 register_ttl_s: float = 30.0, **kwargs: Any) -> None:
        super().__init__(uri, **kwargs)
        self.layout = Layout(ns)
        self.tier_metrics = TierMetrics(self.metrics.registry)
        self.tier = SparseTier(tier_url, metrics=self.tier_metrics, hedge=hedge,
                               hedge_floor_s=hedge_floor_s, hedge_delay_s=hedge_delay_s)
        self.control = Control(tier_url, self.layout)
        self.reader = _AnnouncedReader(self.storage, self.cache_dir, self.control)
        self.hot_rows, self.hot_bytes = hot_rows, hot_bytes
        self.strict, self.deadline_s = strict, deadline_s
        self.server_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.register_ttl_s = register_ttl_s
        self._registered: set[str] = set()
        self._beat_stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="terarec-register",
                                      daemon=True)
        self._beat.start()

    # -- versions -------------------------------------------------------------------------
    def _register(self, names: set[str]) -> None:
        for name in names:
            self.control.register(self.server_id, name, self.register_ttl_s)
        for name in self._registered - names:
            self.control.unregister(self.server_id, name)
        self._registered = set(names)

    def _heartbeat(self) -> None:
        while not self._beat_stop.wait(self.register_ttl_s / 3):
            current = self.current
            try:
                self._register({current.name} if current else set())
            except Exception as exc:  # the cluster being down must not stop serving
                log.warning("sparse tier: cannot register the served version: %s", exc)

    def refresh(self) -> bool:
        """As ServingEngine.refresh; the cluster being unreachable is not the version's
        fault: it is logged and the version tried again at the next poll."""
        try:
            return super().refresh()
        except (RedisError, TierError, SparseReadError) as exc:
            log.warning("sparse tier: cannot load a version from %s now: %s", self.tier.url,
                        exc)
            return False

    def _target(self, newest: str) -> Manifest | None:
        """The export's manifest of the newest announced version, if it is the one that
        was published."""
        try:
            manifest = self._manifest(newest)
        except IncompleteVersionError:
            return None
        except ExportError as exc:
            self._refuse(newest, str(exc))
            return None
        published = self.control.meta(newest).get("created")
        if published is None or float(published) != manifest.created:
            self._refuse(newest, f"the export's {newest} (written at {manifest.created:.3f}) "
                         f"is not the one published to {self.tier.url} ({published})",
                         manifest.created)
            return None
        return manifest

    def _build(self, target: Manifest, continues: bool) -> ServedVersion | None:
        current = self.current
        try:
            self._register({target.name, *([current.name] if current else [])})
        except RedisError as exc:
            log.warning("sparse tier: cannot register %s: %s", target.name, exc)
            return None
        return super()._build(target, continues)

    def _full_rows(self, manifest: Manifest) -> VersionRows:
        meta = self.control.meta(manifest.name)
        if meta.get("cold") != "1":
            raise IncompleteVersionError(f"{manifest.name}: its rows are not all in "
                                         f"{self.tier.url} (yet)")
        fmt = self._format(manifest, meta)
        rows = ClusterRows(self.tier, self.layout, [manifest.name], [fmt],
                           [self.control.codebooks(manifest.name)], np.empty(0, np.int64),
                           np.empty(0, np.int64), np.empty(0, np.int64),
                           np.zeros((0, manifest.row_dim), np.float32), self.deadline_s)
        budget = self.hot_rows
        if self.hot_bytes is not None:
            budget = min(budget, self.hot_bytes // (4 * manifest.row_dim + HOT_ROW_OVERHEAD))
        hot = np.sort(self.control.shows_of(manifest.name)[:max(0, budget)])
        rows.hot_keys, rows.hot_values = hot, rows.lookup(hot)[0]
        log.info("%s: %d hot rows in local memory, the rest read from %s", manifest.name,
                 len(hot), self.tier.url)
        return rows

    def _delta_rows(self, state: ServedVersion, manifest: Manifest
                    ) -> tuple[VersionRows, np.ndarray]:
        meta = self.control.meta(manifest.name)
        if meta.get("hot") != "1":
            raise IncompleteVersionError(f"{manifest.name}: its rows are not all in "
                                         f"{self.tier.url} (yet)")
        rows = state.rows
        if not isinstance(rows, ClusterRows):
            raise ExportError(f"{manifest.name}: its base is not served from the sparse tier")
        touched = self.control.keys_of(manifest.name)
        new = rows.with_version_delta(manifest.name, self._format(manifest, meta),
                                      self.control.codebooks(manifest.name), touched)
        return new, touched

    def _format(self, manifest: Manifest, meta: dict[str, str]) -> RowFormat:
        fmt = RowFormat.of(manifest)
        if meta.get("codec") != fmt.name:
            raise ExportError(f"{manifest.name}: the export's rows are {fmt.name}, the "
                              f"published ones {meta.get('codec')}")
        return fmt

    # -- scoring ------------------------------------------------------------------------
    def _rows_for(self, version: ServedVersion, keys: np.ndarray) -> np.ndarray:
        """Rows of unique ``keys``: the cache, then the version's rows (cluster reads
        happen outside the engine's lock). Only rows read from the cluster are cached:
        hot rows are in local memory already, and rows that failed are not cached, so
        the cache's room goes to the cold rows a request would otherwise wait for."""
        rows_source = version.rows
        if not isinstance(rows_source, ClusterRows):
            return super()._rows_for(version, keys)
        rows = np.empty((len(keys), rows_source.row_dim), np.float32)
        with self._lock:
            cache = self.cache if version is self.current else None
            if cache is not None:
                slots, hit = cache.get(keys)
                rows[hit] = cache.values[slots[hit]]
            else:
                hit = np.zeros(len(keys), np.bool_)
        miss = np.flatnonzero(~hit)
        if len(miss):
            rows[miss], _, failed = rows_source.read(keys[miss])
            if failed.any() and self.strict:
                raise SparseReadError(f"{int(failed.sum())} of {len(keys)} rows could not be "
                                      f"read from the sparse tier within "
                                      f"{self.deadline_s * 1000:.0f} ms")
            good = miss[~failed & ~rows_source.hot(keys[miss])[0]]
            with self._lock:  # a version swapped in meanwhile may have changed these rows
                if (cache is not None and cache is self.cache and version is self.current
                        and len(good)):
                    _, already = cache.get(keys[good])
                    cache.put(keys[good[~already]], rows[good[~already]])
        self.metrics.cache_counts(len(keys), len(keys) - len(miss))
        return rows

    def close(self) -> None:
        self._beat_stop.set()
        self._beat.join(timeout=5)
        try:
            self._register(set())
        except Exception as exc:
            log.warning("sparse tier: cannot unregister: %s", exc)
        super().close()
        self.tier.close()
        self.control.close()


class _AnnouncedReader(VersionReader):
    """A VersionReader whose newest version is the newest one announced in the cluster."""

    def __init__(self, storage: Storage, cache_dir: Path, control: Control) -> None:
        super().__init__(storage, cache_dir)
        self.control = control

    def latest(self) -> str | None:
        try:
            return self.control.newest()
        except RedisError as exc:
            raise ExportError(f"cannot read the announced versions: {exc}") from None
