"""A real Redis Cluster on loopback ports: what the tests, the benchmark and a laptop trial
of the sparse tier run against (``redis-server`` and ``redis-cli`` from the system).

Each node is a ``redis-server`` process with its own folder (``nodes.conf``, no
persistence) and ``--cluster-enabled yes``; ``redis-cli --cluster create`` assigns the
16384 slots to the masters and one replica to each. ``enable-debug-command`` lets fault
tests stall a node (``DEBUG SLEEP``).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from terarec.loopback import free_ports


class ClusterStartError(RuntimeError):
    """The local cluster did not come up (binary missing, port taken, never healthy)."""


class _PortTaken(ClusterStartError):
    """A node could not listen: its port, free when chosen, was taken before it bound."""


def redis_binaries() -> tuple[str, str] | None:
    """Paths of ``redis-server`` and ``redis-cli``, or None when either is missing."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    return (server, cli) if server and cli else None


@dataclass
class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each under ``root``; ``start()``
    launches and joins them, ``stop()`` kills every process."""

    root: Path
    masters: int = 3
    replicas: int = 1
    node_timeout_ms: int = 1000
    ports: list[int] = field(default_factory=list)
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """A ``redis://`` seed URL (any node; the client discovers the rest)."""
        return f"redis://127.0.0.1:{self.ports[0]}"

    def _launch(self, port: int) -> None:
        binaries = redis_binaries()
        if binaries is None:
            raise ClusterStartError("redis-server / redis-cli not found on PATH")
        folder = self.root / str(port)
        folder.mkdir(parents=True, exist_ok=True)
        args = [binaries[0], "--port", str(port), "--bind", "127.0.0.1",
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--enable-debug-command", "yes",
                "--cluster-allow-reads-when-down", "yes", "--save", "", "--appendonly", "no",
                "--dir", str(folder), "--logfile", str(folder / "redis.log"),
                "--protected-mode", "no", "--io-threads", "1"]
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)

    def _wait_ping(self, port: int, timeout_s: float = 10.0) -> None:
        """Until the node launched on ``port`` answers: the answer must come from this
        node (its ``dir``), not from another process that took the port first."""
        folder = self.root / str(port)
        deadline = time.monotonic() + timeout_s
        while True:
            proc = self.procs.get(port)
            try:
                answered = redis.Redis(port=port, socket_timeout=1,
                                       retry=Retry(NoBackoff(), 0)).config_get("dir")
                if answered.get("dir") == str(folder.resolve()):
                    return
                raise _PortTaken(f"port {port} is served by another process")
            except redis.RedisError:
                if proc is not None and proc.poll() is not None:
                    raise _PortTaken(f"redis-server on port {port} exited at start "
                                     f"(log: {folder / 'redis.log'})") from None
                if time.monotonic() > deadline:
                    raise ClusterStartError(f"redis-server on port {port} did not start "
                                            f"(log: {folder / 'redis.log'})") from None
                time.sleep(0.05)

    def start(self, timeout_s: float = 60.0) -> LocalCluster:
        """Launch fresh nodes, create the cluster and wait until every slot is served."""
        for _ in range(2):
            try:
                return self._start_on_free_ports(timeout_s)
            except _PortTaken:  # another process bound a chosen port first: choose again
                pass
        return self._start_on_free_ports(timeout_s)

    def _start_on_free_ports(self, timeout_s: float) -> LocalCluster:
        if self.root.exists():
            shutil.rmtree(self.root)
        self.ports = free_ports(self.masters * (1 + self.replicas), offsets=(0, 10_000))
        self._bring_up(timeout_s)
        return self

    def _bring_up(self, timeout_s: float) -> None:
        binaries = redis_binaries()
        if binaries is None:
            raise ClusterStartError("redis-server / redis-cli not found on PATH")
        for port in self.ports:
            self._launch(port)
        try:
            for port in self.ports:
                self._wait_ping(port)
            create = [binaries[1], "--cluster", "create",
                      *(f"127.0.0.1:{p}" for p in self.ports),
                      "--cluster-replicas", str(self.replicas), "--cluster-yes"]
            done = subprocess.run(create, capture_output=True, text=True, timeout=timeout_s)
            if done.returncode != 0:
                raise ClusterStartError(f"redis-cli --cluster create failed: "
                                        f"{done.stdout[-2000:]} {done.stderr[-2000:]}")
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until every live node says ``cluster_state:ok``, all slots are assigned and
        every master has its replicas attached."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                ok = True
                for port in self.live_ports():
                    info = redis.Redis(port=port, socket_timeout=1).cluster("info")
                    if (info.get("cluster_state") != "ok"
                            or int(info.get("cluster_slots_ok", 0)) != 16384
                            or int(info.get("cluster_known_nodes", 0)) < len(self.live_ports())):
                        ok, last = False, f"port {port}: {info}"
                        break
                if ok and self._replicas_attached():
                    return
            except redis.RedisError as exc:
                last = str(exc)
            time.sleep(0.1)
        raise ClusterStartError(f"the cluster did not become healthy in {timeout_s:.0f} s "
                                f"({last})")

    def _replicas_attached(self) -> bool:
        want = self.replicas
        for port in self.live_ports():
            info = redis.Redis(port=port, socket_timeout=1).info("replication")
            if info.get("role") == "master" and int(info.get("connected_slaves", 0)) < want:
                return False
            if info.get("role") == "slave" and info.get("master_link_status") != "up":
                return False
            slots = redis.Redis(port=port, socket_timeout=1).execute_command("CLUSTER", "SLOTS")
            if any(len(entry) - 3 < want for entry in slots):  # every node knows the replicas
                return False
        return True

    def live_ports(self) -> list[int]:
        return [p for p in self.ports if p in self.procs and self.procs[p].poll() is None]

    def role(self, port: int) -> str:
        return str(redis.Redis(port=port, socket_timeout=1).info("replication")["role"])

    def master_ports(self) -> list[int]:
        return [p for p in self.live_ports() if self.role(p) == "master"]

    def kill(self, port: int) -> None:
        """``kill -9`` one node (its data is gone; its replica takes over)."""
        proc = self.procs.pop(port)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def restart(self, timeout_s: float = 60.0) -> None:
        """Kill every node and start an empty cluster on the same ports (a site's
        cluster lost and rebuilt: everything must be published again)."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
        self._bring_up(timeout_s)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait()
        self.procs.clear()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
