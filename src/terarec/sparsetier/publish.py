"""Publishing exported versions into the sparse tier (``terarec publish``).

A version's chain (its full version, then its deltas) is copied shard by shard from the
export, rows kept in the version's codec, written in one pipeline per master at a time.
Two parts, publishable on their own cadences::

    cold   the full version's rows (large, changes when a new full version is exported)
    hot    the deltas' rows and touched keys (small, every delta)

Once every part of the target's chain is in, the target is announced; servers switch to
it at their next poll. Published versions never change: publishing a version again from
an export that re-wrote it under the same name is refused. Versions no live server uses
are then garbage-collected (control.py).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from redis.exceptions import RedisClusterException, RedisError

from terarec.export.format import Manifest, parse_version_name
from terarec.export.reader import VersionReader, newest_readable
from terarec.export.storage import Storage
from terarec.export.writer import ExportedVersion, IncrementalExporter
from terarec.io import ScratchDir
from terarec.sparsetier.control import Control
from terarec.sparsetier.layout import Layout, RowFormat
from terarec.sparsetier.tier import SparseTier, TierError
from terarec.sparsetier.wire import row_keys

log = logging.getLogger(__name__)
Part = Literal["hot", "cold", "all"]
WRITE_ROWS = 1 << 18  # rows encoded and sent per step


class PublishError(RuntimeError):
    """A version that cannot be published (missing part, changed under its name, ...)."""


@dataclass
class PublishResult:
    version: str
    part: str
    rows: int = 0          # rows written now (parts already published are skipped)
    seconds: float = 0.0   # spent writing rows
    announced: bool = False
    skipped: list[str] = field(default_factory=list)    # parts already in the cluster
    collected: list[str] = field(default_factory=list)  # versions garbage-collected

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "part": self.part, "rows": self.rows,
                "seconds": round(self.seconds, 3), "rows_per_s": round(self.rows_per_s),
                "announced": self.announced, "skipped": self.skipped,
                "collected": self.collected}

    def summary(self, to: str, namespace: str) -> str:
        """One line for a log: what went where, and whether servers will now follow it."""
        done = (f"{self.rows} rows in {self.seconds:.2f} s ({self.rows_per_s:,.0f} rows/s)"
                if self.rows or not self.skipped else "no rows")
        parts = [f"published {self.version} ({self.part}) to {to} namespace {namespace}: "
                 f"{done}"]
        if self.skipped:
            parts.append(f"already there: {', '.join(self.skipped)}")
        parts.append("announced" if self.announced else "not announced")
        if self.collected:
            parts.append(f"removed {', '.join(self.collected)}")
        return "; ".join(parts)


def split_version_uri(uri: str) -> tuple[str, str | None]:
    """``EXPORT/vNNNNNN`` -> (EXPORT, vNNNNNN); an export URI alone -> (uri, None)."""
    stripped = uri.rstrip("/")
    head, _, last = stripped.rpartition("/")
    if head and parse_version_name(last) is not None:
        return head, last
    return uri, None


class Publisher:
    """Publishes versions of exports into namespace ``ns`` of the cluster at ``url``."""

    def __init__(self, url: str, ns: str = "terarec", tier: SparseTier | None = None) -> None:
        self.layout = Layout(ns)
        self.url = url
        self.tier = tier or SparseTier(url, hedge=False, timeout_s=30.0)
        self._own_tier = tier is None
        try:
            self.control = Control(url, self.layout)
        except (RedisError, RedisClusterException) as exc:
            if self._own_tier:
                self.tier.close()
            raise TierError(f"{url}: cannot reach the cluster ({type(exc).__name__}: "
                            f"{exc})") from None

    def close(self) -> None:
        self.control.close()
        if self._own_tier:
            self.tier.close()

    def publish(self, version_uri: str | Path, *, part: Part = "all",
                storage_options: dict[str, Any] | None = None,
                gc_grace_s: float = 30.0) -> PublishResult:
        """Publish ``part`` of a version (``EXPORT/vNNNNNN``, or an export: its newest).
        A cluster that fails a request (a slot range down, a node gone) is a
        ``PublishError`` saying so: nothing is announced before every part is written,
        so publishing again once the cluster is whole completes the version."""
        try:
            return self._publish(version_uri, part=part, storage_options=storage_options,
                                 gc_grace_s=gc_grace_s)
        except (RedisError, RedisClusterException) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else "no reason given"
            raise PublishError(f"{self.url}: the cluster failed a request "
                               f"({type(exc).__name__}: {reason}); the version is not "
                               "announced: publish again once every slot is served "
                               "(redis-cli --cluster check)") from None

    def _publish(self, version_uri: str | Path, *, part: Part,
                 storage_options: dict[str, Any] | None,
                 gc_grace_s: float) -> PublishResult:
        if part not in ("hot", "cold", "all"):
            raise ValueError(f"part must be hot, cold or all, got {part!r}")
        export, name = split_version_uri(str(version_uri))
        scratch = ScratchDir(tempfile.gettempdir(), "terarec-publish")
        try:
            reader = VersionReader(Storage(export, storage_options), scratch.path)
            if name is not None:
                target = reader.manifest(name)
            else:  # the newest version a server would load: an unreadable one is passed over
                found = newest_readable(reader.storage, reader.latest(), reader.manifest,
                                        lambda n, why: log.warning(
                                            "%s: skipping version %s: %s", export, n, why))
                if found is None:
                    raise PublishError(f"{export}: no version to publish")
                target = found
            result = PublishResult(target.name, part)
            manifests = [reader.manifest(n) if n != target.name else target
                         for n in target.chain]
            for manifest in manifests:
                self._check_immutable(manifest)
            base, deltas = manifests[0], manifests[1:]
            if part in ("cold", "all"):
                self._publish_full(reader, base, result)
            if part in ("hot", "all"):
                if self.control.meta(base.name).get("cold") != "1":
                    raise PublishError(f"{target.name}: the cold part of its full version "
                                       f"{base.name} is not in the cluster; run publish "
                                       "--part cold (or all) first")
                for delta in deltas:
                    self._publish_delta(reader, delta, result)
            complete = self.control.meta(base.name).get("cold") == "1" and all(
                self.control.meta(d.name).get("hot") == "1" for d in deltas)
            if complete:
                self.control.set_meta(target.name, chain=json.dumps(target.chain),
                                      number=target.version, created=repr(target.created),
                                      kind=target.kind)
                self.control.announce(target.name, target.version)
                result.announced = True
                result.collected = self.control.collect(self.tier, gc_grace_s)
            return result
        finally:
            scratch.close()

    def _check_immutable(self, manifest: Manifest) -> None:
        published = self.control.meta(manifest.name).get("created")
        if published is not None and float(published) != manifest.created:
            raise PublishError(f"version {manifest.name} is already published from an export "
                               f"written at {float(published):.3f}, this one at "
                               f"{manifest.created:.3f}: published versions never change; "
                               "use another namespace or export a new version")

    def _begin(self, manifest: Manifest, fmt: RowFormat) -> None:
        self.control.redis.sadd(self.layout.control("published"), manifest.name)
        self.control.set_meta(manifest.name, created=repr(manifest.created),
                              number=manifest.version, kind=manifest.kind,
                              codec=fmt.name, row_dim=manifest.row_dim,
                              chain=json.dumps(manifest.chain),
                              manifest=json.dumps(manifest.data))

    def _write_shards(self, reader: VersionReader, manifest: Manifest, fmt: RowFormat,
                      result: PublishResult) -> np.ndarray:
        """Every shard's rows under the version's prefix; returns the keys written."""
        prefix = self.layout.rows(manifest.name)
        written = []
        for i, shard in enumerate(manifest.shards):
            keys, values = reader.rows(manifest, shard)
            if fmt.codec is not None and fmt.codec.codebook:
                book = values.encoded.codebook  # type: ignore[attr-defined]
                self.control.redis.hset(self.layout.control("codebooks", manifest.name), str(i),
                                        np.asarray(book, "<f4").tobytes())
            encoded = fmt.encode(values, i)
            t0 = time.perf_counter()
            for lo in range(0, len(keys), WRITE_ROWS):
                hi = lo + WRITE_ROWS
                self.tier.write(row_keys(prefix, keys[lo:hi]), encoded[lo:hi])
            result.seconds += time.perf_counter() - t0
            result.rows += len(keys)
            written.append(np.asarray(keys, np.int64))
            # the private copy is not needed once its rows are in the cluster
            (reader.cache_dir / manifest.name / shard["file"]).unlink(missing_ok=True)
        return np.concatenate(written) if written else np.empty(0, np.int64)

    def _publish_full(self, reader: VersionReader, manifest: Manifest,
                      result: PublishResult) -> None:
        if self.control.meta(manifest.name).get("cold") == "1":
            result.skipped.append(f"{manifest.name}:cold")
            return
        fmt = RowFormat.of(manifest)
        self._begin(manifest, fmt)
        self._write_shards(reader, manifest, fmt, result)
        shows = reader.shows(manifest)
        if shows is not None:
            self.control.redis.set(self.layout.control("shows", manifest.name),
                                   np.ascontiguousarray(shows[0], "<i8").tobytes())
        self.control.set_meta(manifest.name, cold=1, rows=manifest.data["sparse"]["rows"])
        log.info("published the cold part of %s: %d rows", manifest.name, result.rows)

    def _publish_delta(self, reader: VersionReader, manifest: Manifest,
                       result: PublishResult) -> None:
        if self.control.meta(manifest.name).get("hot") == "1":
            result.skipped.append(f"{manifest.name}:hot")
            return
        fmt = RowFormat.of(manifest)
        self._begin(manifest, fmt)
        sparse = manifest.data["sparse"]
        deleted = np.empty(0, np.int64)
        if sparse.get("deleted_file"):
            deleted = np.array(reader.tensors(manifest, sparse["deleted_file"],
                                              ("keys",))["keys"], np.int64)
        upserts = self._write_shards(reader, manifest, fmt, result)
        # within a delta, deletions apply before upserts: a key in both is present
        deleted = np.setdiff1d(deleted, upserts)
        t0 = time.perf_counter()
        for lo in range(0, len(deleted), WRITE_ROWS):
            part = deleted[lo:lo + WRITE_ROWS]
            self.tier.write(row_keys(self.layout.rows(manifest.name), part),
                            np.zeros((len(part), 0), np.uint8))
        result.seconds += time.perf_counter() - t0
        result.rows += len(deleted)
        touched = np.union1d(upserts, deleted).astype("<i8")
        self.control.redis.set(self.layout.control("keys", manifest.name), touched.tobytes())
        self.control.set_meta(manifest.name, hot=1)
        log.info("published delta %s: %d upserts, %d deletions", manifest.name,
                 len(upserts), len(deleted))


class PublishingExporter(IncrementalExporter):
    """An IncrementalExporter that publishes each version it writes (``train
    --publish-to``, with ``--follow`` as files land). Every part of the version's chain
    not yet in the cluster goes out (a delta's own rows only, once its full version is
    in), so a publish that failed (logged; training goes on) is caught up by the next
    export, or by ``terarec publish``."""

    def __init__(self, uri: str | Path, trainer: Any, *, publish_to: str,
                 namespace: str = "terarec", **kwargs: Any) -> None:
        super().__init__(uri, trainer, **kwargs)
        self.uri = str(uri)
        self.publish_to, self.namespace = publish_to, namespace
        self.storage_options = kwargs.get("storage_options")
        self.published: list[PublishResult] = []

    def export(self, trainer: Any, full: bool = False) -> ExportedVersion:
        result = super().export(trainer, full)
        if self.ctx.is_main:
            try:
                publisher = Publisher(self.publish_to, self.namespace)
                try:
                    self.published.append(publisher.publish(
                        f"{self.uri.rstrip('/')}/{result.name}",
                        part="all",
                        storage_options=self.storage_options))
                finally:
                    publisher.close()
            except Exception as exc:  # the export is written; publishing can be redone
                log.error("publishing %s to %s failed: %s", result.name, self.publish_to, exc)
        return result
