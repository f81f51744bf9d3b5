"""Serving with the sparse rows in a Redis Cluster: publish speed, latency of 2 server
replicas with hot rows local and the rest in a 3-master / 3-replica cluster, against the
single-process mmap server on the same model (the baseline, same run).

Setup trains DeepFM on synthetic click logs and exports one full version (the hot-row
budget is a fifth of its rows, so the cold rows are 4x the budget). Then, on loopback:

1. ``publish``: the version into the cluster (rows/s).
2. healthy: 2 hedged replicas, one request (1 context x 100 candidates) in flight per
   replica, bounded request counts; and the mmap server (one process, one request in
   flight). ``ratio_cluster_vs_local``: the 2 replicas' qps over the mmap server's;
   ``ratio_per_replica_vs_local``: the same per replica.
3. stalled: one master stalled 100 ms every second (``DEBUG SLEEP``), driving the 2
   hedged replicas and then 2 unhedged ones (``--no-hedge``) the same way.
4. killed: ``kill -9`` of a master while the hedged replicas are driven; failed requests
   and the seconds until its replica was promoted.

The row cache of each replica is kept small (a quarter of the hot budget) so that cold
reads keep happening. Prints one JSON line. Usage:
``python benchmarks/serve_cluster.py [--requests 400]``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import redis
import torch

from terarec.config import ModelConfig, TrainConfig
from terarec.data.synth import generate
from terarec.embedding.store import CHUNK_ROWS
from terarec.export.writer import ModelExporter
from terarec.loopback import free_port, wait_ready
from terarec.sparsetier.local import LocalCluster
from terarec.sparsetier.publish import Publisher
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema

SCHEMA = FeatureSchema.criteo()
CONTEXT_FIELDS = tuple(f"I{i}" for i in range(1, 14)) + tuple(f"C{i}" for i in range(1, 14))


def build_export(work: Path, rows: int) -> tuple[Path, Path, int]:
    """(export with one full version, held-out request data, rows in the version)."""
    train, held_out = work / "train.tsv", work / "requests.tsv"
    generate(train, rows, model_seed=0, sample_seed=1, vocab_scale=0.5)
    generate(held_out, 20_000, model_seed=0, sample_seed=2, vocab_scale=0.5)
    config = TrainConfig(batch_size=2048, pass_rows=rows, seed=0, threads=1,
                         model=ModelConfig(name="deepfm", embedding_dim=16))
    trainer = Trainer(SCHEMA, config)
    trainer.fit([train], progress=False)
    export = work / "export"
    ModelExporter(export).write_full(schema=SCHEMA, model_config=config.model,
                                     dense=trainer.model.state_dict(),
                                     rows=trainer.store.iter_sorted(CHUNK_ROWS),
                                     row_dim=trainer.store.row_dim, pass_id=trainer.pass_id)
    return export, held_out, len(trainer.store)


def make_bodies(path: Path, count: int, candidates: int = 100) -> list[bytes]:
    names = list(SCHEMA.column_names)
    table = pa_csv.read_csv(
        path, read_options=pa_csv.ReadOptions(column_names=names),
        parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False),
        convert_options=pa_csv.ConvertOptions(column_types={n: pa.string() for n in names},
                                              strings_can_be_null=True))
    rows = [{k: v for k, v in r.items() if k != "label" and v is not None}
            for r in table.slice(0, count * candidates).to_pylist()]
    bodies = []
    for i in range(count):
        group = rows[i * candidates:(i + 1) * candidates]
        context = {k: v for k, v in group[0].items() if k in CONTEXT_FIELDS}
        cands = [{k: v for k, v in r.items() if k not in CONTEXT_FIELDS} for r in group]
        bodies.append(json.dumps({"context": context, "candidates": cands}).encode())
    return bodies


def start_server(export: Path, *flags: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "terarec", "serve", str(export),
                             "--port", str(port), "--threads", "1", "--log-level", "warning",
                             "--poll-seconds", "2", *flags])
    wait_ready(port, proc=proc)
    return proc, port


def drive(ports: list[int], bodies: list[bytes], per_port: int, offset: int = 0
          ) -> tuple[list[float], int, float]:
    """One request in flight per port, ``per_port`` requests each; (latencies s, failed
    requests, wall seconds)."""
    latencies: list[float] = []
    failed = [0]
    lock = threading.Lock()

    def worker(k: int, port: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        mine, bad = [], 0
        for i in range(per_port):
            body = bodies[(offset + k * per_port + i) % len(bodies)]
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/predict", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                ok = response.status == 200
            except (OSError, http.client.HTTPException):
                ok = False
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            mine.append(time.perf_counter() - t0)
            bad += not ok
        with lock:
            latencies.extend(mine)
            failed[0] += bad

    threads = [threading.Thread(target=worker, args=(k, p)) for k, p in enumerate(ports)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, failed[0], time.perf_counter() - t0


def scrape(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    out: dict[str, float] = {}
    for line in conn.getresponse().read().decode().splitlines():
        if line.startswith("terarec_") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def ms(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1000, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--train-rows", type=int, default=120_000)
    parser.add_argument("--requests", type=int, default=400,
                        help="requests per replica in each phase (default 400)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="terarec-serve-cluster-"))
    procs: list[subprocess.Popen] = []
    cluster = LocalCluster(work / "cluster")
    try:
        export, held_out, rows = build_export(work, args.train_rows)
        bodies = make_bodies(held_out, 200)
        cluster.start()
        publisher = Publisher(cluster.url, "bench")
        published = publisher.publish(export)
        publisher.close()
        hot = rows // 5
        tier = ["--sparse-tier", cluster.url, "--namespace", "bench", "--hot-rows", str(hot),
                "--cache-rows", str(hot // 4)]
        replicas, unhedged = [], []
        for group, extra in ((replicas, ()), (unhedged, ("--no-hedge",))):
            for _ in range(2):
                proc, port = start_server(export, *tier, *extra)
                procs.append(proc)
                group.append(port)
        local_proc, local = start_server(export, "--cache-rows", str(hot // 4))
        procs.append(local_proc)

        for ports in (replicas, unhedged, [local]):  # warm-up
            drive(ports, bodies, 30)
        lat, failed_healthy, wall = drive(replicas, bodies, args.requests, 1000)
        qps = len(lat) / wall
        local_lat, _, local_wall = drive([local], bodies, args.requests, 1000)
        local_qps = len(local_lat) / local_wall
        m = [scrape(p) for p in replicas]
        lookups = sum(x.get("terarec_cache_lookups_total", 0) for x in m)
        local_hits = sum(x.get("terarec_cache_hits_total", 0)
                         + x.get("terarec_sparse_hot_hits_total", 0) for x in m)
        hot_hits = sum(x.get("terarec_sparse_hot_hits_total", 0) for x in m)
        cold_lookups = sum(x.get("terarec_sparse_lookups_total", 0) for x in m)
        local_proc.terminate()

        # one master stalled 100 ms every second
        stop = threading.Event()
        victim = cluster.master_ports()[0]

        def staller() -> None:
            client = redis.Redis(port=victim, socket_timeout=5)
            while not stop.wait(0.9):
                client.execute_command("DEBUG", "SLEEP", "0.1")

        stall_thread = threading.Thread(target=staller)
        stall_thread.start()
        stalled, _, _ = drive(replicas, bodies, args.requests, 3000)
        stalled_unhedged, _, _ = drive(unhedged, bodies, args.requests, 3000)
        stop.set()
        stall_thread.join()
        hedges = [scrape(p) for p in replicas]
        unhedged_failures = sum(scrape(p).get("terarec_sparse_read_failures_total", 0)
                                for p in unhedged)

        # kill -9 a master while the replicas are driven
        replica_of = {p: None for p in cluster.master_ports()}
        for port in cluster.live_ports():
            info = redis.Redis(port=port).info("replication")
            if info.get("role") == "slave" and int(info["master_port"]) == victim:
                replica_of[victim] = port
        result: dict = {}

        def killer() -> None:
            time.sleep(1.0)
            t0 = time.time()
            cluster.kill(victim)
            promoted = replica_of[victim]
            while promoted is not None and cluster.role(promoted) != "master":
                time.sleep(0.05)
            result["failover_seconds"] = round(time.time() - t0, 2)

        kill_thread = threading.Thread(target=killer)
        kill_thread.start()
        _, failed_killed, _ = drive(replicas, bodies, max(args.requests, 600), 5000)
        kill_thread.join()
        after = [scrape(p) for p in replicas]

        print(json.dumps({
            "benchmark": "serve_cluster",
            "cluster": "3 masters x 1 replica, loopback",
            "model_rows": rows,
            "hot_rows": hot,
            "cold_rows_over_hot_budget": round((rows - hot) / hot, 2),
            "publish_rows_per_s": round(published.rows_per_s),
            "publish_seconds": round(published.seconds, 2),
            "qps": round(qps, 1),
            "p50_ms": ms(lat, 50),
            "p99_ms": ms(lat, 99),
            "failed_requests_healthy": failed_healthy,
            "hot_hit_rate": round(hot_hits / cold_lookups, 4) if cold_lookups else 0.0,
            "local_hit_rate": round(local_hits / lookups, 4) if lookups else 0.0,
            "local_qps": round(local_qps, 1),
            "local_p50_ms": ms(local_lat, 50),
            "local_p99_ms": ms(local_lat, 99),
            "ratio_cluster_vs_local": round(qps / local_qps, 3),
            "ratio_per_replica_vs_local": round(qps / 2 / local_qps, 3),
            "p99_ms_stalled_hedged": ms(stalled, 99),
            "p99_ms_stalled_unhedged": ms(stalled_unhedged, 99),
            "hedges_sent": sum(x.get("terarec_sparse_hedges_sent_total", 0) for x in hedges),
            "hedges_won": sum(x.get("terarec_sparse_hedges_won_total", 0) for x in hedges),
            "rows_unread_stalled_unhedged": unhedged_failures,
            "failed_requests_master_killed": failed_killed,
            "failover_seconds": result.get("failover_seconds"),
            "failovers_seen": sum(x.get("terarec_sparse_failovers_total", 0) for x in after),
            "sparse_read_failures": sum(x.get("terarec_sparse_read_failures_total", 0)
                                        for x in after),
            "load_avg_start": round(load_start, 2),
            "load_avg": round(os.getloadavg()[0], 2),
            "cpus": os.cpu_count(),
        }))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        cluster.stop()


if __name__ == "__main__":
    main()
