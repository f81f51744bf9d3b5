"""Files changed underneath the engine: served files are private verified copies, a
version whose files arrive after its manifest is retried, a recreated export is followed,
and manifests cannot point outside their version."""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from serving_helpers import SCHEMA

import terarec
from terarec.data.readers import batch_from_records
from terarec.export import ExportError, ModelExporter, Storage
from terarec.export.format import MANIFEST, check_member_path, sha256_bytes, shard_name
from terarec.loopback import free_port
from terarec.serving.engine import ServingEngine

TOL = 1e-5


@pytest.fixture
def export(live_run, tmp_path):
    """A private copy of the live run's export (versions 1-3)."""
    path = tmp_path / "export"
    shutil.copytree(live_run.export, path)
    return path


@pytest.fixture
def batch(live_run):
    return batch_from_records(live_run.records, SCHEMA)


def _engine(export, **kw) -> ServingEngine:
    engine = ServingEngine(export, cache_rows=0, **kw)  # every lookup reads the shards
    assert engine.refresh() and engine.current.version == 3
    return engine


def _write_delta(export, trainer, shift: float = 0.5):
    arrays = trainer.store.to_arrays()
    return ModelExporter(export).write_delta(
        dense=trainer.model.state_dict(), keys=arrays["keys"][::3],
        values=arrays["values"][::3] + shift, deleted=arrays["keys"][1::50],
        pass_id=trainer.pass_id)


def _write_full(export, trainer, shift: float = 0.0):
    arrays = trainer.store.to_arrays()
    return ModelExporter(export).write_full(
        schema=SCHEMA, model_config=trainer.config.model, dense=trainer.model.state_dict(),
        keys=arrays["keys"], values=arrays["values"] + shift, pass_id=trainer.pass_id)


def test_served_files_are_private_copies(export, live_run, batch, tmp_path):
    engine = _engine(export)
    shard = export / "v000001" / shard_name(0)
    served = engine.cache_dir / "v000001" / shard_name(0)
    assert served.exists() and not os.path.samefile(served, shard)
    # Truncated in place (this used to be a SIGBUS on the next uncached lookup), then
    # the whole export removed: scoring goes on from the copies.
    os.truncate(shard, 4096)
    np.testing.assert_allclose(engine.score_batch(batch), live_run.cli_scores[3], atol=TOL)
    shutil.rmtree(export)
    assert not engine.refresh()
    np.testing.assert_allclose(engine.score_batch(batch), live_run.cli_scores[3], atol=TOL)
    folder = engine.cache_dir
    engine.close()
    assert not folder.exists()


def test_a_version_truncated_before_loading_is_refused(export, live_run, batch):
    os.truncate(export / "v000001" / shard_name(0), 4096)
    engine = ServingEngine(export, incomplete_timeout_s=0)
    assert not engine.refresh()
    assert engine.current is None
    assert "v000001" in engine.refused


def test_files_arriving_after_their_manifest_are_waited_for(export, live_run, batch,
                                                            caplog):
    engine = _engine(export)
    _write_delta(export, live_run.trainer)
    _write_delta(export, live_run.trainer, shift=-0.25)
    # v000004's shard is not there yet (its manifest was copied first), nor all of v5's.
    late = export / "v000004" / shard_name(0)
    held = late.read_bytes()
    late.unlink()
    with caplog.at_level(logging.WARNING, logger="terarec.serving.engine"):
        assert not engine.refresh()
        assert not engine.refresh()
    assert engine.current.version == 3 and engine.refused == {}
    assert any("v000004 is incomplete" in r.getMessage() for r in caplog.records)
    late.write_bytes(held[:100])  # half-copied: still waiting
    assert not engine.refresh() and engine.refused == {}
    late.write_bytes(held)
    assert engine.refresh()
    assert engine.current.version == 5
    assert engine.current.manifest.deltas == ["v000002", "v000003", "v000004", "v000005"]


def test_files_that_never_arrive_are_refused_after_the_timeout(export, live_run, caplog):
    engine = _engine(export, incomplete_timeout_s=0.3)
    _write_delta(export, live_run.trainer)
    (export / "v000004" / "dense.safetensors").unlink()
    assert not engine.refresh() and engine.refused == {}
    time.sleep(0.4)
    with caplog.at_level(logging.ERROR, logger="terarec.serving.engine"):
        assert not engine.refresh()
    assert "still incomplete" in engine.refused["v000004"]
    assert any("refusing version v000004" in r.getMessage() for r in caplog.records)
    assert engine.current.version == 3
    # A later full version is served.
    _write_full(export, live_run.trainer)
    assert engine.refresh() and engine.current.version == 5


def test_files_arriving_after_the_timeout_are_still_loaded(export, live_run, batch):
    """A delta whose files came after --incomplete-seconds was refused for good, and so
    was every later delta on it: the server stayed on the old version until the next
    full one. Now it is retried at every poll and loaded, with the deltas after it."""
    engine = _engine(export, incomplete_timeout_s=0.3)
    _write_delta(export, live_run.trainer)
    late = export / "v000004" / shard_name(0)
    held = late.read_bytes()
    late.unlink()
    assert not engine.refresh()
    time.sleep(0.4)
    assert not engine.refresh()
    assert "still incomplete" in engine.refused["v000004"]
    _write_delta(export, live_run.trainer, shift=-0.25)
    assert not engine.refresh() and engine.current.version == 3
    assert "v000005" not in engine.refused
    late.write_bytes(held)
    assert engine.refresh()
    assert engine.current.version == 5 and engine.refused == {}
    assert engine.current.manifest.deltas == ["v000002", "v000003", "v000004", "v000005"]


@pytest.mark.parametrize("served_again", [False, True])
def test_a_recreated_export_is_followed(export, live_run, batch, caplog, served_again):
    engine = _engine(export)
    before = engine.score_batch(batch)
    shutil.rmtree(export)
    _write_full(export, live_run.trainer, shift=0.3)  # v000001 again, other rows
    _write_delta(export, live_run.trainer, shift=0.6)
    if served_again:  # numbered exactly like the served version
        _write_delta(export, live_run.trainer, shift=0.9)
    with caplog.at_level(logging.WARNING, logger="terarec.serving.engine"):
        assert engine.refresh()
    want = 3 if served_again else 2
    assert engine.current.version == want
    assert any("was recreated" in r.getMessage() for r in caplog.records)
    after = engine.score_batch(batch)
    assert np.abs(after - before).max() > 1e-3
    # Same scores as a fresh engine on the new export: nothing of the old one kept.
    fresh = ServingEngine(export)
    assert fresh.refresh() and fresh.current.version == want
    np.testing.assert_allclose(after, fresh.score_batch(batch), atol=1e-6)


def test_a_refused_name_is_retried_once_re_exported(export, live_run):
    _write_delta(export, live_run.trainer)
    manifest = export / "v000004" / MANIFEST
    manifest.write_text(manifest.read_text()[:100])
    engine = _engine(export)
    assert "v000004" in engine.refused
    shutil.rmtree(export / "v000004")
    _write_delta(export, live_run.trainer)  # v000004 again, whole this time
    assert engine.refresh() and engine.current.version == 4


def test_a_manifest_pointing_outside_its_version_is_refused(export, live_run, tmp_path):
    engine = _engine(export)
    _write_delta(export, live_run.trainer)
    other = tmp_path / "other" / "v000010"
    other.mkdir(parents=True)
    shutil.copy(export / "v000004" / "dense.safetensors", other / "dense.safetensors")
    rel = "../../other/v000010/dense.safetensors"
    data = (other / "dense.safetensors").read_bytes()
    path = export / "v000004" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["dense"] = rel
    manifest["files"][rel] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    path.write_text(json.dumps(manifest))
    assert not engine.refresh()
    assert engine.current.version == 3
    assert "'../../other/v000010/dense.safetensors' is not a plain relative path" in (
        engine.refused["v000004"])


@pytest.mark.parametrize("rel", ["../x", "/etc/passwd", "a/../../b", "a//b", "./a", "a\\b",
                                 "", "s3://bucket/x", 7])
def test_paths_outside_a_version_are_rejected(rel):
    with pytest.raises(ExportError, match="not a plain relative path"):
        check_member_path(rel, "manifest")


def test_the_writer_claims_version_numbers(export, live_run):
    # Another writer took v000004 after this one listed the folder: the next name is used.
    storage = Storage(export)
    assert storage.create_exclusive("v000004/.claim", b"other writer")
    assert not storage.create_exclusive("v000004/.claim", b"me")
    result = _write_delta(export, live_run.trainer)
    assert result.name == "v000005"
    assert (export / "v000004" / ".claim").read_bytes() == b"other writer"
    # LATEST never moves back to an older version.
    (export / "LATEST").write_text("v000009")
    ModelExporter(export)._publish("v000006")
    assert (export / "LATEST").read_text() == "v000009"


def test_concurrent_writers_never_share_a_version(export, live_run):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(6) as pool:
        names = list(pool.map(lambda i: _write_full(export, live_run.trainer).name, range(6)))
    assert len(set(names)) == 6
    storage = Storage(export)
    for name in names:
        assert json.loads(storage.read_bytes(f"{name}/{MANIFEST}"))["name"] == name


def _start_server(export, port: int, *extra: str) -> subprocess.Popen:
    src = Path(terarec.__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src),
                                                        os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [sys.executable, "-m", "terarec", "serve", str(export), "--port", str(port),
         "--threads", "1", "--cache-rows", "0", "--poll-seconds", "0.2",
         "--log-level", "info", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _interrupted(proc: subprocess.Popen) -> str:
    """What a server printed once it was stopped by SIGINT, as Ctrl-C stops it."""
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=30)[0].decode()


def _post(port: int, body: dict, timeout_s: float = 60) -> tuple[int, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("POST", "/predict", json.dumps(body))
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_running_server_survives_its_files_being_truncated_and_removed(export, live_run,
                                                                         tmp_path):
    port = free_port()
    proc = _start_server(export, port)
    try:
        status, body = _post(port, {"candidates": live_run.records})
        assert status == 200 and body["version"] == 3
        np.testing.assert_allclose(body["scores"], live_run.cli_scores[3], atol=TOL)
        for shard in sorted((export / "v000001" / "sparse").glob("shard-*")):
            os.truncate(shard, 4096)  # was: SIGBUS on the next request with uncached keys
        status, body = _post(port, {"candidates": live_run.records})
        assert status == 200, body
        np.testing.assert_allclose(body["scores"], live_run.cli_scores[3], atol=TOL)
        shutil.rmtree(export)
        time.sleep(0.5)  # a few polls of an export that is gone
        status, body = _post(port, {"candidates": live_run.records})
        assert status == 200 and body["version"] == 3
        # Re-exported from scratch: the server follows the new v000001.
        _write_full(export, live_run.trainer, shift=0.3)
        deadline = time.monotonic() + 60
        while body["version"] != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
            status, body = _post(port, {"candidates": live_run.records})
        assert status == 200 and body["version"] == 1
        assert proc.poll() is None
    finally:
        output = _interrupted(proc)
    assert proc.returncode == 0, output
    assert "was recreated" in output


def test_a_damaged_cache_copy_costs_the_version_not_the_process(export, live_run,
                                                                 tmp_path):
    """A shard copy in the server's own cache truncated in place killed the server with
    SIGBUS (exit 135) on the next request with unseen keys. Now the version is reloaded
    from the export (copied and verified again) and the request answered from it."""
    port, cache = free_port(), tmp_path / "cache"
    proc = _start_server(export, port, "--cache-dir", str(cache))
    try:
        status, body = _post(port, {"candidates": live_run.records[:1]})
        assert status == 200 and body["version"] == 3
        copy = cache / "v000001" / shard_name(0)
        assert not os.access(copy, os.W_OK) or os.geteuid() == 0  # kept read-only
        copy.chmod(0o644)
        os.truncate(copy, 4096)
        unseen = [{**r, **{f"C{i}": f"unseen-{n}-{i}" for i in range(1, 27)}}
                  for n, r in enumerate(live_run.records[:20])]  # read from the shards
        status, body = _post(port, {"candidates": unseen})
        assert status == 200 and body["version"] == 3, body
        status, body = _post(port, {"candidates": live_run.records})
        assert status == 200, body
        np.testing.assert_allclose(body["scores"], live_run.cli_scores[3], atol=TOL)
        assert proc.poll() is None
    finally:
        output = _interrupted(proc)
    assert proc.returncode == 0, output
    assert "its local files were damaged" in output


@pytest.mark.parametrize("link", ["file", "folder"])
def test_a_symbolic_link_in_a_version_is_refused(export, live_run, tmp_path, link):
    """A link inside a version folder passed the path check: its target (anything the
    server may read, e.g. /etc/passwd) was copied into the server's cache. A link is
    refused even when its target holds the very bytes the manifest lists."""
    engine = _engine(export)
    _write_delta(export, live_run.trainer)
    folder = export / "v000004"
    outside = tmp_path / "outside"
    outside.mkdir()
    if link == "file":
        shard = folder / shard_name(0)
        shutil.move(shard, outside / "shard.safetensors")
        shard.symlink_to(outside / "shard.safetensors")
    else:
        shutil.move(folder / "sparse", outside / "sparse")
        (folder / "sparse").symlink_to(outside / "sparse")
    assert not engine.refresh()
    assert engine.current.version == 3
    assert "is a symbolic link" in engine.refused["v000004"]
    assert not (engine.cache_dir / "v000004" / "sparse").exists()
