"""The control keys of a published model (layout.py): announced versions, what each
holds, which servers use which version, and garbage collection of the rest.

A version is announced (added to ``{NS}:announced``) only once every row of its chain is
in the cluster; a server takes the newest announced version and re-registers it every
few seconds with an expiry, so a publisher can tell which older versions nobody reads.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import numpy as np
from redis.cluster import ClusterNode, RedisCluster

from terarec.sparsetier.layout import Layout
from terarec.sparsetier.tier import SparseTier, parse_url
from terarec.sparsetier.wire import row_keys

log = logging.getLogger(__name__)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Control:
    """Control keys of namespace ``layout.ns`` in the cluster at ``url``."""

    def __init__(self, url: str, layout: Layout) -> None:
        self.layout = layout
        nodes = [ClusterNode(host, port) for host, port in parse_url(url)]
        # Any: redis-py types every reply as "value or awaitable" (sync and async share it)
        self.redis: Any = RedisCluster(startup_nodes=nodes, socket_timeout=5)

    def close(self) -> None:
        self.redis.close()

    # -- versions -----------------------------------------------------------------------
    def announced(self) -> list[tuple[str, int]]:
        """Announced versions (name, number), oldest first."""
        return [(_text(m), int(s)) for m, s in
                self.redis.zrange(self.layout.announced, 0, -1, withscores=True)]

    def newest(self) -> str | None:
        versions = self.announced()
        return versions[-1][0] if versions else None

    def meta(self, version: str) -> dict[str, str]:
        raw = self.redis.hgetall(self.layout.control("meta", version))
        return {_text(k): _text(v) for k, v in raw.items()}

    def set_meta(self, version: str, **fields: Any) -> None:
        self.redis.hset(self.layout.control("meta", version),
                        mapping={k: str(v) for k, v in fields.items()})

    def announce(self, version: str, number: int) -> None:
        self.set_meta(version, announced_at=time.time())
        self.redis.zadd(self.layout.announced, {version: number})

    def keys_of(self, version: str) -> np.ndarray:
        """A delta's touched keys (sorted int64)."""
        raw = self.redis.get(self.layout.control("keys", version)) or b""
        return np.frombuffer(raw, "<i8").astype(np.int64)

    def shows_of(self, base: str) -> np.ndarray:
        raw = self.redis.get(self.layout.control("shows", base)) or b""
        return np.frombuffer(raw, "<i8").astype(np.int64)

    def codebooks(self, version: str) -> dict[int, np.ndarray]:
        raw = self.redis.hgetall(self.layout.control("codebooks", version))
        return {int(_text(k)): np.frombuffer(v, "<f4").astype(np.float32)
                for k, v in raw.items()}

    # -- servers ------------------------------------------------------------------------
    def register(self, server: str, version: str, ttl_s: float,
                 previous: str | None = None) -> None:
        """Say that ``server`` uses ``version`` for the next ``ttl_s`` seconds."""
        pipe = self.redis.pipeline(transaction=False)
        if previous is not None and previous != version:
            pipe.zrem(self.layout.servers, f"{server} {previous}")
        pipe.zadd(self.layout.servers, {f"{server} {version}": time.time() + ttl_s})
        pipe.execute()

    def unregister(self, server: str, version: str) -> None:
        self.redis.zrem(self.layout.servers, f"{server} {version}")

    def in_use(self) -> set[str]:
        """Versions some live server registered (expired entries are dropped)."""
        self.redis.zremrangebyscore(self.layout.servers, "-inf", time.time())
        return {_text(m).rsplit(" ", 1)[1] for m in self.redis.zrange(self.layout.servers, 0, -1)}

    # -- garbage collection -------------------------------------------------------------
    def collect(self, tier: SparseTier, grace_s: float = 30.0) -> list[str]:
        """Remove versions older than the newest announced one that no live server uses
        and that were superseded more than ``grace_s`` ago (a server may be about to
        register one it just read): first from the announcements, then their rows."""
        versions = self.announced()
        if not versions:
            return []
        newest, newest_number = versions[-1]
        superseded_at = {name: float(self.meta(nxt).get("announced_at", 0.0))
                         for (name, _), (nxt, _) in zip(versions[:-1], versions[1:], strict=True)}
        keep_heads = self.in_use() | {newest}
        keep: set[str] = set()
        for head in keep_heads:
            keep.update(json.loads(self.meta(head).get("chain", "[]")) or [head])
        published = sorted(_text(v) for v in self.redis.smembers(self.layout.control("published")))
        gone: list[str] = []
        now = time.time()
        for name in published:
            number = int(self.meta(name).get("number", 0))
            if name in keep or number >= newest_number:
                continue
            if name in superseded_at and now - superseded_at[name] < grace_s:
                continue
            if any(name in json.loads(self.meta(h).get("chain", "[]")) for h in keep):
                continue
            self.redis.zrem(self.layout.announced, name)
            gone.append(name)
        for name in gone:
            self.drop(tier, name)
        return gone

    def drop(self, tier: SparseTier, name: str) -> None:
        """Delete every row and control key of version ``name``."""
        meta = self.meta(name)
        if meta.get("kind") == "delta":
            keys = self.keys_of(name)
            rows = [bytes(k) for k in row_keys(self.layout.rows(name), keys)]
        else:
            rows = tier.scan_prefix(self.layout.rows(name))
        tier.delete(rows)
        for what in ("meta", "keys", "shows", "codebooks"):
            self.redis.delete(self.layout.control(what, name))
        self.redis.srem(self.layout.control("published"), name)
        log.info("sparse tier: collected version %s (%d rows)", name, len(rows))
