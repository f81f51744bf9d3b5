"""Continuous training end to end: hourly files with a drifting ground truth land in a
folder on a timer, ``terarec train --follow`` trains them as real processes, ``terarec
serve`` serves the deltas it publishes, and the trainer is killed with SIGKILL twice at
random moments and restarted with the same command.

Measured, in one JSON line:

* ``rows_landed`` / ``rows_trained``: every landed row trained exactly once (equal);
* ``freshness_p50_s`` / ``freshness_p99_s``: from a file's landing (its rename into the
  folder) to the moment the server answers with a version that includes it (target: p99
  at most the delta interval + 30 s);
* ``auc_progressive_continuous``: the mean of the per-file progressive AUC (each file
  scored by the live model before it trained on it) over files 2..N, against
  ``auc_progressive_frozen``, the baseline measured in the same run: a model trained on
  the first file only (the same command line, ``--train``), scored on the same files
  (target gain >= 0.01 on drifting data);
* ``serve_errors``: failed requests once the server was ready (target 0).

Usage: ``python benchmarks/continuous.py [--files 8 --rows 5000 --interval 5]``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from terarec.data.synth import generate_hourly
from terarec.loopback import free_port

ROOT = Path(__file__).resolve().parents[1]
TRAIN_ARGS = ["--threads", "1", "--no-progress", "--embedding-dim", "8", "--seed", "1",
              "--batch-size", "256", "--pass-rows", "1000000", "--epochs", "1",
              "--admit-min-count", "1"]


def _env() -> dict[str, str]:
    src = str(ROOT / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH")) if p), "OMP_NUM_THREADS": "1"}


def _terarec(*args: str) -> list[str]:
    return [sys.executable, "-m", "terarec", *args]


class Prober(threading.Thread):
    """Asks the server for its version every ``every_s`` and scores one request: when
    each version was first served, and how many requests failed once it was ready."""

    def __init__(self, port: int, request: dict, every_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.port, self.body, self.every_s = port, json.dumps(request), every_s
        self.first_seen: dict[int, float] = {}
        self.errors = 0
        self.requests = 0
        self.ready = False
        self.stop = threading.Event()

    def _get(self, conn: http.client.HTTPConnection, method: str, path: str,
             body: str | None = None) -> tuple[int, dict]:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        while not self.stop.is_set():
            try:
                status, meta = self._get(conn, "GET", "/v2/models/terarec")
                if status == 200:
                    self.ready = True
                    self.first_seen.setdefault(int(meta["versions"][0]), time.time())
                    status, out = self._get(conn, "POST", "/predict", self.body)
                    self.requests += 1
                    if status != 200 or not all(0 < s < 1 for s in out["scores"]):
                        self.errors += 1
                elif self.ready:
                    self.errors += 1
            except (OSError, http.client.HTTPException, ValueError):
                if self.ready:
                    self.errors += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            self.stop.wait(self.every_s)


def _request(path: Path) -> dict:
    """A /predict body: the first row of a data file as one candidate."""
    first = path.read_text().split("\n", 1)[0].split("\t")
    features = {f"I{i}": (float(first[i]) if first[i] else None) for i in range(1, 14)}
    features.update({f"C{i}": first[13 + i] or None for i in range(1, 27)})
    return {"context": {}, "candidates": [features]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--rows", type=int, default=5000, help="rows per hourly file")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between landings")
    ap.add_argument("--drift", type=float, default=0.02,
                    help="1 - correlation of consecutive hours' planted logits")
    ap.add_argument("--delta-minutes", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0, help="kill moments")
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        print(json.dumps(run(work, args, rng)))


def run(work: Path, args: argparse.Namespace, rng: random.Random) -> dict:
    staging, logs, model, exports = (work / n for n in ("staging", "logs", "model", "exports"))
    logs.mkdir()
    infos = generate_hourly(staging, args.files, args.rows, drift=args.drift, model_seed=3,
                            vocab_scale=0.02)
    files = [Path(i.path) for i in infos]
    follow = _terarec("train", "--follow", str(logs), "--out", str(model), "--resume",
                      "--export-to", str(exports), "--delta-minutes", str(args.delta_minutes),
                      "--stop-after", str(args.files), "--poll-seconds", "0.5", *TRAIN_ARGS)
    port = free_port()
    server = subprocess.Popen(_terarec("serve", str(exports), "--port", str(port),
                                       "--poll-seconds", "0.5", "--threads", "1",
                                       "--log-level", "warning"),
                              env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prober = Prober(port, _request(files[0]))
    landed: dict[str, float] = {}
    trainer = subprocess.Popen(follow, env=_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    # two kills at random moments while files land
    kill_at = sorted(rng.uniform(1.5, args.files - 0.5) * args.interval for _ in range(2))
    kills = 0
    try:
        prober.start()
        start = time.monotonic()
        next_file = 0
        while trainer.poll() is None or next_file < len(files) or kills < len(kill_at):
            now = time.monotonic() - start
            if next_file < len(files) and now >= next_file * args.interval:
                src = files[next_file]
                (logs / f".{src.name}.tmp").write_bytes(src.read_bytes())
                (logs / f".{src.name}.tmp").rename(logs / src.name)  # lands atomically
                landed[src.name] = time.time()
                next_file += 1
            if kills < len(kill_at) and now >= kill_at[kills]:
                trainer.send_signal(signal.SIGKILL)
                trainer.wait()
                kills += 1
                trainer = subprocess.Popen(follow, env=_env(), stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL)
            if trainer.poll() is not None and trainer.returncode != 0:
                raise RuntimeError(f"train --follow exited with {trainer.returncode}")
            if now > args.files * args.interval + 600:
                raise RuntimeError("train --follow did not finish")
            time.sleep(0.05)
        time.sleep(2.0 + 2 * 0.5)  # the server picks up the last version
    finally:
        prober.stop.set()
        if trainer.poll() is None:
            trainer.kill()
        server.terminate()
        server.wait(timeout=30)
    history = json.loads((model / "history.json").read_text())
    freshness = _freshness(history, landed, prober.first_seen, exports)
    continuous = [h["file_auc"] for h in history
                  if h.get("file_done") and h["file_done"] != files[0].name]
    frozen = _frozen_aucs(work, files)
    return {
        "files": len(files), "rows_landed": len(files) * args.rows,
        "rows_trained": sum(h["rows"] for h in history), "kills": kills,
        "freshness_p50_s": float(np.percentile(freshness, 50)),
        "freshness_p99_s": float(np.percentile(freshness, 99)),
        "freshness_target_s": args.delta_minutes * 60 + 30,
        "auc_progressive_continuous": float(np.mean(continuous)),
        "auc_progressive_frozen": float(np.mean(frozen)),
        "auc_gain": float(np.mean(continuous) - np.mean(frozen)),
        "serve_errors": prober.errors, "serve_requests": prober.requests,
        "drift": args.drift, "interval_s": args.interval,
        "delta_minutes": args.delta_minutes,
        "machine": "shared 2-core machine, loaded by other jobs",
    }


def _freshness(history: list[dict], landed: dict[str, float], first_seen: dict[int, float],
               exports: Path) -> list[float]:
    """Per file: landing -> the first served version whose pass includes it."""
    finished = {h["file_done"]: h["pass_id"] + 1 for h in history if h.get("file_done")}
    passes = {v: json.loads((exports / f"v{v:06d}" / "manifest.json").read_text())["pass_id"]
              for v in first_seen}
    out = []
    for name, at in landed.items():
        served = [t for v, t in first_seen.items() if passes[v] >= finished[name]]
        if not served:
            raise RuntimeError(f"{name}: no served version includes it")
        out.append(min(served) - at)
    return out


def _frozen_aucs(work: Path, files: list[Path]) -> list[float]:
    """The baseline: the same command line trained on the first file only, scored on each
    later file."""
    from terarec.cli.main import main as terarec_main
    from terarec.train.passes import iter_file_batches
    from terarec.train.trainer import Trainer

    out = work / "frozen"
    with contextlib.redirect_stdout(io.StringIO()):  # one JSON line is this script's output
        code = terarec_main(["train", "--train", str(files[0]), "--out", str(out),
                             *TRAIN_ARGS])
    if code != 0:
        raise RuntimeError("training the frozen baseline failed")
    trainer = Trainer.from_checkpoint(out)
    return [trainer.evaluate(iter_file_batches([f], trainer.schema, 4096))["auc"]
            for f in files[1:]]


if __name__ == "__main__":
    main()
