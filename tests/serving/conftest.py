"""One training run served live, recorded once per session for the serving tests.

Training writes a checkpoint and exports a version (full, then deltas) after every pass
while a real HTTP server follows the export and a client keeps scoring through the
swaps. For every version the run records the server's scores, ``terarec predict``'s
scores on the checkpoint of the same pass, and what the trainer itself predicts.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from serving_helpers import SCHEMA, ServerThread, make_data, raw_records, small_config

from terarec.cli.main import main as cli_main
from terarec.data.readers import batch_from_records
from terarec.export import IncrementalExporter
from terarec.modeldir import save_checkpoint
from terarec.serving.app import create_app
from terarec.serving.engine import ServingEngine
from terarec.train.trainer import Trainer

ROWS = 3000
SCORED_ROWS = 64


@dataclass
class LiveRun:
    export: Path
    model_dir: Path
    rows_file: Path
    records: list[dict]
    trainer: Trainer
    ready_before_first_version: int
    server_scores: dict[int, np.ndarray] = field(default_factory=dict)
    kserve_scores: dict[int, np.ndarray] = field(default_factory=dict)
    cli_scores: dict[int, np.ndarray] = field(default_factory=dict)
    trainer_scores: dict[int, np.ndarray] = field(default_factory=dict)
    exported: list = field(default_factory=list)
    # (status, version, scores) of every request sent while versions were swapped in.
    under_load: list[tuple[int, int, np.ndarray | None]] = field(default_factory=list)
    metrics_text: str = ""


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _wait_for_version(server: ServerThread, version: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, body = server.request("GET", "/v2/models/terarec")
        if status == 200 and body["versions"] == [str(version)]:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server never reached version {version}")


@pytest.fixture(scope="session")
def live_run(tmp_path_factory) -> LiveRun:
    root = tmp_path_factory.mktemp("live")
    data = make_data(root / "train.tsv", ROWS)
    rows_file = root / "rows.tsv"
    rows_file.write_text("".join(data.read_text().splitlines(keepends=True)[:SCORED_ROWS]))
    records = raw_records(rows_file, SCORED_ROWS)
    export, model_dir = root / "export", root / "model"

    trainer = Trainer(SCHEMA, small_config())
    exporter = IncrementalExporter(export, trainer, every_passes=1)
    engine = ServingEngine(export, cache_rows=1500)
    app = create_app(engine, poll_interval_s=0.05)
    stop = threading.Event()

    with ServerThread(app) as server:
        status, _ = server.request("GET", "/v2/health/ready")
        run = LiveRun(export, model_dir, rows_file, records, trainer, status)

        def load() -> None:
            while not stop.is_set():
                status, body = server.request("POST", "/predict", {"candidates": records})
                scores = np.asarray(body["scores"]) if status == 200 else None
                run.under_load.append((status, body.get("version", -1) if status == 200
                                       else -1, scores))

        client = threading.Thread(target=load, daemon=True)

        def on_pass_end(t: Trainer, record: dict) -> None:
            save_checkpoint(model_dir, t)
            result = exporter.on_pass_end(t, record)
            run.exported.append(result)
            version = int(result.name[1:])
            run.trainer_scores[version] = t.predict_batches([batch_from_records(records,
                                                                               SCHEMA)])
            out = root / f"predict-{version}.txt"
            assert cli_main(["predict", "--model", str(model_dir), "--data", str(rows_file),
                             "--out", str(out)]) == 0
            run.cli_scores[version] = np.loadtxt(out)
            _wait_for_version(server, version)
            run.server_scores[version] = server.predict({}, records)[1]
            status, body = server.request("POST", "/v2/models/terarec/infer",
                                          _kserve_body(records))
            assert status == 200, body
            run.kserve_scores[version] = np.asarray(body["outputs"][0]["data"])
            if not client.is_alive():
                client.start()

        try:
            trainer.fit([data], progress=False, on_pass_end=on_pass_end)
        finally:
            stop.set()
            client.join(timeout=30)
        run.metrics_text = server.request("GET", "/metrics")[1]
    return run


def _kserve_body(records: list[dict]) -> dict:
    """A v2 inference request holding ``records``: one BYTES input per feature, with
    null where a row lacks the feature."""
    inputs = []
    for spec in SCHEMA.fields:
        inputs.append({"name": spec.name, "shape": [len(records)], "datatype": "BYTES",
                       "data": [r.get(spec.name) for r in records]})
    return {"id": "rows", "inputs": inputs}


@pytest.fixture(scope="session")
def cluster_chain(tmp_path_factory):
    """A model exported as full, two deltas, full again (the sparse-tier tests)."""
    from cluster_helpers import train_chain

    return train_chain(tmp_path_factory.mktemp("cluster-chain"))
