"""``terarec cluster up|status|down`` starts a Redis Cluster that outlives the command,
reports it and stops it; the recipe for a real cluster (deploy/redis-cluster/) is
well-formed, boots a cluster node and agrees with the ports the guide documents."""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import yaml

from terarec.cli.main import main
from terarec.config import ModelConfig
from terarec.export import ModelExporter
from terarec.loopback import free_ports
from terarec.models import build_model
from terarec.sparsetier.local import redis_binaries
from terarec.types import FeatureSchema

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "deploy" / "redis-cluster"
needs_redis = pytest.mark.skipif(redis_binaries() is None,
                                 reason="redis-server / redis-cli not installed")


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "terarec", *argv], capture_output=True,
                          text=True, env=env, timeout=120)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and " Z " not in Path(
        f"/proc/{pid}/stat").read_text()


@needs_redis
def test_up_status_publish_down(tmp_path, capsys):
    # six nodes on consecutive ports, each with its bus port free
    base = free_ports(1, offsets=(*range(6), *range(10_000, 10_006)))[0]
    folder = tmp_path / "cluster"
    up = _cli("cluster", "up", "--dir", str(folder), "--port", str(base))
    try:
        assert up.returncode == 0, up.stderr
        assert f"redis://127.0.0.1:{base}" in up.stdout
        status = _cli("cluster", "status", "--dir", str(folder), "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        st = json.loads(status.stdout)
        assert st["ok"] and st["slots_ok"] == 16384
        assert [n["port"] for n in st["nodes"]] == list(range(base, base + 6))
        assert sorted(n["role"] for n in st["nodes"]) == ["master"] * 3 + ["replica"] * 3
        assert sum(n["slots"] for n in st["nodes"]) == 16384
        # the nodes outlived `up`: a version publishes to them
        schema, config = FeatureSchema.criteo(), ModelConfig(name="lr")
        model = build_model(schema, config)
        keys = np.sort(np.arange(1, 501, dtype=np.int64) * 7919)
        ModelExporter(tmp_path / "export").write_full(
            schema=schema, model_config=config, dense=model.state_dict(), keys=keys,
            values=np.ones((len(keys), model.row_dim), np.float32), pass_id=1)
        capsys.readouterr()
        assert main(["publish", str(tmp_path / "export"), "--to", st["url"]]) == 0
        printed = capsys.readouterr().out.splitlines()
        assert len(printed) == 1, printed  # one line: what, where, how many rows
        assert printed[0].startswith(f"published v000001 (all) to {st['url']} namespace "
                                     f"terarec: 500 rows in ")
        assert printed[0].endswith("; announced")
        assert main(["publish", str(tmp_path / "export"), "--to", st["url"], "--json"]) == 0
        again_json = json.loads(capsys.readouterr().out)
        assert again_json["rows"] == 0 and again_json["to"] == st["url"]
        assert again_json["skipped"] and again_json["announced"]
        client = redis.RedisCluster(host="127.0.0.1", port=base)
        assert client.exists("{terarec}:announced") == 1
        client.close()
        again = _cli("cluster", "up", "--dir", str(folder), "--port", str(base))
        assert again.returncode == 2 and "already runs a cluster" in again.stderr
    finally:
        down = _cli("cluster", "down", "--dir", str(folder))
    assert down.returncode == 0, down.stderr
    assert "stopped 6 node(s)" in down.stdout
    deadline = time.monotonic() + 10
    while any(_pid_alive(n["pid"]) for n in st["nodes"]):
        assert time.monotonic() < deadline, "a node outlived `cluster down`"
        time.sleep(0.1)
    assert not folder.exists()
    gone = _cli("cluster", "status", "--dir", str(folder))
    assert gone.returncode == 2 and "no cluster started here" in gone.stderr


def test_up_refuses_ports_out_of_range_in_one_line(tmp_path, capsys):
    assert main(["cluster", "up", "--dir", str(tmp_path), "--port", "60000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "60000-60005" in err[0]


def test_compose_file_runs_six_nodes_on_the_documented_ports():
    compose = yaml.safe_load((RECIPE / "docker-compose.yml").read_text())
    nodes = {name: s for name, s in compose["services"].items() if name.startswith("redis-")}
    ports = sorted(int(s["command"][s["command"].index("--port") + 1]) for s in nodes.values())
    assert ports == list(range(7000, 7006))
    for name, service in nodes.items():
        assert name == f"redis-{service['command'][3]}"
        assert service["network_mode"] == "host"  # bus ports (+10000) reachable too
        assert any(v.startswith("./redis.conf:") for v in service["volumes"])
        assert set(compose["volumes"]) >= {v.split(":")[0] for v in service["volumes"]
                                           if not v.startswith("./")}
    create = " ".join(compose["services"]["create-cluster"]["command"])
    assert re.findall(r"127\.0\.0\.1:(\d+)", create) == [str(p) for p in ports]
    assert "--cluster-replicas 1" in create
    guide = (ROOT / "docs" / "serving-cluster.md").read_text()
    assert "deploy/redis-cluster/" in guide and "redis://127.0.0.1:7000" in guide
    assert "7000-7005" in guide and "17000-17005" in guide


def test_systemd_unit_runs_the_shared_config_per_port():
    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((RECIPE / "redis-cluster@.service").read_text())
    assert set(unit.sections()) == {"Unit", "Service", "Install"}
    exec_start = unit["Service"]["ExecStart"].split()
    assert exec_start[0].endswith("redis-server")
    assert exec_start[1] == "/etc/redis-cluster/redis.conf"
    assert exec_start[exec_start.index("--port") + 1] == "%i"
    assert unit["Service"]["Type"] == "notify" and "--supervised" in exec_start
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@needs_redis
def test_recipe_redis_conf_boots_a_cluster_node(tmp_path):
    conf = RECIPE / "redis.conf"
    settings = dict(line.split(None, 1) for line in conf.read_text().splitlines()
                    if line.strip() and not line.startswith("#"))
    assert settings["port"] == "7000" and settings["cluster-enabled"] == "yes"
    assert settings["cluster-allow-reads-when-down"] == "yes"
    assert settings["maxmemory-policy"] == "noeviction"
    port = free_ports(1, offsets=(0, 10_000))[0]
    proc = subprocess.Popen([redis_binaries()[0], str(conf), "--port", str(port),  # type: ignore[index]
                             "--dir", str(tmp_path), "--bind", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        client = redis.Redis(port=port, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, proc.stderr.read()  # type: ignore[union-attr]
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert client.info("cluster")["cluster_enabled"] == 1
        assert client.config_get("cluster-node-timeout")["cluster-node-timeout"] == "5000"
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    finally:
        proc.kill()
        proc.wait()
