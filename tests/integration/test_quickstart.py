"""``terarec quickstart``: the README's first command, on fewer rows."""

from __future__ import annotations

import json

import pytest

from terarec.cli.main import main


@pytest.mark.slow
def test_quickstart_trains_with_the_train_command_and_runs_again(tmp_path, capsys):
    """quickstart built its own config (one pass of 100,000 rows, no validation-driven
    training): on 20,000 rows it reached AUC 0.565 where `train`'s defaults reach 0.70."""
    work = tmp_path / "qs"
    argv = ["quickstart", "--workdir", str(work), "--no-progress"]
    assert main([*argv, "--rows", "20000", "--valid-rows", "5000"]) == 0
    out = capsys.readouterr().out
    metrics = json.loads((work / "model" / "metrics.json").read_text())
    assert f"AUC {metrics['auc']:.4f} (ceiling " in out
    assert metrics["auc"] > 0.67 and metrics["best_pass"] >= 1
    assert "refit" not in metrics  # the validation rows stay held out
    assert (work / "model" / "report" / "report.html").is_file()
    assert (work / "model" / "history.json").is_file()

    # again in the same folder (fewer rows, to keep it short): a fresh model, not a
    # refused --out, scored on the new validation rows
    assert main([*argv, "--rows", "4000", "--valid-rows", "1000"]) == 0
    out = capsys.readouterr().out
    again = json.loads((work / "model" / "metrics.json").read_text())
    assert again["eval_rows"] == 1000 and metrics["eval_rows"] == 5000
    assert f"AUC {again['auc']:.4f} (ceiling " in out
    assert (work / "model" / "report" / "report.html").is_file()
