"""Subcommands that do not run as ranks refuse a torchrun launch of several ranks.

Every rank ran such a command whole: ``export`` wrote one version per rank, ``predict``
printed every score once per rank. The launcher's variables are set in-process here, as
torchrun sets them for each worker; the check needs no process group."""

from __future__ import annotations

from pathlib import Path

import pytest

from terarec.cli.main import main as cli_main
from terarec.data.synth import generate

TRAIN = ["--pass-rows", "1000", "--batch-size", "250", "--embedding-dim", "4",
         "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("launch")
    data = root / "train.tsv"
    generate(data, 1000, model_seed=0, sample_seed=1, vocab_scale=0.01)
    assert cli_main(["train", "--train", str(data), "--out", str(root / "m"), *TRAIN]) == 0
    return root / "m", data


def _as_rank(monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")


@pytest.mark.parametrize("command", ["export", "predict", "eval", "inspect"])
def test_one_process_command_refuses_two_ranks(model, tmp_path, monkeypatch, capsys,
                                               command) -> None:
    path, data = model
    out = tmp_path / "out"
    argv = {"export": ["export", "--model", str(path), "--out", str(out)],
            "predict": ["predict", "--model", str(path), "--data", str(data),
                        "--out", str(out)],
            "eval": ["eval", "--model", str(path), "--data", str(data)],
            "inspect": ["inspect", str(path)]}[command]
    _as_rank(monkeypatch, 2)
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"terarec {command}: error: {command} runs in one process, not as 2 "
                   "torchrun ranks (each would run it whole); run it without torchrun")
    assert not out.exists()  # nothing written


def test_one_process_command_runs_as_a_single_rank(model, tmp_path, monkeypatch) -> None:
    path, _ = model
    _as_rank(monkeypatch, 1)
    assert cli_main(["export", "--model", str(path), "--out", str(tmp_path / "e")]) == 0
    assert (tmp_path / "e" / "LATEST").read_text().strip() == "v000001"
