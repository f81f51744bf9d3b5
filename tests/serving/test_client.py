"""terarec.client against real servers: spread over replicas, retried past a dead one,
hedged past a slow one; /predict and KServe v2 answer as the servers do."""

from __future__ import annotations

import http.server
import threading
import time

import numpy as np
import pytest
import torch
from serving_helpers import SCHEMA, ServerThread, make_data, small_config

from terarec.client import Client, ClientError
from terarec.export import IncrementalExporter
from terarec.loopback import free_port
from terarec.serving.app import create_app
from terarec.serving.engine import ServingEngine
from terarec.train.trainer import Trainer


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("client")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer = Trainer(SCHEMA, small_config())
    exporter = IncrementalExporter(root / "export", trainer, every_passes=1)
    trainer.fit([make_data(root / "train.tsv", 1000)], progress=False,
                on_pass_end=exporter.on_pass_end)
    torch.set_num_threads(threads)
    return root / "export"


class _Slow(http.server.BaseHTTPRequestHandler):
    """A replica that takes a second to answer 503."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        time.sleep(1.0)
        self.send_response(503)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args) -> None:
        pass


RECORDS = [{"I1": "3", "C1": "68fd1e64", "C2": "80e26c9b"}, {"I2": "1", "C3": "fb936136"}]


def test_client_spreads_retries_and_hedges(export):
    engine = ServingEngine(export)
    engine.refresh()
    slow = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    try:
        with ServerThread(create_app(engine)) as a, ServerThread(create_app(engine)) as b:
            expected = engine.score_records(RECORDS)[0]
            dead = f"http://127.0.0.1:{free_port()}"
            urls = [dead, f"http://127.0.0.1:{a.port}", f"http://127.0.0.1:{b.port}"]
            with Client(urls, hedge_after_s=None, retries=2) as client:
                for _ in range(6):
                    scores, version = client.predict(RECORDS)
                    np.testing.assert_allclose(scores, expected, atol=1e-6)
                    assert version == engine.current.version
                assert client.stats.retries >= 2  # the dead replica was skipped
                out = client.infer([{"name": "C1", "shape": [2], "datatype": "BYTES",
                                     "data": ["68fd1e64", None]}], request_id="r1")
                assert out["id"] == "r1" and len(out["outputs"][0]["data"]) == 2
                assert client.metadata()["name"] == "terarec" and client.ready()
                with pytest.raises(ClientError) as err:
                    client.predict([{"nope": 1}])
                assert err.value.status == 422
            slow_url = f"http://127.0.0.1:{slow.server_address[1]}"
            with Client([slow_url, urls[1]], hedge_after_s=0.05, retries=1) as client:
                t0 = time.monotonic()
                scores, _ = client.predict(RECORDS)
                assert time.monotonic() - t0 < 0.8
                np.testing.assert_allclose(scores, expected, atol=1e-6)
                assert client.stats.hedges_sent == 1 and client.stats.hedges_won == 1
            with Client([dead], retries=1) as client, pytest.raises(ClientError):
                client.predict(RECORDS)
    finally:
        slow.shutdown()
        engine.close()
