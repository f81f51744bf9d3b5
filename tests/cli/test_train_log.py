"""``terarec train`` writing to a log file (stderr not a terminal): one line per pass and
no progress bar (a bar there was one 30 kB line of carriage returns)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from terarec.data.synth import generate

SRC = Path(__file__).resolve().parents[2] / "src"


def test_a_log_file_gets_lines_not_a_bar(tmp_path):
    data = tmp_path / "train.tsv"
    generate(data, 2000, model_seed=0, sample_seed=1, vocab_scale=0.01)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    log = tmp_path / "train.log"
    with open(log, "w") as fh:
        done = subprocess.run(
            [sys.executable, "-m", "terarec", "train", "--train", str(data), "--out",
             str(tmp_path / "m"), "--model", "lr", "--epochs", "2", "--batch-size", "500",
             "--threads", "1", "--valid-split", "0"], env=env, stderr=fh,
            stdout=subprocess.DEVNULL, timeout=300)
    text = log.read_text()
    assert done.returncode == 0, text
    assert "\r" not in text and " rows/s" not in text  # no tqdm bar
    passes = [line for line in text.splitlines() if " rows, loss " in line]
    assert len(passes) == 2, text
    assert "epoch 2, train.tsv" in passes[1]


def test_follow_logs_each_landed_file_and_each_exported_version(tmp_path):
    """``train --follow`` in a log: one line per file landed and per version exported."""
    data = tmp_path / "all.tsv"
    generate(data, 1200, model_seed=0, sample_seed=1, vocab_scale=0.01)
    lines = data.read_text().splitlines(keepends=True)
    source = tmp_path / "landing"
    source.mkdir()
    for i, chunk in enumerate((lines[:600], lines[600:])):
        (source / f"{i:02d}.tsv").write_text("".join(chunk))
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    log = tmp_path / "follow.log"
    with open(log, "w") as fh:
        done = subprocess.run(
            [sys.executable, "-m", "terarec", "train", "--follow", str(source), "--out",
             str(tmp_path / "m"), "--model", "lr", "--stop-after", "2", "--poll-seconds",
             "0.2", "--batch-size", "300", "--threads", "1", "--export-to",
             str(tmp_path / "export")], env=env, stderr=fh, stdout=subprocess.DEVNULL,
            timeout=300)
    text = log.read_text()
    assert done.returncode == 0, text
    assert "\r" not in text
    landed = [line for line in text.splitlines() if " landed " in line]
    assert [line.split(" landed ")[1].split()[0] for line in landed] == ["00.tsv", "01.tsv"]
    exported = [line for line in text.splitlines() if " exported " in line]
    versions = sorted(p.name for p in (tmp_path / "export").iterdir() if p.name[0] == "v")
    assert len(exported) == len(versions) == 2, text
    assert "exported full version v000001" in exported[0]
    assert "exported delta version v000002" in exported[1]


def test_the_banner_and_the_last_line_say_the_epoch_bound_and_the_epochs_trained(
        tmp_path, capsys):
    """With validation rows the epoch count is an upper bound under patience: the
    data-sized defaults line says the bound the run trains under (not the count sized
    for a run without validation), and the last line the epochs trained, as
    metrics.json records them."""
    import json

    from terarec.cli.main import main as cli_main

    train, valid = tmp_path / "train.tsv", tmp_path / "valid.tsv"
    generate(train, 2000, model_seed=0, sample_seed=1, vocab_scale=0.01)
    generate(valid, 500, model_seed=0, sample_seed=2, vocab_scale=0.01)
    assert cli_main(["train", "--train", str(train), "--valid", str(valid), "--out",
                     str(tmp_path / "m"), "--model", "lr", "--threads", "1",
                     "--no-refit"]) == 0
    out, err = capsys.readouterr()
    metrics = json.loads((tmp_path / "m" / "metrics.json").read_text())
    banner = next(line for line in err.splitlines() if "data-sized defaults" in line)
    assert f"epochs={metrics['epochs_limit']} at most (patience 2 epochs)" in banner
    assert metrics["epochs_limit"] > 2  # room for patience to stop first
    last = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert last["epochs_trained"] == metrics["epochs_trained"] >= 1
    assert last["epochs_limit"] == metrics["epochs_limit"]
