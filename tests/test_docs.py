"""Every Python example in README.md and docs/ runs as written.

Each ```python block runs as a script in a folder holding `data/train.tsv` and
`data/valid.tsv` (small synthetic Criteo logs, as `terarec synth` writes them). Blocks
that talk to a server (`localhost:8080`, `http://10.0.0.N:8080` in the text) are pointed
at a real `terarec serve` started here on a model trained from the same data."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import terarec
from terarec.data.synth import generate
from terarec.loopback import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SERVER_TEXT = re.compile(r"localhost\", 8080|http://10\.0\.0\.\d+:8080")


def _blocks() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            line = text[:match.start()].count("\n") + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", match.group(1)))
    return found


BLOCKS = _blocks()


def _env() -> dict[str, str]:
    src = str(ROOT / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [src, *filter(None, [os.environ.get("PYTHONPATH")])])}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("docs")
    (root / "data").mkdir()
    generate(root / "data" / "train.tsv", 3000, model_seed=0, sample_seed=1,
             vocab_scale=0.01)
    generate(root / "data" / "valid.tsv", 800, model_seed=0, sample_seed=2,
             vocab_scale=0.01)
    return root


@pytest.fixture(scope="module")
def server(workdir) -> Iterator[int]:
    """A `terarec serve` on a small model of the docs' data; its port."""
    model = terarec.fit(workdir / "data" / "train.tsv", out=workdir / "served-model",
                        model="lr", epochs=1, progress=False)
    model.export(str(workdir / "served"))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "terarec", "serve", str(workdir / "served"), "--port",
         str(port), "--threads", "1"], env=_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, proc=proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_docs_hold_python_examples():
    where = {name.split(":")[0] for name, _ in BLOCKS}
    assert {"README.md", "docs/api.md", "docs/search.md"} <= where


@pytest.mark.parametrize("code", [code for _, code in BLOCKS],
                         ids=[name for name, _ in BLOCKS])
def test_example_runs(code, workdir, request, tmp_path):
    if SERVER_TEXT.search(code):
        port = request.getfixturevalue("server")
        code = re.sub(r"http://10\.0\.0\.\d+:8080", f"http://127.0.0.1:{port}", code)
        code = code.replace('"localhost", 8080', f'"127.0.0.1", {port}')
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=workdir, env=_env(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
