"""A real Redis Cluster on loopback ports: what the tests, the benchmark, ``terarec
cluster up|status|down`` and a laptop trial of the sparse tier run against
(``redis-server`` and ``redis-cli`` from the system).

Each node is a ``redis-server`` process with its own folder (``nodes.conf``, no
persistence) and ``--cluster-enabled yes``; ``redis-cli --cluster create`` assigns the
16384 slots to the masters and one replica to each. ``enable-debug-command`` lets fault
tests stall a node (``DEBUG SLEEP``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from terarec.loopback import free_ports, port_free


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
    # ``terarec cluster up``: nodes on ``base_port``, ``base_port + 1``, ... (a port
    # taken is an error, not a reason to choose others), in their own session so that
    # they outlive the command and a Ctrl-C in its terminal.
    base_port: int | None = None
    detached: bool = False

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
                                            stderr=subprocess.DEVNULL,
                                            start_new_session=self.detached)

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
        if self.masters < 3:
            raise ClusterStartError(f"a Redis Cluster needs at least 3 masters, "
                                    f"got {self.masters}")
        if self.replicas < 0:
            raise ClusterStartError(f"replicas must be >= 0, got {self.replicas}")
        for _ in range(2 if self.base_port is None else 0):
            try:
                return self._start_on_free_ports(timeout_s)
            except _PortTaken:  # another process bound a chosen port first: choose again
                pass
        try:
            return self._start_on_free_ports(timeout_s)
        except _PortTaken as exc:
            raise ClusterStartError(str(exc)) from None

    def _start_on_free_ports(self, timeout_s: float) -> LocalCluster:
        if self.root.exists():
            shutil.rmtree(self.root)
        count = self.masters * (1 + self.replicas)
        if self.base_port is None:
            self.ports = free_ports(count, offsets=(0, 10_000))
        else:
            self.ports = list(range(self.base_port, self.base_port + count))
            taken = [p for p in self.ports for o in (0, 10_000) if not port_free(p + o)]
            if taken:
                raise ClusterStartError(
                    f"port(s) {', '.join(map(str, taken))} already in use (a node needs "
                    f"its port and port + 10000 for the cluster bus); choose another "
                    f"--port")
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


# -- a cluster that outlives the command that started it (``terarec cluster``) ------------
STATE_FILE = "cluster.json"


@dataclass(frozen=True)
class NodeStatus:
    """One node of a started cluster as it answers now."""

    port: int
    pid: int
    alive: bool
    role: str  # "master", "replica", or "down" when it does not answer
    slots: int  # slots this master serves (0 for a replica)


@dataclass(frozen=True)
class ClusterStatus:
    """A started cluster: its folder, seed URL and nodes; ``ok`` when every node answers
    and all 16384 slots are served."""

    root: Path
    url: str
    masters: int
    replicas: int
    nodes: tuple[NodeStatus, ...]
    state: str  # the cluster's ``cluster_state`` as a live node sees it, or "down"
    slots_ok: int

    @property
    def ok(self) -> bool:
        return (self.state == "ok" and self.slots_ok == 16384
                and all(n.alive for n in self.nodes))

    def to_dict(self) -> dict[str, object]:
        return {"dir": str(self.root), "url": self.url, "masters": self.masters,
                "replicas": self.replicas, "state": self.state, "slots_ok": self.slots_ok,
                "ok": self.ok,
                "nodes": [{"port": n.port, "pid": n.pid, "alive": n.alive, "role": n.role,
                           "slots": n.slots} for n in self.nodes]}


def cluster_up(root: Path, *, masters: int = 3, replicas: int = 1, port: int = 7000,
               node_timeout_ms: int = 5000, timeout_s: float = 60.0) -> ClusterStatus:
    """Start a cluster under ``root`` on ports ``port`` .. ``port + n - 1`` whose nodes
    keep running after this call returns (stop it with ``cluster_down``). Refused when
    ``root`` holds a cluster that is still running."""
    root = Path(root)
    last = port + masters * (1 + max(replicas, 0)) - 1
    if port < 1 or last + 10_000 > 65_535:
        raise ClusterStartError(f"--port {port}: the nodes need ports {port}-{last} and "
                                f"their bus ports (+10000) within 1-65535")
    if (root / STATE_FILE).exists():
        running = [n for n in cluster_status(root).nodes if n.alive]
        if running:
            raise ClusterStartError(
                f"{root} already runs a cluster ({len(running)} nodes alive, first on "
                f"port {running[0].port}); stop it with `terarec cluster down --dir "
                f"{root}`")
    cluster = LocalCluster(root, masters=masters, replicas=replicas,
                           node_timeout_ms=node_timeout_ms, base_port=port, detached=True)
    cluster.start(timeout_s)
    state = {"masters": masters, "replicas": replicas, "ports": cluster.ports,
             "pids": {str(p): proc.pid for p, proc in cluster.procs.items()}}
    tmp = root / f"{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(root / STATE_FILE)
    return cluster_status(root)


def _read_state(root: Path) -> dict:
    path = Path(root) / STATE_FILE
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("ports"), list):
            raise ValueError("no ports list")
        return state
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no cluster started here (start one with "
                                f"`terarec cluster up --dir {root}`)") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not a cluster state file ({exc})") from None


def _node_of(root: Path, port: int) -> bool:
    """Whether the process answering on ``port`` is this cluster's node (its ``dir``),
    not a process that took the port since."""
    try:
        answered = redis.Redis(port=port, socket_timeout=1,
                               retry=Retry(NoBackoff(), 0)).config_get("dir")
    except redis.RedisError:
        return False
    return bool(answered.get("dir") == str((Path(root) / str(port)).resolve()))


def cluster_status(root: Path) -> ClusterStatus:
    """What each node of the cluster started under ``root`` answers now."""
    root = Path(root)
    state = _read_state(root)
    nodes: list[NodeStatus] = []
    cluster_state, slots_ok = "down", 0
    for port in state["ports"]:
        pid = int(state.get("pids", {}).get(str(port), 0))
        if not _node_of(root, port):
            nodes.append(NodeStatus(port, pid, False, "down", 0))
            continue
        client = redis.Redis(port=port, socket_timeout=1, retry=Retry(NoBackoff(), 0))
        try:
            role = str(client.info("replication")["role"])
            slots = 0
            if role == "master":
                me = client.execute_command("CLUSTER", "MYID")
                me = me.decode() if isinstance(me, bytes) else str(me)
                for entry in client.execute_command("CLUSTER", "SLOTS"):
                    node_id = entry[2][2] if len(entry[2]) > 2 else None
                    node_id = node_id.decode() if isinstance(node_id, bytes) else node_id
                    if node_id == me:
                        slots += int(entry[1]) - int(entry[0]) + 1
            if cluster_state == "down":
                info = client.cluster("info")
                cluster_state = str(info.get("cluster_state", "down"))
                slots_ok = int(info.get("cluster_slots_ok", 0))
        except redis.RedisError:
            nodes.append(NodeStatus(port, pid, False, "down", 0))
            continue
        nodes.append(NodeStatus(port, pid, True, "replica" if role == "slave" else role,
                                slots))
    ports = [n.port for n in nodes if n.alive] or state["ports"]
    return ClusterStatus(root, f"redis://127.0.0.1:{ports[0]}", int(state.get("masters", 0)),
                         int(state.get("replicas", 0)), tuple(nodes), cluster_state,
                         slots_ok)


def cluster_down(root: Path, timeout_s: float = 10.0) -> list[int]:
    """Stop every node of the cluster started under ``root`` and remove the folder;
    returns the ports of the nodes that were still running. Only processes that answer
    as this cluster's nodes are signalled."""
    root = Path(root)
    state = _read_state(root)
    stopped: list[int] = []
    for port in state["ports"]:
        pid = int(state.get("pids", {}).get(str(port), 0))
        if pid > 0 and _node_of(root, port):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            stopped.append(port)
    deadline = time.monotonic() + timeout_s
    for port in stopped:
        pid = int(state["pids"][str(port)])
        while _alive(pid):
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + timeout_s
            time.sleep(0.05)
    shutil.rmtree(root, ignore_errors=True)
    return stopped


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a child of this process that exited is reaped)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:  # not our child: the system reaps it
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

