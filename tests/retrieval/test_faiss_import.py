"""faiss imported for an index logs nothing at INFO (its loader's lines about CPU builds a
wheel lacks carried ``ModuleNotFoundError`` and read as failures); faiss missing is one
clear line from the commands that need it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from terarec.cli.main import main

pytest.importorskip("faiss")
SRC = Path(__file__).resolve().parents[2] / "src"


def _import_at(level: str) -> str:
    code = (f"import logging; logging.basicConfig(level=logging.{level}); "
            "import terarec.retrieval.index, terarec.serving.retrieve")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_the_faiss_loader_says_nothing_at_info():
    err = _import_at("INFO")
    assert "faiss" not in err and "ModuleNotFoundError" not in err, err


def test_the_faiss_loader_lines_are_debug_events():
    err = _import_at("DEBUG")
    assert "DEBUG:faiss.loader:" in err and "INFO:faiss.loader" not in err, err


@pytest.mark.parametrize("argv", [["index", "EXPORT", "--items", "items.tsv", "--out", "idx"],
                                  ["serve", "EXPORT", "--index", "idx"]])
def test_faiss_missing_is_one_line_where_an_index_is_asked_for(argv, tmp_path, monkeypatch,
                                                              capsys):
    import numpy as np

    from terarec.config import ModelConfig
    from terarec.export import ModelExporter
    from terarec.models import build_model
    from terarec.types import FeatureSchema

    schema, config = FeatureSchema.criteo(), ModelConfig(name="lr")
    model = build_model(schema, config)
    ModelExporter(tmp_path / "export").write_full(
        schema=schema, model_config=config, dense=model.state_dict(),
        keys=np.arange(1, 5, dtype=np.int64),
        values=np.zeros((4, model.row_dim), np.float32), pass_id=1)
    (tmp_path / "items.tsv").write_text("item\n1\n")
    monkeypatch.chdir(tmp_path)
    argv = [str(tmp_path / "export") if a == "EXPORT" else a for a in argv]
    monkeypatch.setitem(sys.modules, "faiss", None)  # `import faiss` raises ImportError
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs faiss" in err[0] and "pip install faiss-cpu" in err[0]
