"""Serving latency and throughput: `terarec serve --workers N` under a closed-loop load of
1-context x 100-candidate requests on loopback, with deltas swapped in while it answers.

Setup trains DeepFM on synthetic click logs for three passes and exports a full version
after the first and a delta after each of the others into a staging folder. The server
starts on the full version; load comes from separate client processes (keep-alive
connections, each sending its next request as soon as the previous answer arrives) in
two phases of ``--seconds`` each:

* latency: one request in flight (``p50_ms``, ``p99_ms``);
* saturation: ``--saturation-concurrency`` requests in flight, enough to keep every
  worker busy (``rows_per_s_saturated``, with its own p50 / p99).

Half-way through each phase the next delta is published (files first, manifest, then
``LATEST``) and the workers swap to it while answering; errors are counted in both.

Baselines measured in the same run, on this machine, with the server's torch threads:
``forward_bound_rows_per_s``, the served network's forward pass alone on pre-pooled rows
at the request's batch size (what one core could score if requests cost nothing else),
and ``offline_rows_per_s``, the whole request path in-process without HTTP.
``max_score_diff`` compares the server's answers with the record path
(``batch_from_records``, what `terarec predict` reads) on the final version.

On a machine other jobs load, wall-clock figures measure the machine; the CPU time the
server's processes spent (from /proc) does not depend on them nearly as much, so the
line also holds ``server_cpu_ms_per_request`` (per phase), the saturated rows per server
CPU second and their ratio to the forward pass's rows per CPU second, and the same per row
(``server_cpu_us_per_row*`` against ``forward_cpu_us_per_row``); ``load_avg`` says how
busy the machine was.

``--protocol binary`` sends the same requests as KServe v2 binary tensors (one ``BYTES``
tensor per field), the format for high-rate clients, instead of /predict JSON.

Prints one JSON line. Usage: ``python benchmarks/serve_latency.py [--seconds 20]
[--protocol json|binary]``.
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
import orjson
import pyarrow as pa
import pyarrow.csv as pa_csv
import torch

from terarec.config import ModelConfig, TrainConfig
from terarec.data.readers import batch_from_records
from terarec.data.synth import generate
from terarec.export import IncrementalExporter
from terarec.io import atomic_write_bytes
from terarec.loopback import free_port, wait_ready
from terarec.serving import binary
from terarec.serving.binary import encode_bytes
from terarec.serving.engine import ServingEngine
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema

SCHEMA = FeatureSchema.criteo()
V2_INFER = "/v2/models/terarec/infer"
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


class _Connection:
    """A keep-alive HTTP/1.1 connection on a raw socket: the request bytes are built
    once, and an answer is read by its Content-Length. Far less client CPU per request
    than http.client, which matters when the client shares the server's cores."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: socket.socket | None = None
        self.buf = b""

    def post(self, request: bytes) -> tuple[int, bytes]:
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.buf = b""
        self.sock.sendall(request)
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            self._read()
        head = self.buf[:end].lower()
        at = head.index(b"content-length:") + 15
        stop = head.find(b"\r\n", at)
        size = int(head[at:stop if stop >= 0 else len(head)])
        while len(self.buf) < end + 4 + size:
            self._read()
        body = self.buf[end + 4:end + 4 + size]
        self.buf = self.buf[end + 4 + size:]
        return int(head[9:12]), body

    def _read(self) -> None:
        assert self.sock is not None
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None


def http_post(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            f"\r\n{extra}Content-Length: {len(body)}\r\n\r\n").encode() + body


def binary_body(request: dict) -> tuple[bytes, int]:
    """A request as KServe v2 binary tensors: one ``BYTES`` tensor of N values per field
    (the context's value repeated, an empty element where a candidate lacks the field),
    as a client would send it; returns (body, JSON header length)."""
    context, candidates = request["context"], request["candidates"]
    names = list(context) + sorted({k for c in candidates for k in c} - set(context))
    n = len(candidates)
    inputs, data = [], []
    for name in names:
        if name in context:
            values = [str(context[name])] * n
        else:
            values = ["" if c.get(name) is None else str(c[name]) for c in candidates]
        raw = encode_bytes(values)
        inputs.append({"name": name, "shape": [n], "datatype": "BYTES",
                       "parameters": {"binary_data_size": len(raw)}})
        data.append(raw)
    header = json.dumps({"inputs": inputs}).encode()
    return header + b"".join(data), len(header)


def encode_request(request: dict, protocol: str) -> bytes:
    """The whole HTTP request for ``protocol``: /predict JSON or v2 binary tensors."""
    if protocol == "binary":
        body, size = binary_body(request)
        return http_post(V2_INFER, body, {binary.HEADER: str(size)})
    return http_post("/predict", json.dumps(request).encode())


def answer_version(raw: bytes) -> int:
    """The version an answer was scored on (/predict's ``version``, v2's
    ``model_version``)."""
    body = orjson.loads(raw)
    return int(body["version"]) if "version" in body else int(body["model_version"])


def answer_scores(raw: bytes) -> np.ndarray:
    body = orjson.loads(raw)
    return np.asarray(body["scores"] if "scores" in body else body["outputs"][0]["data"])


def client(port: int, requests: list[bytes], concurrency: int, seconds: float, first: int,
           out: mp.Queue) -> None:
    """Closed loop: ``concurrency`` connections, each sending its next request (whole
    HTTP requests, ``encode_request``) as soon as the previous answer arrives. Puts
    ((start, latency_s, status, version) tuples, this process's CPU seconds)."""
    results: list[tuple[float, float, int, int]] = []
    lock = threading.Lock()
    cpu = time.process_time()
    stop_at = time.time() + seconds

    def worker(k: int) -> None:
        conn = _Connection(port)
        i, mine = first + k, []
        while time.time() < stop_at:
            request = requests[i % len(requests)]
            i += concurrency
            start = time.time()
            t0 = time.perf_counter()
            try:
                status, raw = conn.post(request)
                version = answer_version(raw) if status == 200 else -1
            except (OSError, ValueError, KeyError):
                status, version = 0, -1
                conn.close()
            mine.append((start, time.perf_counter() - t0, status, version))
        conn.close()
        with lock:
            results.extend(mine)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((results, time.process_time() - cpu))


def run_phase(port: int, bodies: list[bytes], concurrency: int, seconds: float,
              processes: int, deltas: list[Path], served: Path, server_pid: int) -> dict:
    """One closed-loop phase from ``processes`` client processes; ``deltas`` are
    published evenly inside it. Returns its figures, including the server's CPU time."""
    cpu_before = cpu_seconds(server_pid)
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    per = [concurrency // processes + (1 if k < concurrency % processes else 0)
           for k in range(processes)]
    loads = [ctx.Process(target=client, args=(port, bodies, c, seconds, 7919 * k, queue))
             for k, c in enumerate(per) if c]
    start = time.time()
    for load in loads:
        load.start()
    published = []
    for k, delta in enumerate(deltas, start=1):
        time.sleep(max(0.0, start + seconds * k / (len(deltas) + 1) - time.time()))
        publish(delta, served)
        published.append((time.time(), int(delta.name[1:])))
    replies = [queue.get(timeout=seconds + 120) for _ in loads]
    results = [r for rows, _ in replies for r in rows]
    client_cpu = sum(c for _, c in replies)
    for load in loads:
        load.join()
    server_cpu = cpu_seconds(server_pid) - cpu_before
    starts = np.array([r[0] for r in results])
    latency = np.array([r[1] for r in results])
    ok = np.array([r[2] == 200 for r in results])
    versions = np.array([r[3] for r in results])
    elapsed = float((starts + latency).max() - starts.min())
    # A swap window runs from publishing a version to its first answer, plus a second.
    during_swap, swap_lags = 0, []
    for published_at, version in published:
        seen = starts[versions >= version]
        first = seen.min() if len(seen) else starts.max()
        swap_lags.append(round(float(first - published_at), 3))
        window = (starts >= published_at - 0.5) & (starts <= first + 1.0)
        during_swap += int((~ok & window).sum())
    good = latency[ok] if ok.any() else np.array([float("nan")])
    return {"requests": int(len(results)), "ok": int(ok.sum()), "elapsed": elapsed,
            "p50_ms": round(float(np.percentile(good, 50)) * 1e3, 2),
            "p99_ms": round(float(np.percentile(good, 99)) * 1e3, 2),
            "errors": int((~ok).sum()), "errors_during_swap": during_swap,
            "versions": sorted({int(v) for v in versions[ok]}), "swap_lags": swap_lags,
            "server_cpu_s": server_cpu, "client_cpu_s": client_cpu}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its live descendants (Linux
    /proc): what the server spent, whatever else loads the machine."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    family, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in family} - family
        family |= more
        grew = bool(more)
    return sum(times.get(p, 0.0) for p in family)




def scrape(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def offline_rows_per_s(engine: ServingEngine, requests: list[dict],
                       seconds: float = 3.0) -> float:
    """The same requests scored in-process: merge, hash, look up, run the network."""
    for r in requests[:5]:  # warm-up: compiled kernels, caches
        engine.score_records(r["candidates"], r["context"])
    rows, start, i = 0, time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        r = requests[i % len(requests)]
        engine.score_records(r["candidates"], r["context"])
        rows += len(r["candidates"])
        i += 1
    return rows / (time.perf_counter() - start)


def forward_bound_rows_per_s(engine: ServingEngine, request: dict,
                             seconds: float = 3.0) -> tuple[float, float]:
    """The served network's forward pass alone (what the server runs: ONNX Runtime or
    PyTorch) on one request's pre-pooled rows: rows per second of wall time and per CPU
    second of this process."""
    version = engine.served()
    batch = version.batch(request["context"], request["candidates"])
    emb = engine.pooled(batch, version)
    forward = version.logits
    for _ in range(20):
        forward(batch.dense, emb)
    calls, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        forward(batch.dense, emb)
        calls += 1
    rows = calls * len(batch)
    return (rows / (time.perf_counter() - start),
            rows / max(time.process_time() - cpu, 1e-9))


def max_score_diff(port: int, engine: ServingEngine, requests: list[dict],
                   protocol: str) -> float:
    """Largest |server - record path| score over a few requests, on the final version:
    the server's conversion (in ``protocol``), lookups and network runtime against the
    record path (``batch_from_records``) and PyTorch's forward pass."""
    engine.refresh()
    version = engine.served()
    worst = 0.0
    conn = _Connection(port)
    for r in requests[:10]:
        status, raw = conn.post(encode_request(r, protocol))
        if status != 200:
            raise RuntimeError(f"the server answered {status}: {raw[:500]!r}")
        if answer_version(raw) != version.version:
            raise RuntimeError(f"server on version {answer_version(raw)}, expected "
                               f"{version.version}")
        merged = [{**r["context"], **c} for c in r["candidates"]]
        batch = batch_from_records(merged, version.schema)
        with torch.no_grad():  # PyTorch's network, as `terarec predict` runs it
            expected = torch.sigmoid(version.model(batch.dense, engine.pooled(batch, version)))
        expected = expected.numpy()
        worst = max(worst, float(np.abs(answer_scores(raw) - expected).max()))
    conn.close()
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="duration of each phase")
    parser.add_argument("--workers", type=int, default=2, help="server worker processes")
    parser.add_argument("--saturation-concurrency", type=int, default=16,
                        help="requests in flight in the saturation phase")
    parser.add_argument("--client-processes", type=int, default=2,
                        help="client processes driving the saturation phase")
    parser.add_argument("--candidates", type=int, default=100)
    parser.add_argument("--protocol", choices=["json", "binary"], default="json",
                        help="/predict JSON bodies, or KServe v2 binary tensors (one BYTES "
                        "tensor per field) on /v2/models/terarec/infer")
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
        bodies = [encode_request(r, args.protocol) for r in requests]
        port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))
        server = subprocess.Popen(
            [sys.executable, "-m", "terarec", "serve", str(served), "--port", str(port),
             "--workers", str(args.workers), "--poll-seconds", "0.25", "--threads",
             str(args.threads), "--cache-rows", str(args.cache_rows), "--log-level",
             "warning"], env=env)
        wait_ready(port)
        warm = mp.get_context("spawn").Queue()
        client(port, bodies, 2 * args.workers, 2.0, 0, warm)  # warm-up, every worker
        warm.get()

        latency = run_phase(port, bodies, 1, args.seconds, 1, deltas[:1], served,
                            server.pid)
        saturated = run_phase(port, bodies, args.saturation_concurrency, args.seconds,
                              args.client_processes, deltas[1:], served, server.pid)
        metrics = scrape(port)

        torch.set_num_threads(args.threads)
        engine = ServingEngine(served)
        engine.refresh()
        diff = max_score_diff(port, engine, requests, args.protocol)
        forward, forward_cpu = forward_bound_rows_per_s(engine, requests[0])
        offline = offline_rows_per_s(engine, requests)
        engine.close()
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    shutil.rmtree(work, ignore_errors=True)
    rows_saturated = saturated["ok"] * args.candidates / saturated["elapsed"]
    rows_per_cpu = saturated["ok"] * args.candidates / max(saturated["server_cpu_s"], 1e-9)
    print(json.dumps({
        "p50_ms": latency["p50_ms"],
        "p99_ms": latency["p99_ms"],
        "qps": round(latency["ok"] / latency["elapsed"], 1),
        "rows_per_s_saturated": round(rows_saturated, 1),
        "p50_ms_saturated": saturated["p50_ms"],
        "p99_ms_saturated": saturated["p99_ms"],
        "forward_bound_rows_per_s": round(forward, 1),
        "ratio_saturated_vs_forward_bound": round(rows_saturated / forward, 3),
        "offline_rows_per_s": round(offline, 1),
        # CPU-time figures: what the server spends per request, which the other jobs on
        # a shared machine disturb far less than wall-clock latency.
        "server_cpu_ms_per_request": round(latency["server_cpu_s"] / latency["ok"] * 1e3, 3),
        "server_cpu_ms_per_request_saturated": round(
            saturated["server_cpu_s"] / saturated["ok"] * 1e3, 3),
        "rows_per_server_cpu_s_saturated": round(rows_per_cpu, 1),
        # The client shares the cores: its CPU per request, so that what it takes from
        # the server is visible.
        "client_cpu_ms_per_request_saturated": round(
            saturated["client_cpu_s"] / max(saturated["requests"], 1) * 1e3, 3),
        "forward_bound_rows_per_cpu_s": round(forward_cpu, 1),
        "ratio_cpu_saturated_vs_forward_bound": round(rows_per_cpu / forward_cpu, 3),
        # The same per row: server CPU per scored row against the forward pass's alone,
        # and their quotient (1.0 would be a server that costs nothing but the network).
        "server_cpu_us_per_row": round(
            latency["server_cpu_s"] / max(latency["ok"] * args.candidates, 1) * 1e6, 2),
        "server_cpu_us_per_row_saturated": round(1e6 / rows_per_cpu, 2),
        "forward_cpu_us_per_row": round(1e6 / forward_cpu, 2),
        "cpu_per_row_vs_forward_saturated": round(forward_cpu / rows_per_cpu, 2),
        "errors": latency["errors"] + saturated["errors"],
        "errors_during_swap": latency["errors_during_swap"] + saturated["errors_during_swap"],
        "max_score_diff": diff,
        "cache_hit_rate": round(metrics.get("terarec_cache_hit_rate", float("nan")), 4),
        "versions_seen": sorted(set(latency["versions"]) | set(saturated["versions"])),
        "swap_seen_after_s": latency["swap_lags"] + saturated["swap_lags"],
        "requests": latency["requests"] + saturated["requests"],
        "workers": args.workers,
        "saturation_concurrency": args.saturation_concurrency,
        "candidates": args.candidates,
        "protocol": args.protocol,
        "request_bytes": round(float(np.mean([len(b) for b in bodies]))),
        "seconds": args.seconds,
        "threads": args.threads,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
    }))


if __name__ == "__main__":
    main()
