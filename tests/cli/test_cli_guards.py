"""Concurrent writers and killed runs: ``train --out`` is locked, scoring runs on a tiered
model keep their scratch store inside the model directory, and what a killed process
left behind is removed by the next run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import terarec
from terarec.cli.main import main as cli_main
from terarec.data.synth import generate
from terarec.io import ScratchDir, exclusive_lock

TRAIN = ["--pass-rows", "1000", "--batch-size", "250", "--embedding-dim", "4",
         "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("guards") / "train.tsv"
    generate(path, 2000, model_seed=0, sample_seed=1, vocab_scale=0.01)
    return path


@pytest.fixture(scope="module")
def tiered_model(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiered") / "model"
    assert cli_main(["train", "--train", str(data), "--out", str(out), *TRAIN,
                     "--memory-budget", "4MB"]) == 0
    return out


def _env() -> dict[str, str]:
    src = Path(terarec.__file__).resolve().parents[1]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(src),
                                                        os.environ.get("PYTHONPATH", "")]))


def test_a_second_train_on_one_out_fails_at_once_naming_the_lock(data, tmp_path, capsys):
    out = tmp_path / "model"
    with exclusive_lock(out / ".lock", "test"):
        assert cli_main(["train", "--train", str(data), "--out", str(out), *TRAIN]) == 2
    err = capsys.readouterr().err
    assert f"model directory {out} is in use by another process" in err
    assert f"lock file {out / '.lock'}" in err and f"pid {os.getpid()}" in err
    assert not (out / "checkpoints").exists()
    # Released with its holder: the next run trains.
    assert cli_main(["train", "--train", str(data), "--out", str(out), *TRAIN]) == 0


def test_a_lock_held_by_another_process_is_named(data, tmp_path, capsys):
    out = tmp_path / "model"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from terarec.io import exclusive_lock\n"
         f"with exclusive_lock({str(out / '.lock')!r}, 'x'):\n"
         "    print('held', flush=True); time.sleep(60)"],
        env=_env(), stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"held"
        assert cli_main(["train", "--train", str(data), "--out", str(out), *TRAIN]) == 2
        assert f"pid {holder.pid}" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    # kill -9 released it.
    assert cli_main(["train", "--train", str(data), "--out", str(out), *TRAIN]) == 0


def test_train_out_naming_a_file_is_an_error(data, tmp_path, capsys):
    out = tmp_path / "file"
    out.write_text("x")
    assert cli_main(["train", "--train", str(data), "--out", str(out), *TRAIN]) == 2
    assert "is a file, not a model directory" in capsys.readouterr().err


def test_leftover_temp_files_of_a_killed_train_are_removed(data, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    leftover = out / ".train_config.json.x1y2z3.tmp"
    leftover.write_text("{")
    assert cli_main(["train", "--train", str(data), "--out", str(out), *TRAIN]) == 0
    assert not leftover.exists()


def test_scoring_a_tiered_model_leaves_nothing_outside_it(tiered_model, data, tmp_path,
                                                          monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr("tempfile.tempdir", None)
    # A scoring run killed with -9 while holding its scratch store...
    killed = subprocess.run(
        [sys.executable, "-c", "import os; from terarec.io import ScratchDir\n"
         f"s = ScratchDir({str(tiered_model / '.scratch')!r}, 'store')\n"
         "(s.path / 'slab-000000.bin').write_bytes(b'x' * 4096)\n"
         "os.kill(os.getpid(), 9)"], env=_env())
    assert killed.returncode == -9
    assert len(list((tiered_model / ".scratch").glob("store-*"))) == 1
    # ...is cleaned up by the next one, which removes its own folder when done.
    assert cli_main(["eval", "--model", str(tiered_model), "--data", str(data),
                     "--out", str(tmp_path / "m.json")]) == 0
    assert cli_main(["predict", "--model", str(tiered_model), "--data", str(data),
                     "--out", str(tmp_path / "p.txt")]) == 0
    assert list((tiered_model / ".scratch").iterdir()) == []
    assert list(tmp.iterdir()) == []


def test_a_live_scratch_dir_is_not_removed(tmp_path):
    with ScratchDir(tmp_path, "store") as mine:
        (mine / "data").write_text("rows")
        other = ScratchDir(tmp_path, "store")
        assert other.removed_stale == 0 and (mine / "data").exists()
        other.close()
    assert list(tmp_path.iterdir()) == []


def test_a_fresh_run_into_a_trained_directory_is_refused_and_keeps_its_checkpoints(
        data, tmp_path, capsys):
    out = tmp_path / "model"
    assert cli_main(["train", "--train", str(data), "--out", str(out), *TRAIN]) == 0
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert cli_main(["train", "--train", str(data), "--out", str(out), *TRAIN]) == 2
    err = capsys.readouterr().err
    assert "holds checkpoints of an earlier run" in err and "--resume" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert cli_main(["train", "--train", str(data), "--out", str(out), *TRAIN,
                     "--resume"]) == 0
