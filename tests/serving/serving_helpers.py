"""Small synthetic runs, raw request rows and a real HTTP server in a thread."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import uvicorn

from terarec.config import ModelConfig, StoreConfig, TrainConfig
from terarec.data.synth import generate
from terarec.types import FeatureSchema

SCHEMA = FeatureSchema.criteo()
PASS_ROWS = 1000


def make_data(path: Path, rows: int, sample_seed: int = 1) -> Path:
    """Criteo-format rows with small vocabularies, so passes share many keys."""
    generate(path, rows, model_seed=0, sample_seed=sample_seed, vocab_scale=0.01)
    return path


def small_config(evict_after_passes: int | None = 1) -> TrainConfig:
    """A narrow DeepFM; keys unseen for a pass are evicted, so deltas carry deletions."""
    return TrainConfig(batch_size=250, pass_rows=PASS_ROWS, seed=3, threads=1,
                       model=ModelConfig(name="deepfm", embedding_dim=8, deep_mlp=(32, 16)),
                       store=StoreConfig(evict_after_passes=evict_after_passes))


def raw_records(path: Path, rows: int) -> list[dict[str, Any]]:
    """The first ``rows`` rows of a Criteo TSV as request dicts (raw strings, missing
    cells left out), without the label."""
    names = list(SCHEMA.column_names)
    table = pa_csv.read_csv(
        path, read_options=pa_csv.ReadOptions(column_names=names),
        parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False),
        convert_options=pa_csv.ConvertOptions(column_types={n: pa.string() for n in names},
                                              strings_can_be_null=True))
    records = table.slice(0, rows).to_pylist()
    return [{k: v for k, v in r.items() if k != SCHEMA.label and v not in (None, "")}
            for r in records]


class ServerThread:
    """uvicorn serving ``app`` on a loopback port, in a thread, for one ``with`` block."""

    def __init__(self, app) -> None:
        # The socket is bound here and handed to uvicorn, so that no other test process
        # can take the port between choosing it and listening on it.
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.socket.close()

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data,
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        try:
            return response.status, json.loads(raw)
        except json.JSONDecodeError:
            return response.status, raw.decode()

    def predict(self, context: dict, candidates: list[dict]) -> tuple[int, np.ndarray]:
        status, body = self.request("POST", "/predict",
                                    {"context": context, "candidates": candidates})
        if status != 200:
            raise AssertionError(f"/predict answered {status}: {body}")
        return body["version"], np.asarray(body["scores"], np.float64)


def split_context(records: list[dict], context_fields: tuple[str, ...]
                  ) -> tuple[dict, list[dict], list[dict]]:
    """(context, candidates, merged rows): ``context_fields`` of the first record become
    the shared context, the remaining fields of every record its candidate."""
    context = {k: records[0][k] for k in context_fields if k in records[0]}
    candidates = [{k: v for k, v in r.items() if k not in context_fields} for r in records]
    return context, candidates, [{**context, **c} for c in candidates]


@contextlib.contextmanager
def app_client(export: str | Path, max_candidates: int) -> Iterator[Any]:
    """An in-process test client of the app serving ``export``: a server error comes
    back as a 500 answer, as a client would see it, not as an exception."""
    from fastapi.testclient import TestClient

    from terarec.serving.app import create_app
    from terarec.serving.engine import ServingEngine

    engine = ServingEngine(export)
    engine.refresh()
    with TestClient(create_app(engine, max_candidates=max_candidates),
                    raise_server_exceptions=False) as client:
        yield client
