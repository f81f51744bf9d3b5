"""The sparse tier's client: rows written and read in one pipeline per cluster node, reads
hedged to a replica, nodes that fail routed around.

::

    keys ──slot──> master of each slot (topology from CLUSTER SLOTS)
      per node, all sent at once, the replies awaited together by the calling thread:
                              GET pipeline ──> master
                              no answer after the hedge delay (p95 of that node, at least
                              ``hedge_floor_s``) or an error ──> the same pipeline to a
                              replica (READONLY); the first answer wins
      errors (connection refused, MOVED, CLUSTERDOWN) ──> topology refreshed in the
      background; a replica promoted by the cluster is then read as the master

A read that gets no answer before its deadline reports those keys as failed: the caller
decides whether that fails the request (``--strict-sparse``) or scores zero rows.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse

import numpy as np
import redis
from prometheus_client import CollectorRegistry, Counter, Histogram

from terarec.sparsetier import wire

log = logging.getLogger(__name__)
Address = tuple[str, int]
WRITE_CHUNK = 16384  # rows per pipeline
WRITE_DEPTH = 3      # pipelines in flight per master
NODE_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25,
                0.5, 1.0)


class TierError(RuntimeError):
    """The cluster could not be reached, or refused what was asked of it."""


def parse_url(url: str) -> list[Address]:
    """Seed nodes of ``redis://host:port[,host:port...]``."""
    parsed = urlparse(url)
    if parsed.scheme != "redis" or not parsed.netloc:
        raise ValueError(f"sparse tier URL {url!r}: expected redis://HOST:PORT[,HOST:PORT...]")
    seeds = []
    for part in parsed.netloc.split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"sparse tier URL {url!r}: {part!r} is not HOST:PORT")
        seeds.append((host, int(port)))
    return seeds


class TierMetrics:
    """Prometheus metrics of the sparse tier, in the caller's registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.node_latency = Histogram("terarec_sparse_node_latency_seconds",
                                      "Latency of one pipelined read, by node and role",
                                      ["node", "role"], buckets=NODE_BUCKETS, registry=r)
        self.hedges_sent = Counter("terarec_sparse_hedges_sent",
                                   "Reads sent again to a replica after the hedge delay",
                                   registry=r)
        self.hedges_won = Counter("terarec_sparse_hedges_won",
                                  "Hedged reads the replica answered first", registry=r)
        self.failovers = Counter("terarec_sparse_failovers",
                                 "Shards whose master changed (seen by a topology refresh)",
                                 registry=r)
        self.read_failures = Counter("terarec_sparse_read_failures",
                                     "Rows not read from the cluster within the deadline",
                                     registry=r)
        self.node_errors = Counter("terarec_sparse_node_errors",
                                   "Failed reads or writes, by node", ["node"], registry=r)
        self.rows_read = Counter("terarec_sparse_rows_read", "Rows asked of the cluster",
                                 registry=r)
        self.lookups = Counter("terarec_sparse_lookups",
                               "Keys looked up in a version's rows (after the row cache)",
                               registry=r)
        self.hot_hits = Counter("terarec_sparse_hot_hits",
                                "Keys found among the hot rows held in local memory",
                                registry=r)


class NodeConn:
    """One socket to one node; used by one thread at a time. Replies are parsed as their
    bytes arrive (``begin`` then ``step`` until True), so one thread can wait on many
    nodes at once; bytes past the replies asked for (of commands sent after them) are
    kept for the next ``begin``. A replica's connection sends READONLY in front of its
    first commands (nothing is waited for before them)."""

    def __init__(self, address: Address, readonly: bool, timeout_s: float,
                 connect_timeout_s: float | None = None) -> None:
        self.address = address
        self.sock = socket.create_connection(address, timeout=connect_timeout_s or timeout_s)
        self.sock.settimeout(timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._left = bytearray()
        self._buf = bytearray()
        self._parser = wire.ReplyParser(0)
        self._chunk = bytearray(1 << 18)
        self._prefix = wire.pack_command(b"READONLY") if readonly else b""
        self._skip = 0  # replies of the prefix, in front of the next ones asked for

    def send(self, payload: bytes) -> None:
        if self._prefix:
            payload, self._prefix, self._skip = self._prefix + payload, b"", 1
        self.sock.sendall(payload)

    def begin(self, n: int) -> bool:
        """Expect the replies of the next ``n`` commands sent; True if they are in."""
        self._buf, self._left = self._left, bytearray()
        self._parser = wire.ReplyParser(n + self._skip)
        return self._parse()

    def step(self) -> bool:
        """Read what the socket holds (one ``recv``: blocks only when nothing has come);
        True once the replies asked for are in."""
        view = memoryview(self._chunk)
        got = self.sock.recv_into(view)
        if not got:
            raise ConnectionError(f"{self.address}: connection closed")
        self._buf += view[:got]
        return self._parse()

    def _parse(self) -> bool:
        arr = np.frombuffer(self._buf, np.uint8)
        done = self._parser.feed(arr)
        del arr  # the buffer grows on the next recv
        return done

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(reply buffer, offsets, lengths) of the replies ``begin`` asked for."""
        used = self._parser.consumed
        if used < len(self._buf):
            self._left = self._buf[used:]
        skip, self._skip = self._skip, 0
        return (np.frombuffer(self._buf, np.uint8), self._parser.offsets[skip:],
                self._parser.lengths[skip:])

    def receive(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Block for the replies of the next ``n`` commands sent."""
        done = self.begin(n)
        while not done:
            done = self.step()
        return self.result()

    def call(self, payload: bytes, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Send ``n`` pipelined commands; (reply buffer, offsets, lengths)."""
        self.send(payload)
        return self.receive(n)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass(frozen=True)
class Shard:
    """A slot range's master and replicas."""

    master: Address
    replicas: tuple[Address, ...]


class Topology:
    """Slot -> shard map, from CLUSTER SLOTS."""

    def __init__(self, shards: list[Shard], slot_shard: np.ndarray) -> None:
        self.shards = shards
        self.slot_shard = slot_shard

    @classmethod
    def fetch(cls, nodes: list[Address], timeout_s: float) -> Topology:
        """The slot map as the first node of ``nodes`` that answers sees it."""
        last: Exception | None = None
        for address in nodes:
            client = redis.Redis(host=address[0], port=address[1], socket_timeout=timeout_s,
                                 socket_connect_timeout=timeout_s)
            try:
                return cls._parse(address, client.execute_command("CLUSTER", "SLOTS"))
            except (redis.RedisError, OSError, TierError) as exc:
                last = exc
            finally:
                client.close()
        raise TierError(f"no cluster node answered CLUSTER SLOTS ({nodes}): {last}")

    @classmethod
    def _parse(cls, address: Address, slots: list) -> Topology:
        shards: list[Shard] = []
        index: dict[Shard, int] = {}
        slot_shard = np.full(wire.SLOTS, -1, np.int32)
        for entry in slots:
            start, end = int(entry[0]), int(entry[1])
            nodes = [(n[0].decode() if isinstance(n[0], bytes) else str(n[0]), int(n[1]))
                     for n in entry[2:]]
            shard = Shard(nodes[0], tuple(nodes[1:]))
            if shard not in index:
                index[shard] = len(shards)
                shards.append(shard)
            slot_shard[start:end + 1] = index[shard]
        if (slot_shard < 0).any():
            raise TierError(f"{address}: {int((slot_shard < 0).sum())} slots have no node")
        return cls(shards, slot_shard)

    def masters(self) -> set[Address]:
        return {s.master for s in self.shards}


class _Latency:
    """Recent read latencies of one node; ``p95`` is the default hedge delay."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=256)
        self.p95 = 0.0
        self._since = 0

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        self._since += 1
        if self._since >= 16:
            self._since = 0
            self.p95 = float(np.percentile(np.fromiter(self.samples, float), 95))


class SparseTier:
    """Rows of fixed width under binary keys, in a Redis Cluster.

    ``hedge``: send a read to a replica when the master has not answered within the hedge
    delay (``hedge_delay_s`` if given, else the node's observed p95, at least
    ``hedge_floor_s``). ``timeout_s`` bounds one socket operation; the slot map is
    re-read every ``refresh_s`` and after errors.
    """

    def __init__(self, url: str, *, metrics: TierMetrics | None = None, hedge: bool = True,
                 hedge_floor_s: float = 0.002, hedge_delay_s: float | None = None,
                 timeout_s: float = 2.0, workers: int = 64, refresh_s: float = 1.0) -> None:
        self.url = url
        self.seeds = parse_url(url)
        self.metrics = metrics or TierMetrics()
        self.hedge = hedge
        self.hedge_floor_s = hedge_floor_s
        self.hedge_delay_s = hedge_delay_s
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="terarec-tier")
        self._conns: dict[tuple[Address, bool], list[NodeConn]] = {}
        self._conns_lock = threading.Lock()
        self._latency: dict[Address, _Latency] = {}
        self._refreshing = threading.Lock()
        self._last_refresh = 0.0
        self.topology = Topology.fetch(self.seeds, timeout_s)
        self._known: list[Address] = self._all_nodes(self.topology)
        # the slot map is also re-read every refresh_s: a failover is seen even when no
        # read failed (the rows being hot, cached or on other shards)
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, args=(refresh_s,),
                                           name="terarec-topology", daemon=True)
        self._refresher.start()

    def _refresh_loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.refresh_topology()

    # -- topology ---------------------------------------------------------------------
    def _all_nodes(self, topo: Topology) -> list[Address]:
        nodes = list(self.seeds)
        for shard in topo.shards:
            nodes += [shard.master, *shard.replicas]
        return list(dict.fromkeys(nodes))

    def refresh_topology(self, force: bool = False) -> None:
        """Re-read the slot map (at most every 0.2 s unless ``force``); count shards whose
        master changed as failovers."""
        if not self._refreshing.acquire(blocking=force):
            return
        try:
            if not force and time.monotonic() - self._last_refresh < 0.2:
                return
            self._last_refresh = time.monotonic()
            old = self.topology
            new = Topology.fetch(list(dict.fromkeys([*self._known, *self.seeds])),
                                 self.timeout_s)
            changed = sum(1 for shard in new.shards
                          if shard.master not in old.masters()
                          and any(shard.master in s.replicas for s in old.shards))
            if changed:
                log.warning("sparse tier: %d shard(s) failed over to a new master", changed)
                self.metrics.failovers.inc(changed)
            self.topology = new
            self._known = list(dict.fromkeys([*self._known, *self._all_nodes(new)]))
        except TierError as exc:
            log.warning("sparse tier: topology refresh failed: %s", exc)
        finally:
            self._refreshing.release()

    def _refresh_soon(self) -> None:
        self._pool.submit(self.refresh_topology)

    # -- connections -------------------------------------------------------------------
    def _take(self, address: Address, readonly: bool,
              connect_timeout_s: float | None = None) -> NodeConn:
        with self._conns_lock:
            free = self._conns.get((address, readonly))
            if free:
                return free.pop()
        return NodeConn(address, readonly, self.timeout_s, connect_timeout_s)

    def _give(self, conn: NodeConn, readonly: bool) -> None:
        with self._conns_lock:
            self._conns.setdefault((conn.address, readonly), []).append(conn)

    def _call(self, address: Address, readonly: bool, payload: bytes, n: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        conn = self._take(address, readonly)
        try:
            out = conn.call(payload, n)
        except BaseException:
            conn.close()
            raise
        self._give(conn, readonly)
        return out

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._conns_lock:
            for conns in self._conns.values():
                for conn in conns:
                    conn.close()
            self._conns.clear()

    # -- writes -------------------------------------------------------------------------
    def write(self, keys: np.ndarray, values: np.ndarray, chunk: int = WRITE_CHUNK,
              attempts: int = 5, depth: int = WRITE_DEPTH) -> None:
        """Set each ``keys[i]`` (uint8 [n, K]) to ``values[i]`` (uint8 [n, M]): one
        connection per master, ``depth`` pipelines of about ``chunk`` rows in flight on
        it (an MSET per slot), the masters written in parallel. A pipeline refused
        (MOVED, a master down) is retried after a topology refresh."""
        if not len(keys):
            return
        slots = wire.key_slots(keys)
        todo = [np.arange(len(keys))]
        for attempt in range(attempts):
            shard_of = self.topology.slot_shard[slots]
            groups = [(self.topology.shards[s].master, idx[shard_of[idx] == s])
                      for idx in todo for s in np.unique(shard_of[idx])]
            futures = [self._pool.submit(self._write_node, address, keys, values, slots, idx,
                                         chunk, depth) for address, idx in groups]
            failed = []
            for fut in futures:
                left = fut.result()
                if len(left):
                    failed.append(left)
            if not failed:
                return
            todo = failed
            time.sleep(0.2 * (attempt + 1))
            self.refresh_topology(force=True)
        raise TierError(f"{sum(len(f) for f in todo)} rows could not be written to "
                        f"{self.url} after {attempts} attempts")

    def _write_node(self, address: Address, keys: np.ndarray, values: np.ndarray,
                    slots: np.ndarray, idx: np.ndarray, chunk: int, depth: int
                    ) -> np.ndarray:
        """Write rows ``idx`` to one node in MSETs of one slot's rows, ``chunk`` rows a
        pipeline, up to ``depth`` pipelines sent before the oldest one's replies are read
        (the node never waits for the client); returns the indices not written."""
        order = np.argsort(slots[idx], kind="stable")
        idx = idx[order]
        starts = wire.mset_starts(slots[idx])
        # pipelines end at command boundaries, about every ``chunk`` rows
        cuts = [*starts[np.flatnonzero(np.diff(starts // max(1, chunk))) + 1].tolist(),
                len(idx)]
        done = 0  # rows of idx[:done] acknowledged
        conn: NodeConn | None = None
        try:
            conn = self._take(address, False)
            sent: deque[tuple[int, int]] = deque()  # (rows, commands) of each pipeline
            lo, cut = 0, 0
            while lo < len(idx) or sent:
                if lo < len(idx):
                    hi = cuts[cut]
                    cut += 1
                    first, last = np.searchsorted(starts, [lo, hi])
                    part = idx[lo:hi]
                    conn.send(wire.pack_msets(keys[part], values[part],
                                              starts[first:last] - lo))
                    sent.append((hi - lo, int(last - first)))
                    lo = hi
                    if len(sent) < depth and lo < len(idx):
                        continue
                rows, commands = sent.popleft()
                _, _, lengths = conn.receive(commands)
                if not bool((lengths == -2).all()):
                    raise wire.ReplyError("unexpected reply to MSET")
                done += rows
        except (OSError, wire.ReplyError) as exc:
            if conn is not None:
                conn.close()
            self.metrics.node_errors.labels(f"{address[0]}:{address[1]}").inc()
            log.warning("sparse tier: write to %s:%d failed (%s)", *address, exc)
            return idx[done:]
        self._give(conn, False)
        return idx[:0]

    def delete(self, keys: list[bytes]) -> None:
        """``UNLINK`` keys (any slots), one pipeline per node."""
        if not keys:
            return
        arr = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), -1) if len(
            {len(k) for k in keys}) == 1 else None
        slots = (wire.key_slots(arr) if arr is not None
                 else np.array([_slot(k) for k in keys], np.int32))
        shard_of = self.topology.slot_shard[slots]
        for s in np.unique(shard_of):
            address = self.topology.shards[s].master
            sel = np.flatnonzero(shard_of == s)
            for lo in range(0, len(sel), 8192):
                part = sel[lo:lo + 8192]
                payload = b"".join(wire.pack_command(b"UNLINK", keys[i]) for i in part)
                self._call(address, False, payload, len(part))

    def scan_prefix(self, prefix: bytes) -> list[bytes]:
        """Every key starting with ``prefix`` (no glob characters), on every master."""
        out: list[bytes] = []
        for address in self.topology.masters():
            client = redis.Redis(host=address[0], port=address[1], socket_timeout=5)
            try:
                out += list(client.scan_iter(match=prefix + b"*", count=10000))
            finally:
                client.close()
        return out

    # -- reads --------------------------------------------------------------------------
    def _delay(self, address: Address) -> float:
        if self.hedge_delay_s is not None:
            return self.hedge_delay_s
        stats = self._latency.get(address)
        return max(self.hedge_floor_s, stats.p95 if stats else 0.0)

    def read(self, keys: np.ndarray, width: int, deadline_s: float
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(values uint8 [n, width], found, failed) of row ``keys`` (uint8 [n, K]); a key
        is failed when neither its master nor a replica answered within ``deadline_s``.

        The calling thread sends every node's pipeline, then waits on all their sockets
        at once (no hand-off to other threads, so no wait for the GIL between a reply
        and its parse); an attempt still out when its shard is answered is dropped with
        its connection."""
        n = len(keys)
        values = np.zeros((n, width), np.uint8)
        found = np.zeros(n, np.bool_)
        failed = np.zeros(n, np.bool_)
        if not n:
            return values, found, failed
        self.metrics.rows_read.inc(n)
        start = time.monotonic()
        deadline = start + deadline_s
        topo = self.topology
        shard_of = topo.slot_shard[wire.key_slots(keys)]
        order = np.argsort(shard_of, kind="stable")
        bounds = np.flatnonzero(np.diff(shard_of[order])) + 1
        groups = [_Group(topo.shards[int(shard_of[idx[0]])], idx, 0.0)
                  for idx in np.split(order, bounds)]
        sel = selectors.DefaultSelector()
        try:
            for g in groups:
                g.keys = keys[g.idx]
                g.hedge_at = start + self._delay(g.shard.master)
                self._attempt(g, g.shard.master, False, sel, deadline)
            while True:
                open_groups = [g for g in groups if not g.done and not g.exhausted]
                now = time.monotonic()
                if not open_groups or now >= deadline:
                    break
                for g in open_groups:  # hedge the groups past their delay
                    if self.hedge and not g.hedged and now >= g.hedge_at:
                        g.hedged = True
                        if self._next_replica(g, sel, deadline):
                            self.metrics.hedges_sent.inc()
                waits = [g.hedge_at for g in open_groups
                         if self.hedge and not g.hedged and not g.done]
                until = min([deadline, *waits])
                for key, _ in sel.select(max(0.0, until - time.monotonic())):
                    self._on_ready(key.data, sel, values, found, width, deadline)
        finally:
            for key in list(sel.get_map().values()):
                key.data.conn.close()  # replies still due on it: not reusable
            sel.close()
        for g in groups:
            if not g.done:
                failed[g.idx] = True
        if failed.any():
            self.metrics.read_failures.inc(int(failed.sum()))
        return values, found, failed

    def _attempt(self, g: _Group, address: Address, readonly: bool,
                 sel: selectors.BaseSelector, deadline: float) -> None:
        """Send group ``g``'s GETs to ``address``; a node that cannot be reached (a new
        connection taking longer than its hedge delay) is routed around at once."""
        g.tried.add(address)
        conn: NodeConn | None = None
        try:
            connect_s = min(max(0.01, self._delay(address)), deadline - time.monotonic())
            conn = self._take(address, readonly, max(0.001, connect_s))
            started = time.perf_counter()
            conn.send(wire.pack_gets(g.keys))
            conn.begin(len(g.keys))
        except (OSError, wire.ReplyError) as exc:
            if conn is not None:
                conn.close()
            self._failed(g, address, readonly, exc, sel, deadline)
            return
        g.live += 1
        sel.register(conn.sock, selectors.EVENT_READ, _Attempt(g, conn, readonly, started))

    def _failed(self, g: _Group, address: Address, readonly: bool, exc: Exception,
                sel: selectors.BaseSelector, deadline: float) -> None:
        self.metrics.node_errors.labels(f"{address[0]}:{address[1]}").inc()
        log.debug("sparse tier: read from %s:%d failed (%s)", *address, exc)
        self._refresh_soon()
        g.master_failed = g.master_failed or not readonly
        # route around at once: the next replica, hedging or not
        if not self._next_replica(g, sel, deadline) and not g.live:
            g.exhausted = True

    def _next_replica(self, g: _Group, sel: selectors.BaseSelector, deadline: float) -> bool:
        """Send group ``g`` to its next untried replica; False when none is left."""
        for replica in g.shard.replicas:
            if replica not in g.tried:
                self._attempt(g, replica, True, sel, deadline)
                return True
        return False

    def _on_ready(self, attempt: _Attempt, sel: selectors.BaseSelector, values: np.ndarray,
                  found: np.ndarray, width: int, deadline: float) -> None:
        g, conn = attempt.group, attempt.conn
        try:
            if not conn.step():
                return
        except (OSError, wire.ReplyError) as exc:
            sel.unregister(conn.sock)
            conn.close()
            g.live -= 1
            self._failed(g, conn.address, attempt.readonly, exc, sel, deadline)
            return
        sel.unregister(conn.sock)
        g.live -= 1
        seconds = time.perf_counter() - attempt.started
        address = conn.address
        self._latency.setdefault(address, _Latency()).add(seconds)
        self.metrics.node_latency.labels(f"{address[0]}:{address[1]}",
                                         "replica" if attempt.readonly else "master"
                                         ).observe(seconds)
        buf, offsets, lengths = conn.result()
        self._give(conn, attempt.readonly)
        if g.done:
            return
        values[g.idx], found[g.idx] = wire.gather_values(buf, offsets, lengths, width)
        g.done = True
        if attempt.readonly and not g.master_failed:
            self.metrics.hedges_won.inc()


@dataclass
class _Attempt:
    """One group's GETs sent to one node, their replies awaited."""

    group: _Group
    conn: NodeConn
    readonly: bool
    started: float


@dataclass
class _Group:
    """The keys of one read that live on one shard."""

    shard: Shard
    idx: np.ndarray
    hedge_at: float
    done: bool = False
    hedged: bool = False
    exhausted: bool = False
    master_failed: bool = False
    live: int = 0  # attempts sent, replies still due

    def __post_init__(self) -> None:
        self.tried: set[Address] = set()
        self.keys = np.empty((0, 0), np.uint8)


def _slot(key: bytes) -> int:
    from redis.crc import key_slot

    return int(key_slot(key))
