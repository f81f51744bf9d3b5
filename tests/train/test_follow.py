"""``terarec train --follow``: files trained in name order as they land (atomic rename or
a partition's ``_SUCCESS``), each scored before it is trained; SIGTERM finishes the pass
and exits 0; SIGKILL and the same command again trains every landed row exactly once;
an S3 source (moto)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from terarec.cli.main import main
from terarec.data.synth import generate
from terarec.export.storage import Storage
from terarec.modeldir import load_checkpoint
from terarec.train.follow import FollowOptions, FollowSource, is_data_name

SRC = Path(__file__).resolve().parents[2] / "src"
ARGS = ["--threads", "1", "--no-progress", "--embedding-dim", "4", "--seed", "3",
        "--batch-size", "250", "--pass-rows", "100000", "--poll-seconds", "0.2",
        "--epochs", "1"]
ROWS = 1500


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.fixture(scope="module")
def hourly(tmp_path_factory) -> list[Path]:
    """Six hourly files in a staging folder, to be moved into the followed one."""
    folder = tmp_path_factory.mktemp("staging")
    paths = [folder / f"2026-12-01T{h:02d}-00.tsv" for h in range(6)]
    for h, p in enumerate(paths):
        generate(p, ROWS, model_seed=1, sample_seed=h)
    return paths


def _land(src: Path, folder: Path, name: str | None = None) -> None:
    """Land a file the way a writer should: under a temporary name, then renamed."""
    tmp = folder / f".{src.name}.tmp"
    shutil.copy(src, tmp)
    tmp.rename(folder / (name or src.name))


def _history(out: Path) -> list[dict]:
    return json.loads((out / "history.json").read_text())


def _wait_for(condition, proc: subprocess.Popen | None = None, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc is None or proc.poll() is None, "the trainer exited early"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _follow_cmd(folder: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "terarec", "train", "--follow", str(folder), "--out",
            str(out), "--resume", *ARGS, *extra]


def test_landed_names():
    assert is_data_name("2026-12-01T10-20.tsv")
    for name in (".x.tsv", "_SUCCESS", "x.tsv.tmp", "x.part", "x.inprogress",
                 "x.tsv.truth.json"):
        assert not is_data_name(name), name


def test_follow_trains_files_as_they_land_in_name_order(hourly, tmp_path):
    folder, out = tmp_path / "logs", tmp_path / "model"
    folder.mkdir()
    for p in hourly[:2]:
        _land(p, folder)
    (folder / "2026-12-01T05-00.tsv.tmp").write_text("half-written\t")  # never read
    proc = subprocess.Popen(_follow_cmd(folder, out, "--stop-after", "5"), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (out / "history.json").exists()
                  and len(_history(out)) >= 2, proc)
        _land(hourly[2], folder)
        partition = folder / "2026-12-01T03"  # a partition: landed once _SUCCESS is there
        partition.mkdir()
        _land(hourly[3], partition, "part-0.tsv")
        _land(hourly[4], partition, "part-1.tsv")
        _wait_for(lambda: len(_history(out)) >= 3, proc)
        time.sleep(1.0)  # a follower that read unfinished partitions would train one now
        assert len(_history(out)) == 3  # the partition is not landed yet
        (partition / "_SUCCESS").write_text("")
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    history = _history(out)
    assert [h["files"] for h in history] == [
        ["2026-12-01T00-00.tsv"], ["2026-12-01T01-00.tsv"], ["2026-12-01T02-00.tsv"],
        ["part-0.tsv"], ["part-1.tsv"]]
    assert [h["rows"] for h in history] == [ROWS] * 5
    # every file scored before it was trained: the first one by an untrained model
    assert all(h["file_rows"] == ROWS and 0 < h["file_auc"] < 1 for h in history)
    assert history[0]["file_auc"] < history[-1]["file_auc"]
    assert json.loads(stdout.splitlines()[0])["stop_reason"] == "stop_after"
    prom = (out / "metrics.prom").read_text()
    assert "terarec_files_trained_total 5\n" in prom
    assert f"terarec_rows_trained_total {5 * ROWS}\n" in prom
    assert "Progressive" in (out / "report" / "report.html").read_text()


def test_sigterm_finishes_the_pass_then_sigkill_and_the_same_command_resumes(
        hourly, tmp_path):
    folder, out = tmp_path / "logs", tmp_path / "model"
    folder.mkdir()
    _land(hourly[0], folder)
    cmd = _follow_cmd(folder, out)
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: (out / "checkpoints" / "pass-000001").exists(), proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert json.loads(stdout.splitlines()[0])["stop_reason"] == "signal"
    for p in hourly[1:4]:
        _land(p, folder)
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:  # killed at once after its next committed pass
        _wait_for(lambda: (out / "checkpoints" / "pass-000002").exists(), proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    _land(hourly[4], folder)
    done = subprocess.run([*cmd, "--stop-after", "5"], env=_env(), capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    history = load_checkpoint(out).meta["history"]
    assert sum(h["rows"] for h in history) == 5 * ROWS
    assert [h["files"][0] for h in history] == [p.name for p in hourly[:5]]


def test_follow_an_s3_prefix(hourly, tmp_path, s3_server, capsys):
    options = json.dumps(s3_server)
    storage = Storage("s3://logs/hourly", s3_server)
    storage.fs.mkdir("logs")
    for p in hourly[:3]:
        storage.write_bytes(p.name, p.read_bytes())
    storage.write_bytes(hourly[3].name + ".tmp", b"not landed")
    out = tmp_path / "model"
    source = FollowSource(FollowOptions("s3://logs/hourly", s3_server), out / "cache")
    assert source.landed() == [p.name for p in hourly[:3]]
    assert main(["train", "--follow", "s3://logs/hourly", "--storage-options", options,
                 "--out", str(out), "--stop-after", "3", *ARGS]) == 0
    meta = load_checkpoint(out).meta
    assert sorted(meta["inputs"]["files"]) == [f"s3://logs/hourly/{p.name}"
                                               for p in hourly[:3]]
    assert sum(h["rows"] for h in meta["history"]) == 3 * ROWS
    assert not list((out / "follow-cache").rglob("*.tsv"))  # copies removed once read


def test_stop_idle_ends_a_run_with_nothing_new(hourly, tmp_path, capsys):
    folder, out = tmp_path / "logs", tmp_path / "model"
    folder.mkdir()
    _land(hourly[0], folder)
    started = time.monotonic()
    assert main(["train", "--follow", str(folder), "--out", str(out), "--stop-idle", "1.5",
                 *ARGS]) == 0
    assert time.monotonic() - started >= 1.5
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    assert summary["stop_reason"] == "stop_idle" and summary["files_trained"] == 1


def test_stop_idle_bounds_the_wait_for_the_first_file(tmp_path, capsys):
    """A fresh model waits for a first file to take its statistics from: --stop-idle
    ended that wait too (it waited forever when nothing landed)."""
    folder, out = tmp_path / "logs", tmp_path / "model"
    folder.mkdir()
    started = time.monotonic()
    assert main(["train", "--follow", str(folder), "--out", str(out), "--stop-idle", "0.5",
                 *ARGS]) == 2
    assert time.monotonic() - started < 60
    assert (f"--follow {folder}: no file landed within --stop-idle 0.5 s; nothing was "
            "trained") in capsys.readouterr().err
    assert not (out / "checkpoints").exists()


def test_follow_refuses_a_file_and_checks_the_format_flags_first(hourly, tmp_path, capsys):
    """--follow FILE was refused as "not an export folder"; a csv without its columns
    named failed only once the first file landed."""
    out = tmp_path / "model"
    assert main(["train", "--follow", str(hourly[0]), "--out", str(out), *ARGS]) == 2
    assert (f"--follow {hourly[0]} is a file: --follow takes the folder (or URI) files "
            "land in") in capsys.readouterr().err
    empty = tmp_path / "logs"
    empty.mkdir()
    assert main(["train", "--follow", str(empty), "--out", str(out), "--format", "csv",
                 "--label", "y", *ARGS]) == 2
    assert "--format csv needs --label and --numeric" in capsys.readouterr().err


def test_follow_flag_errors(tmp_path, capsys):
    base = ["train", "--out", str(tmp_path / "m")]
    assert main([*base, "--follow", str(tmp_path), "--train", str(tmp_path / "x")]) == 2
    assert "either --train FILE... or --follow SOURCE" in capsys.readouterr().err
    assert main([*base, "--train", str(tmp_path / "x"), "--stop-after", "2"]) == 2
    assert "--stop-after needs --follow" in capsys.readouterr().err


@pytest.mark.parametrize("extra,message", [
    (["--train", "X", "--poll-seconds", "5"], "--poll-seconds needs --follow"),
    (["--follow", "DIR", "--valid", "X", "--refit"], "--refit does not apply to --follow"),
    (["--follow", "DIR", "--no-refit"], "--no-refit does not apply to --follow"),
    (["--follow", "DIR", "--poll-seconds", "nan"], "--poll-seconds must be > 0 and finite"),
    (["--follow", "DIR", "--poll-seconds", "inf"], "--poll-seconds must be > 0 and finite"),
    (["--follow", "DIR", "--stop-idle", "nan"], "--stop-idle must be > 0, got nan"),
])
def test_follow_flags_without_effect_are_refused(tmp_path, capsys, extra, message):
    """--poll-seconds without --follow and --refit / --no-refit with it were silently
    ignored; --poll-seconds nan or inf and --stop-idle nan were taken (an overflowing
    wait, a run that never went idle)."""
    names = {"X": str(tmp_path / "x.tsv"), "DIR": str(tmp_path)}
    out = tmp_path / "m"
    assert main(["train", "--out", str(out), *[names.get(a, a) for a in extra]]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_files_with_no_rows_count_as_trained(hourly, tmp_path, capsys):
    """A partition's writer leaves a zero-byte part file (or a header-only CSV) for an
    hour without events: the run stopped with "empty file" / "no data rows". Such a file
    is trained as zero rows, recorded as done, and the next file trains."""
    folder, out = tmp_path / "logs", tmp_path / "model"
    folder.mkdir()
    _land(hourly[0], folder)
    (folder / "2026-12-01T00-30.tsv").write_bytes(b"")
    part = folder / "2026-12-01T00-40"
    part.mkdir()
    (part / "part-00000.tsv").write_bytes(b"")
    (part / "_SUCCESS").write_bytes(b"")
    _land(hourly[1], folder)
    assert main(["train", "--follow", str(folder), "--out", str(out), "--stop-after", "4",
                 *ARGS]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    assert summary["files_trained"] == 4
    meta = load_checkpoint(out).meta
    assert sum(h["rows"] for h in meta["history"]) == 2 * ROWS
    assert all(m["done"] for m in meta["inputs"]["files"].values())
    assert len(meta["inputs"]["files"]) == 4


def test_a_first_file_with_no_rows_gives_way_to_the_next_for_the_statistics(
        hourly, tmp_path, capsys):
    """A fresh model takes its numeric statistics from the first landed file: an empty
    one (an hour without events) stopped the run with "no data rows" before anything was
    trained. The next file with rows gives them; the empty one trains as zero rows."""
    folder, out = tmp_path / "logs", tmp_path / "model"
    folder.mkdir()
    (folder / "2026-12-01T00-00.tsv").write_bytes(b"")
    _land(hourly[1], folder)
    dead = out / "follow-cache" / "_first-dead"  # of a run killed taking its statistics
    dead.mkdir(parents=True)
    (dead / "copy.tsv").write_bytes(hourly[0].read_bytes())
    assert main(["train", "--follow", str(folder), "--out", str(out), "--stop-after", "2",
                 *ARGS]) == 0
    assert not dead.exists()
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    assert summary["files_trained"] == 2
    meta = load_checkpoint(out).meta
    assert sum(h["rows"] for h in meta["history"]) == ROWS
    schema = json.loads((out / "schema.json").read_text())
    assert all(f["std"] is not None for f in schema["fields"] if f["kind"] == "numeric")

    only_empty, fresh = tmp_path / "empty-logs", tmp_path / "fresh"
    only_empty.mkdir()
    (only_empty / "a.tsv").write_bytes(b"")
    assert main(["train", "--follow", str(only_empty), "--out", str(fresh),
                 "--stop-idle", "0.5", *ARGS]) == 2
    assert (f"--follow {only_empty}: no file with data rows landed within --stop-idle "
            "0.5 s") in capsys.readouterr().err


def _rows_of(path: Path, first: int, last: int) -> str:
    """Data lines ``first`` .. ``last - 1`` of a synth file (no header)."""
    return "".join(path.read_text().splitlines(keepends=True)[first:last])


def test_a_file_that_grows_after_it_was_trained_stops_the_run_loudly(hourly, tmp_path,
                                                                    capsys):
    """A file written in place was marked done at the length it had when read, and the
    rows appended later were never trained, silently (by the live run or by --resume)."""
    folder, out = tmp_path / "logs", tmp_path / "model"
    folder.mkdir()
    _land(hourly[0], folder)
    grown = folder / "2026-12-01T01-00.tsv"
    grown.write_text(_rows_of(hourly[1], 0, 500))
    assert main(["train", "--follow", str(folder), "--out", str(out), "--stop-after", "2",
                 *ARGS]) == 0
    capsys.readouterr()
    with grown.open("a") as fh:
        fh.write(_rows_of(hourly[1], 500, 1000))
    assert main(["train", "--follow", str(folder), "--out", str(out), "--resume",
                 "--stop-idle", "1", *ARGS]) == 2
    err = capsys.readouterr().err
    assert f"{grown.name} changed after it was taken for training" in err
    assert "written in place" in err
    meta = load_checkpoint(out).meta
    assert sum(h["rows"] for h in meta["history"]) == ROWS + 500


def test_a_file_growing_under_a_live_run_stops_it_loudly(hourly, tmp_path, capsys):
    folder, out = tmp_path / "logs", tmp_path / "model"
    folder.mkdir()
    _land(hourly[0], folder)
    grown = folder / "2026-12-01T01-00.tsv"
    grown.write_text(_rows_of(hourly[1], 0, 500))

    def append_once_trained() -> None:
        _wait_for(lambda: (out / "history.json").exists() and len(_history(out)) >= 2,
                  timeout=120)
        with grown.open("a") as fh:
            fh.write(_rows_of(hourly[1], 500, 1000))

    writer = threading.Thread(target=append_once_trained, daemon=True)
    writer.start()
    assert main(["train", "--follow", str(folder), "--out", str(out), "--stop-idle", "20",
                 *ARGS]) == 2
    writer.join()
    assert f"{grown.name} changed after it was taken for training" in capsys.readouterr().err


def test_a_last_file_with_no_rows_counts_towards_stop_after(hourly, tmp_path, capsys):
    """A zero-byte file landing after the others was never recorded (no pass carried
    its position), so --stop-after counting it was never reached."""
    folder, out = tmp_path / "logs", tmp_path / "model"
    folder.mkdir()
    _land(hourly[0], folder)
    (folder / "2026-12-01T01-00.tsv").write_bytes(b"")
    assert main(["train", "--follow", str(folder), "--out", str(out), "--stop-after", "2",
                 "--stop-idle", "20", *ARGS]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    assert summary["stop_reason"] == "stop_after" and summary["files_trained"] == 2


def test_a_file_trained_across_a_restart_is_reported_whole(hourly, tmp_path, capsys):
    """After SIGTERM mid-file and --resume, the history record finishing the file gave
    only the resumed part's rows and log loss, and metrics.json said skipped_rows 0
    although the checkpoint recorded the bad rows skipped before the restart."""
    folder, out = tmp_path / "logs", tmp_path / "model"
    folder.mkdir()
    lines = hourly[0].read_text().splitlines(keepends=True)
    bad = ["not\ta\tgood\trow\n"] * 3
    (folder / "a.tsv").write_text("".join(lines[:10] + bad + lines[10:]))
    args = ["train", "--follow", str(folder), "--out", str(out), "--resume", *ARGS,
            "--pass-rows", "100", "--on-bad-row", "skip"]

    def stop_after_a_pass() -> None:
        _wait_for(lambda: (out / "history.json").exists() and len(_history(out)) >= 1,
                  timeout=120)
        os.kill(os.getpid(), signal.SIGTERM)  # finish the pass, checkpoint, exit 0

    stopper = threading.Thread(target=stop_after_a_pass, daemon=True)
    stopper.start()
    assert main(args) == 0
    stopper.join()
    first = _history(out)
    assert first and not any("file_done" in h for h in first)
    assert main([*args, "--stop-after", "1"]) == 0
    history = _history(out)
    done = history[-1]
    assert done["file_rows"] == ROWS == sum(h["progressive_rows"] for h in history)
    assert done["file_auc_rows"] == ROWS - sum(h["progressive_rows"] for h in first)
    expected = sum(h["progressive_logloss"] * h["progressive_rows"]
                   for h in history) / ROWS
    assert done["file_logloss"] == pytest.approx(expected, rel=1e-6)
    assert json.loads((out / "metrics.json").read_text())["skipped_rows"] == 3
