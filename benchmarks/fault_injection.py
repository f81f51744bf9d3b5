"""Fault injection: kill -9 and corrupt ``terarec train``, ``export`` and ``serve`` and
count what got through. Everything runs on this machine; the server binds loopback.

Rounds (each fault counted in ``faults``):

train   an uninterrupted run is the baseline (``baseline_train_s``, its model the
        reference); then per store (memory, tiered) a run with ``--export-to`` is killed
        with -9 at random moments ``--train-kills`` times and resumed until done, a
        second run on the same ``--out`` is started while one runs (must fail at once),
        the newest checkpoint is corrupted before the last resume. ``resumed_identical``
        counts rounds ending bit-identical (1e-6) to the reference; ``rows_lost`` the
        rows the final history lacks.
search  an uninterrupted grid search (6 trials, 2 at a time) is the baseline; then per
        store the same search killed with -9 at random moments ``--search-kills`` times
        (after the process start-up), the newest
        checkpoint of a trial it left running corrupted, and resumed until done.
        ``search_identical`` counts rounds whose every grid point ends with the baseline's
        value (1e-9), ``search_continued`` the resumes that continued trials from a pass.
export  ``terarec export`` killed with -9 at random moments, then two exports to one URI
        at once (their versions must differ).
serve   a ``terarec serve`` (cache off, so lookups read the shards) under a steady
        client while: the served shards are truncated in place, a delta with a flipped
        byte, a delta whose files arrive after its manifest, a delta whose manifest
        points outside its version, a delta whose files arrive after
        ``--incomplete-seconds`` (served once they do, with the deltas after it), the
        server's own shard copies truncated under a request with unseen keys, full
        versions of NaN rows or unsorted keys and a delta whose shard is a symbolic
        link (never served), hostile bodies (5000-digit integer, bytes, NaN), the
        export deleted and re-exported, and kill -9 plus restart.
follow  ``train --follow`` with a file written in place that grows after it was read:
        every row trained or the run stopped naming the file (else ``rows_lost``).

``poisoned_artifacts``: committed checkpoints or versions whose files fail their
checksums, plus answers scored by a version that should have been refused or that differ
from the pre-fault scores. ``server_5xx`` counts 5xx answers, ``server_crashes`` server
deaths not caused by the benchmark.

Prints one JSON line. Usage: ``python benchmarks/fault_injection.py [--seed 0]``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from terarec.data.synth import generate
from terarec.export import (
    ModelExporter,
    Storage,
    latest_version,
    list_versions,
    read_manifest,
)
from terarec.export.format import LATEST, MANIFEST, sha256_bytes, shard_name
from terarec.io import atomic_write_text, sha256_file
from terarec.loopback import free_port
from terarec.modeldir import CheckpointError, list_checkpoints, load_checkpoint, verify_checkpoint

SRC = Path(__file__).resolve().parents[1] / "src"
TRAIN_ARGS = ["--pass-rows", "1500", "--batch-size", "500", "--threads", "1",
              "--no-progress", "--model", "deepfm", "--embedding-dim", "4", "--seed", "5"]
STORES = {"memory": [], "tiered": ["--memory-budget", "5MB"]}


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC),
                                                        os.environ.get("PYTHONPATH", "")]))


def _terarec(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "terarec", *args], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def _run(*args: str, timeout: float = 300) -> tuple[int, str]:
    proc = _terarec(*args)
    out = proc.communicate(timeout=timeout)[0].decode(errors="replace")
    return proc.returncode, out


def _kill_after(proc: subprocess.Popen, seconds: float) -> bool:
    """SIGKILL ``proc`` after ``seconds`` unless it ended first; True if killed."""
    try:
        proc.wait(timeout=seconds)
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True


def _flip(path: Path, offset_from_end: int = 9) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def _same_model(a: Path, b: Path) -> bool:
    ca, cb = load_checkpoint(a), load_checkpoint(b)
    if ca.meta["pass_id"] != cb.meta["pass_id"]:
        return False
    if any(not torch.allclose(t, cb.dense[n], rtol=0, atol=1e-6) for n, t in ca.dense.items()):
        return False
    sa, sb = ca.sparse, cb.sparse
    return bool(np.array_equal(sa["keys"], sb["keys"]) and all(
        np.allclose(sa[n], sb[n], rtol=0, atol=1e-6) for n in ("values", "state")))


def _history_rows(model: Path) -> int:
    return sum(int(h["rows"]) for h in load_checkpoint(model).meta["history"])


def bad_checkpoints(model: Path) -> int:
    """Committed checkpoints (with meta.json) whose files do not verify."""
    bad = 0
    for ckpt in list_checkpoints(model):
        if (ckpt / "meta.json").exists():
            try:
                verify_checkpoint(ckpt)
            except (CheckpointError, KeyError, OSError):
                bad += 1
    return bad


def bad_versions(export: Path, skip: set[str] = frozenset()) -> int:
    """Versions with a manifest whose listed files are missing or fail their checksums
    (``skip``: the ones this benchmark damaged on purpose)."""
    storage, bad = Storage(export), 0
    for name in list_versions(storage):
        if name in skip or not (export / name / MANIFEST).exists():
            continue
        manifest = read_manifest(storage, name)
        for rel, info in manifest.files.items():
            path = export / name / rel
            if not path.exists() or sha256_file(path) != info["sha256"]:
                bad += 1
                break
    return bad


# -- train -------------------------------------------------------------------------------
def train_rounds(work: Path, data: Path, rng: random.Random, kills: int,
                 reference: Path, baseline_s: float, totals: dict) -> None:
    for store, extra in STORES.items():
        out, export = work / f"model-{store}", work / f"export-{store}"
        cmd = ["train", "--train", str(data), "--out", str(out), *TRAIN_ARGS, *extra,
               "--export-to", str(export)]
        for i in range(kills):
            proc = _terarec(*cmd, *(["--resume"] if i else []))
            if i == 0:  # a second run on the same --out while this one holds it
                time.sleep(min(4.0, baseline_s / 3))
                code, text = _run(*cmd, "--resume", timeout=60)
                totals["faults"] += 1
                if code != 2 or "in use by another process" not in text:
                    totals["unguarded_writers"] += 1
            totals["faults"] += _kill_after(proc, rng.uniform(0.15, 0.45) * baseline_s)
        if list_checkpoints(out):  # the newest committed checkpoint goes bad
            newest = list_checkpoints(out)[0]
            _flip(newest / "dense.safetensors")
            totals["faults"] += 1
        code, text = _run(*cmd, "--resume")
        if code != 0:
            raise RuntimeError(f"final resume failed: {text[-2000:]}")
        totals["train_rounds"] += 1
        totals["resumed_identical"] += _same_model(reference, out)
        totals["rows_lost"] += abs(_history_rows(reference) - _history_rows(out))
        # The checkpoint damaged on purpose was refused and rewritten, not kept.
        totals["poisoned_artifacts"] += bad_checkpoints(out) + bad_versions(export)


# -- search ------------------------------------------------------------------------------
SEARCH_ARGS = ["--model", "fm", "--trials", "6", "--parallel", "2", "--sampler", "grid",
               "--pruner", "none", "--epochs", "4", "--patience", "10", "--batch-size",
               "250", "--pass-rows", "500", "--threads", "1", "--seed", "1",
               "--no-progress", "--admit-min-count", "1", "--no-refit"]


def _grid_values(out: Path) -> dict[tuple, float]:
    rows = json.loads((out / "results.json").read_text())["trials"]
    return {tuple(sorted((k, v) for k, v in r.items() if k.startswith("params."))):
            r["value"] for r in rows}


def search_rounds(work: Path, data: Path, rng: random.Random, kills: int,
                  totals: dict) -> None:
    valid = work / "search-valid.tsv"
    generate(valid, 1500, model_seed=3, sample_seed=9, vocab_scale=0.05)
    space = work / "space.json"
    space.write_text(json.dumps({"model.embedding_dim": [2, 4, 8],
                                 "sparse_optimizer.lr": [0.05, 0.1]}))
    cmd = ["search", "--train", str(data), "--valid", str(valid), "--space", str(space),
           *SEARCH_ARGS]
    t0 = time.perf_counter()
    code, text = _run(*cmd, "--out", str(work / "search-reference"))
    if code != 0:
        raise RuntimeError(f"reference search failed: {text[-2000:]}")
    baseline_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _run("search", "--help")  # what a process pays before it trains: the kills come later
    start_s = time.perf_counter() - t0
    for store, extra in STORES.items():
        out = work / f"search-{store}"
        _search_round([*cmd, *extra], out, rng, kills, start_s, baseline_s, totals)
        want, got = _grid_values(work / "search-reference"), _grid_values(out)
        totals["search_rounds"] += 1
        totals["search_identical"] += want.keys() == got.keys() and all(
            abs(want[k] - got[k]) <= 1e-9 for k in want)
        totals["poisoned_artifacts"] += bad_checkpoints(out / "best")


def _search_round(cmd: list[str], out: Path, rng: random.Random, kills: int,
                  start_s: float, baseline_s: float, totals: dict) -> None:
    """Kill the search ``kills`` times, corrupt a running trial's newest checkpoint,
    resume until done."""
    for i in range(kills):
        proc = _terarec(*cmd, "--out", str(out), *(["--resume"] if i else []))
        after = start_s + rng.uniform(0.1, 0.45) * max(baseline_s - start_s, 0.5)
        totals["faults"] += _kill_after(proc, after)
        assert proc.stdout is not None
        totals["search_continued"] += b"continuing trial(s)" in proc.stdout.read()
        if (out / "results.json").exists():
            break
    # trials left running: a pointer and checkpoints (a finished search removes both)
    running = [d for d in (out / "trials").glob("trial-*")
               if (d / "LATEST").exists() and list_checkpoints(d)] \
        if (out / "trials").exists() else []
    if running and not (out / "results.json").exists():
        newest = list_checkpoints(max(running))[0]  # refused, the pass before taken
        _flip(newest / "dense.safetensors")
        totals["faults"] += 1
    for _ in range(3):  # resumed until done (a resume is not killed)
        if (out / "results.json").exists():
            break
        code, text = _run(*cmd, "--out", str(out), "--resume")
        if code != 0:
            raise RuntimeError(f"search resume failed: {text[-2000:]}")
        totals["search_continued"] += "continuing trial(s)" in text


# -- export ------------------------------------------------------------------------------
def export_rounds(work: Path, model: Path, rng: random.Random, kills: int,
                  totals: dict) -> None:
    export = work / "export-cli"
    cmd = ["export", "--model", str(model), "--out", str(export), "--shard-rows", "2000"]
    for _ in range(kills):
        totals["faults"] += _kill_after(_terarec(*cmd), rng.uniform(1.0, 3.5))
    pair = [_terarec(*cmd), _terarec(*cmd)]
    outputs = [p.communicate(timeout=300)[0].decode() for p in pair]
    totals["faults"] += 1
    names = [json.loads(o.strip().splitlines()[-1])["name"] for o, p in zip(outputs, pair,
                                                                           strict=True)
             if p.returncode == 0]
    totals["versions_lost"] += 2 - len(set(names))
    totals["poisoned_artifacts"] += bad_versions(export)


# -- serve -------------------------------------------------------------------------------
class Client(threading.Thread):
    """Sends the same request in a loop and records (status, version, scores)."""

    def __init__(self, port: int, body: bytes) -> None:
        super().__init__(daemon=True)
        self.port, self.body = port, body
        self.stop = threading.Event()
        self.answers: list[tuple[int, int, list | None]] = []
        self.refused_connections = 0

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                status, body = post(self.port, self.body)
                self.answers.append((status, body.get("version", -1),
                                     body.get("scores")))
            except OSError:
                self.refused_connections += 1
                time.sleep(0.05)


def post(port: int, body: bytes, path: str = "/predict") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(raw)
    except json.JSONDecodeError:
        return response.status, {}


def served_version(port: int) -> int | None:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/v2/models/terarec")
        response = conn.getresponse()
        body = json.loads(response.read())
        return int(body["versions"][0]) if response.status == 200 else None
    except (OSError, ValueError, KeyError):
        return None


def wait_for(port: int, version: int, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if served_version(port) == version:
            return True
        time.sleep(0.1)
    return False


def _requests(data: Path, n: int) -> bytes:
    from terarec.types import FeatureSchema

    schema = FeatureSchema.criteo()
    names = list(schema.column_names)
    rows = []
    for line in data.read_text().splitlines()[:n]:
        cells = dict(zip(names, line.split("\t"), strict=True))
        rows.append({k: v for k, v in cells.items() if k != schema.label and v != ""})
    return json.dumps({"candidates": rows}).encode()


def serve_rounds(work: Path, model: Path, export_src: Path, data: Path,
                 totals: dict) -> None:
    export = work / "export-served"
    shutil.copytree(export_src, export)
    ckpt = load_checkpoint(model)
    keys, values = ckpt.sparse["keys"], ckpt.sparse["values"]
    pass_id = int(ckpt.meta["pass_id"])

    def delta(shift: float, into: Path = export) -> str:
        return ModelExporter(into).write_delta(
            dense=ckpt.dense, keys=keys[::2], values=values[::2] + shift,
            deleted=keys[1::40], pass_id=pass_id).name

    def damaged_delta(shift: float, damage) -> str:
        """A delta written and damaged out of the server's sight (in a copy of the
        export), then moved in whole: written in place, a server polling under load
        loaded it between the write and the damage, and rightly served it."""
        staging = work / "staging"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(export, staging)
        name = delta(shift, into=staging)
        damage(staging / name)
        os.rename(staging / name, export / name)
        atomic_write_text(export / LATEST, name)
        shutil.rmtree(staging)
        return name

    port, cache = free_port(), work / "serve-cache"
    serve_cmd = ["serve", str(export), "--port", str(port), "--threads", "1",
                 "--cache-rows", "0", "--poll-seconds", "0.2", "--incomplete-seconds", "2",
                 "--cache-dir", str(cache), "--log-level", "warning"]
    proc = _terarec(*serve_cmd)
    body = _requests(data, 32)
    newest = read_manifest(Storage(export), latest_version(Storage(export)) or "").version
    if not wait_for(port, newest):
        raise RuntimeError("the server did not come up")
    client = Client(port, body)
    client.start()
    must_not_serve: set[int] = set()
    try:
        while len(client.answers) < 3:  # answers from before any fault
            time.sleep(0.05)
        # 1. served shards truncated in place (was: SIGBUS)
        full = read_manifest(Storage(export), f"v{newest:06d}").base
        for shard in sorted((export / full / "sparse").glob("shard-*")):
            os.truncate(shard, 4096)
            totals["faults"] += 1
        time.sleep(1.0)
        # 2. a delta with a flipped byte
        bad = damaged_delta(0.5, lambda folder: _flip(folder / shard_name(0)))
        must_not_serve.add(int(bad[1:]))
        totals["faults"] += 1
        time.sleep(1.0)
        # 3. after a refused delta, a new full version, then a delta whose files arrive late
        full_name = ModelExporter(export).write_full(
            schema=_schema(model), model_config=_model_config(model), dense=ckpt.dense,
            keys=keys, values=values, pass_id=pass_id).name
        if not wait_for(port, int(full_name[1:])):
            totals["stuck_versions"] += 1
        late = delta(0.25)
        shard = export / late / shard_name(0)
        held = shard.read_bytes()
        shard.unlink()
        time.sleep(1.0)
        shard.write_bytes(held)
        totals["faults"] += 1
        if not wait_for(port, int(late[1:])):
            totals["stuck_versions"] += 1
        # 3b. a delta whose files arrive after --incomplete-seconds (was: refused for good,
        # with every delta after it)
        late = delta(0.3)
        shard = export / late / shard_name(0)
        held = shard.read_bytes()
        shard.unlink()
        time.sleep(4.0)
        shard.write_bytes(held)
        totals["faults"] += 1
        if not wait_for(port, int(late[1:])):
            totals["stuck_versions"] += 1
        after = delta(0.35)
        if not wait_for(port, int(after[1:])):
            totals["stuck_versions"] += 1
        # 3c. the server's own copy of a served shard truncated (was: SIGBUS), then a
        # request whose keys no delta holds, so it reads that shard
        for copy in sorted((cache / full_name / "sparse").glob("shard-*")):
            copy.chmod(0o644)
            os.truncate(copy, 4096)
            totals["faults"] += 1
        status, _ = post(port, _unseen(body))
        totals["server_5xx"] += status >= 500
        # 4. a delta whose manifest reaches outside its version
        def point_outside(folder: Path) -> None:
            outside = work / "outside" / "dense.safetensors"
            outside.parent.mkdir(exist_ok=True)
            shutil.copy(folder / "dense.safetensors", outside)
            manifest = json.loads((folder / MANIFEST).read_text())
            rel = "../../outside/dense.safetensors"  # from the export's version folder
            manifest["dense"] = rel
            manifest["files"][rel] = {"sha256": sha256_bytes(outside.read_bytes()),
                                      "bytes": outside.stat().st_size}
            (folder / MANIFEST).write_text(json.dumps(manifest))

        escape = damaged_delta(0.75, point_outside)
        must_not_serve.add(int(escape[1:]))
        totals["faults"] += 1
        # 5. hostile bodies
        for raw in (b'{"candidates": [{"I1": ' + b"9" * 5000 + b"}]}", os.urandom(300),
                    b'{"candidates": [{"I1": NaN}]}', b'{"candidates": [{"I1": 1e999}]}',
                    b"[" * 100000, b'{"candidates": 7}'):
            status, _ = post(port, raw)
            totals["faults"] += 1
            totals["server_5xx"] += status >= 500
        time.sleep(1.0)
        # 5b. versions consistent with their manifests but unservable: all rows NaN, keys
        # out of order, and a delta whose shard is a symbolic link out of its folder
        served = served_version(port)
        def link_out(folder: Path) -> None:
            target = work / "outside" / "shard.safetensors"
            shutil.move(folder / shard_name(0), target)
            (folder / shard_name(0)).symlink_to(target)

        linked = damaged_delta(0.6, link_out)
        must_not_serve.add(int(linked[1:]))
        totals["faults"] += 1
        time.sleep(1.0)
        for edit in (_nan_rows, _unsorted_keys):
            must_not_serve.add(_full_copy(export, full_name, edit))
            totals["faults"] += 1
            time.sleep(1.0)
        if served_version(port) != served:
            totals["poisoned_artifacts"] += 1
        # 6. the export deleted and written again from scratch
        shutil.rmtree(export)
        time.sleep(0.6)
        ModelExporter(export).write_full(schema=_schema(model), model_config=_model_config(model),
                                         dense=ckpt.dense, keys=keys, values=values,
                                         pass_id=pass_id)
        totals["faults"] += 1
        if not wait_for(port, 1):
            totals["stuck_versions"] += 1
        # 7. kill -9 and restart: up again on the newest good version
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        totals["faults"] += 1
        proc = _terarec(*serve_cmd)
        if not wait_for(port, 1):
            totals["stuck_versions"] += 1
        time.sleep(0.5)
    finally:
        client.stop.set()
        client.join(timeout=30)
        if proc.poll() is not None and proc.returncode != -signal.SIGKILL:
            totals["server_crashes"] += 1
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            totals["server_crashes"] += 1
    # Every answer of one version equals its first one (e.g. before its files were
    # truncated, or before a restart); refused versions never answer.
    first: dict[int, list] = {}
    for status, version, scores in client.answers:
        totals["server_5xx"] += status >= 500
        if status == 200:
            totals["requests_ok"] += 1
            expected = first.setdefault(version, scores)
            if version in must_not_serve or not np.allclose(scores, expected, atol=1e-6):
                totals["poisoned_artifacts"] += 1
    totals["versions_served"] = sorted(first)
    totals["requests"] += len(client.answers)


def _unseen(body: bytes) -> bytes:
    """``body`` with every categorical value replaced by one no version holds."""
    request = json.loads(body)
    for n, row in enumerate(request["candidates"]):
        row.update({k: f"unseen-{n}-{k}" for k in list(row) if k.startswith("C")})
    return json.dumps(request).encode()


def _nan_rows(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return keys, np.full_like(values, np.nan)


def _unsorted_keys(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keys = keys.copy()
    keys[1], keys[2] = keys[2], keys[1]  # first and last key as the manifest says
    return keys, values


def _full_copy(export: Path, source: str, edit) -> int:
    """A new full version: full version ``source`` with its first shard passed through
    ``edit``, under a manifest whose sizes and checksums match; its number."""
    from terarec.export.format import memmap_tensors, rows_bytes

    storage = Storage(export)
    number = max(int(n[1:]) for n in list_versions(storage)) + 1
    name = f"v{number:06d}"
    # built beside the export and moved in whole: the server never sees it half made
    folder = export.parent / f"staging-{name}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(export / source, folder)
    shard = folder / shard_name(0)
    tensors = memmap_tensors(shard)
    data = rows_bytes(*edit(np.array(tensors["keys"]), np.array(tensors["values"])))
    del tensors
    shard.write_bytes(data)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest.update(name=name, version=number, base=name, deltas=[], created=time.time())
    manifest.pop("parent", None)
    manifest["files"][shard_name(0)] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    os.rename(folder, export / name)
    (export / LATEST).write_text(name)
    return number


def follow_rounds(work: Path, data: Path, totals: dict) -> None:
    """A file written in place under ``train --follow`` (read while it grows): the run
    must train every row or stop naming the file, never lose rows in silence."""
    folder, out = work / "follow-logs", work / "follow-model"
    folder.mkdir()
    lines = data.read_text().splitlines(keepends=True)
    (folder / "01.tsv").write_text("".join(lines[:1000]))
    proc = _terarec("train", "--follow", str(folder), "--out", str(out), "--resume",
                    "--stop-idle", "15", "--poll-seconds", "0.2", *TRAIN_ARGS)
    deadline = time.monotonic() + 120
    while not (out / "history.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    grown = folder / "02.tsv"
    grown.write_text("".join(lines[1000:1500]))
    time.sleep(4.0)
    with grown.open("a") as fh:
        fh.write("".join(lines[1500:2000]))
    totals["faults"] += 1
    text = proc.communicate(timeout=300)[0].decode()
    trained = _history_rows(out) if list_checkpoints(out) else 0
    refused = proc.returncode != 0 and "changed after it was taken for training" in text
    if trained != 2000 and not refused:
        totals["rows_lost"] += 2000 - trained


def _schema(model: Path):
    from terarec.modeldir import read_model_meta

    return read_model_meta(model)[0]


def _model_config(model: Path):
    from terarec.modeldir import read_model_meta

    return read_model_meta(model)[1].model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=9000, help="training rows (6 passes)")
    p.add_argument("--train-kills", type=int, default=3, help="kill -9s per train round")
    p.add_argument("--export-kills", type=int, default=3)
    p.add_argument("--search-kills", type=int, default=4)
    p.add_argument("--stages", default="train,search,export,serve,follow",
                   help="comma-separated stages to run (export and serve need train)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="terarec-faults-"))
    totals = dict.fromkeys(
        ["faults", "train_rounds", "resumed_identical", "server_5xx", "server_crashes",
         "poisoned_artifacts", "rows_lost", "versions_lost", "unguarded_writers",
         "stuck_versions", "requests", "requests_ok", "search_rounds", "search_identical",
         "search_continued"], 0)
    faults_by_stage: dict[str, int] = {}
    start = time.perf_counter()
    try:
        data = work / "train.tsv"
        generate(data, args.rows, model_seed=3, sample_seed=4, vocab_scale=0.05)
        reference = work / "reference"
        t0 = time.perf_counter()
        code, text = _run("train", "--train", str(data), "--out", str(reference), *TRAIN_ARGS)
        if code != 0:
            raise RuntimeError(text[-2000:])
        baseline_s = time.perf_counter() - t0
        stages = {"train": lambda: train_rounds(work, data, rng, args.train_kills, reference,
                                                baseline_s, totals),
                  "search": lambda: search_rounds(work, data, rng, args.search_kills, totals),
                  "export": lambda: export_rounds(work, work / "model-memory", rng,
                                                  args.export_kills, totals),
                  "serve": lambda: serve_rounds(work, work / "model-memory",
                                                work / "export-memory", data, totals),
                  "follow": lambda: follow_rounds(work, data, totals)}
        chosen = [s.strip() for s in args.stages.split(",") if s.strip()]
        unknown = sorted(set(chosen) - set(stages))
        if unknown:
            raise SystemExit(f"--stages: unknown {', '.join(unknown)}; "
                             f"known: {', '.join(stages)}")
        for stage in chosen:
            run = stages[stage]
            before = totals["faults"]
            run()
            faults_by_stage[stage] = totals["faults"] - before
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({
        "faults": totals.pop("faults"), "resumed_identical": totals.pop("resumed_identical"),
        "server_5xx": totals.pop("server_5xx"), "server_crashes": totals.pop("server_crashes"),
        "poisoned_artifacts": totals.pop("poisoned_artifacts"),
        "rows_lost": totals.pop("rows_lost"), "faults_by_stage": faults_by_stage, **totals,
        "baseline_train_s": round(baseline_s, 2),
        "seconds": round(time.perf_counter() - start, 1), "seed": args.seed,
        "loadavg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
