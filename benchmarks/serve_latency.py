"""Serving latency: one `terarec serve` process under a closed-loop load of 1-context x
100-candidate requests on loopback, with two deltas swapped in mid-run.

Setup trains DeepFM on synthetic click logs for three passes and exports a full version
after the first and a delta after each of the others into a staging folder. The server
starts on the full version; the load runs in a separate process (``--concurrency``
keep-alive connections, each sending its next request as soon as the previous answer
arrives); a third and two thirds into the run the next delta is published (files first,
manifest, then ``LATEST``) and the server picks it up while answering.

Offline reference: the same requests scored in-process by the same engine (hashing,
lookups and the network, without HTTP), rows per second.

Prints one JSON line. Usage: ``python benchmarks/serve_latency.py [--seconds 30]``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import torch

from terarec.config import ModelConfig, TrainConfig
from terarec.data.synth import generate
from terarec.export import IncrementalExporter
from terarec.io import atomic_write_bytes
from terarec.serving.engine import ServingEngine
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema

SCHEMA = FeatureSchema.criteo()
# Fields a request shares across its candidates (the user and page side).
CONTEXT_FIELDS = tuple(f"I{i}" for i in range(1, 14)) + tuple(f"C{i}" for i in range(1, 14))


def build_export(work: Path, rows_per_pass: int) -> tuple[Path, list[Path], Path]:
    """Train three passes; return (serve folder with the full version, delta folders
    waiting to be published, a held-out data file for requests)."""
    train, held_out = work / "train.tsv", work / "requests.tsv"
    generate(train, 3 * rows_per_pass, model_seed=0, sample_seed=1, vocab_scale=0.1)
    generate(held_out, 20_000, model_seed=0, sample_seed=2, vocab_scale=0.1)
    config = TrainConfig(batch_size=2048, pass_rows=rows_per_pass, seed=0,
                         model=ModelConfig(name="deepfm", embedding_dim=16))
    trainer = Trainer(SCHEMA, config)
    staging = work / "staging"
    exporter = IncrementalExporter(staging, trainer, every_passes=1)
    trainer.fit([train], progress=False, on_pass_end=exporter.on_pass_end)
    served = work / "served"
    served.mkdir()
    publish(staging / "v000001", served)
    return served, [staging / "v000002", staging / "v000003"], held_out


def publish(version: Path, target: Path) -> None:
    """Copy a version into the served folder the way an exporter writes it."""
    files = sorted(p for p in version.rglob("*") if p.is_file() and p.name != "manifest.json")
    for path in files + [version / "manifest.json"]:
        atomic_write_bytes(target / version.name / path.relative_to(version),
                           path.read_bytes())
    atomic_write_bytes(target / "LATEST", version.name.encode())


def make_requests(path: Path, count: int, candidates: int) -> list[dict]:
    names = list(SCHEMA.column_names)
    table = pa_csv.read_csv(
        path, read_options=pa_csv.ReadOptions(column_names=names),
        parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False),
        convert_options=pa_csv.ConvertOptions(column_types={n: pa.string() for n in names},
                                              strings_can_be_null=True))
    rows = [{k: v for k, v in r.items() if k != "label" and v is not None}
            for r in table.slice(0, count * candidates).to_pylist()]
    requests = []
    for i in range(count):
        group = rows[i * candidates:(i + 1) * candidates]
        context = {k: v for k, v in group[0].items() if k in CONTEXT_FIELDS}
        cands = [{k: v for k, v in r.items() if k not in CONTEXT_FIELDS} for r in group]
        requests.append({"context": context, "candidates": cands})
    return requests


def client(port: int, bodies: list[bytes], concurrency: int, seconds: float,
           out: mp.Queue) -> None:
    """Closed loop: ``concurrency`` connections, each sending its next request as soon
    as the previous answer arrives. Puts (start, latency_s, status, version) tuples."""
    results: list[tuple[float, float, int, int]] = []
    lock = threading.Lock()
    stop_at = time.time() + seconds

    def worker(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        i, mine = k, []
        while time.time() < stop_at:
            body = bodies[i % len(bodies)]
            i += concurrency
            start = time.time()
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/predict", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                raw = response.read()
                status = response.status
                version = json.loads(raw)["version"] if status == 200 else -1
            except (OSError, http.client.HTTPException, ValueError):
                status, version = 0, -1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            mine.append((start, time.perf_counter() - t0, status, version))
        with lock:
            results.extend(mine)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(results)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/v2/health/ready")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready")


def scrape(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def offline_rows_per_s(export: Path, requests: list[dict], threads: int,
                       seconds: float = 5.0) -> float:
    """The same requests scored in-process: merge, hash, look up, run the network."""
    torch.set_num_threads(threads)
    engine = ServingEngine(export)
    engine.refresh()
    for r in requests[:5]:  # warm-up: compiled kernels, caches
        engine.score_records(r["candidates"], r["context"])
    rows, start, i = 0, time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        r = requests[i % len(requests)]
        engine.score_records(r["candidates"], r["context"])
        rows += len(r["candidates"])
        i += 1
    return rows / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="load duration")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests in flight (1: latency alone; more adds queueing)")
    parser.add_argument("--candidates", type=int, default=100)
    parser.add_argument("--requests", type=int, default=100, help="distinct request bodies")
    parser.add_argument("--rows-per-pass", type=int, default=20_000)
    parser.add_argument("--threads", type=int, default=1, help="server torch threads")
    parser.add_argument("--cache-rows", type=int, default=200_000)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="terarec-serve-bench-"))
    server = None
    try:
        served, deltas, held_out = build_export(work, args.rows_per_pass)
        requests = make_requests(held_out, args.requests, args.candidates)
        bodies = [json.dumps(r).encode() for r in requests]
        port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))
        server = subprocess.Popen(
            [sys.executable, "-m", "terarec", "serve", str(served), "--port", str(port),
             "--poll-seconds", "0.25", "--threads", str(args.threads), "--cache-rows",
             str(args.cache_rows), "--log-level", "warning"], env=env)
        wait_ready(port)
        for body in bodies[:20]:  # warm-up outside the measurement
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", "/predict", body, {"Content-Type": "application/json"})
            conn.getresponse().read()

        queue: mp.Queue = mp.get_context("spawn").Queue()
        load = mp.get_context("spawn").Process(
            target=client, args=(port, bodies, args.concurrency, args.seconds, queue))
        start = time.time()
        load.start()
        published = []
        for k, delta in enumerate(deltas, start=1):
            time.sleep(max(0.0, start + args.seconds * k / (len(deltas) + 1) - time.time()))
            publish(delta, served)
            published.append((time.time(), int(delta.name[1:])))
        results = queue.get(timeout=args.seconds + 120)
        load.join()
        metrics = scrape(port)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)

    starts = np.array([r[0] for r in results])
    latency = np.array([r[1] for r in results])
    ok = np.array([r[2] == 200 for r in results])
    versions = np.array([r[3] for r in results])
    elapsed = (starts.max() + latency[starts.argmax()]) - starts.min()
    # A swap window runs from publishing a version to its first answer, plus a second.
    during_swap = 0
    swap_lags = []
    for published_at, version in published:
        seen = starts[versions >= version]
        first = seen.min() if len(seen) else starts.max()
        swap_lags.append(float(first - published_at))
        window = (starts >= published_at - 0.5) & (starts <= first + 1.0)
        during_swap += int((~ok & window).sum())
    offline = offline_rows_per_s(served, requests, args.threads)
    shutil.rmtree(work, ignore_errors=True)
    qps = ok.sum() / elapsed
    print(json.dumps({
        "qps": round(float(qps), 1),
        "p50_ms": round(float(np.percentile(latency[ok], 50)) * 1e3, 2),
        "p99_ms": round(float(np.percentile(latency[ok], 99)) * 1e3, 2),
        "errors": int((~ok).sum()),
        "errors_during_swap": during_swap,
        "cache_hit_rate": round(metrics["terarec_cache_hit_rate"], 4),
        "offline_rows_per_s": round(offline, 1),
        "ratio_server_vs_offline": round(float(qps * args.candidates / offline), 3),
        "requests": int(len(results)),
        "versions_seen": sorted({int(v) for v in versions[ok]}),
        "swap_seen_after_s": [round(x, 3) for x in swap_lags],
        "final_version": int(metrics["terarec_model_version"]),
        "concurrency": args.concurrency,
        "candidates": args.candidates,
        "seconds": args.seconds,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }))


if __name__ == "__main__":
    main()
