"""Data flows downward: only the command line (terarec/cli) imports terarec.cli."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "terarec"
# Modules still importing terarec.cli while they are being dissolved; empty this set, never
# grow it.
PENDING: set[str] = set()


def _imports_cli(path: Path, target: str = "terarec.cli") -> list[int]:
    """Line numbers of the statements in ``path`` that import ``target`` (a package)."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(("terarec", *path.relative_to(SRC).parent.parts))
    lines = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the module's package
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        if any(n == target or n.startswith(target + ".") for n in names):
            lines.append(node.lineno)
    return lines


def test_no_package_outside_cli_imports_cli():
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("cli/") or rel == "__main__.py":  # the command line itself
            continue
        lines = _imports_cli(path)
        if lines:
            offenders[rel] = lines
    assert set(offenders) <= PENDING, f"modules importing terarec.cli: {offenders}"
    stale = {p for p in PENDING if p not in offenders}
    assert not stale, f"no longer import terarec.cli, drop them from PENDING: {stale}"


def test_distributed_pieces_do_not_import_the_trainer():
    """distributed/ (topology, sharding, row exchange) sits below train/, which uses it."""
    offenders = {path.name: lines for path in sorted((SRC / "distributed").glob("*.py"))
                 if (lines := _imports_cli(path, "terarec.train"))}
    assert not offenders, f"distributed modules importing terarec.train: {offenders}"


def test_the_input_layer_imports_no_training_or_ranks():
    """data/ (readers, the cut into passes and positions) sits below train/ and
    distributed/: both walk passes with ``data.positions.iter_position_passes``."""
    offenders = {f"{path.name}: {target}": lines
                 for path in sorted((SRC / "data").glob("*.py"))
                 for target in ("terarec.train", "terarec.distributed", "terarec.embedding")
                 if (lines := _imports_cli(path, target))}
    assert not offenders, f"data modules importing upper layers: {offenders}"


def test_the_check_sees_every_import_form(tmp_path, monkeypatch):
    pkg = tmp_path / "terarec" / "serving"
    pkg.mkdir(parents=True)
    forms = ["import terarec.cli.common", "from terarec.cli import common",
             "from terarec import cli", "from ..cli.common import x",
             "def f():\n    from terarec.cli.main import main"]
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path / "terarec")
    for i, form in enumerate(forms):
        path = pkg / f"m{i}.py"
        path.write_text(form + "\n")
        assert _imports_cli(path), form
    ok = pkg / "ok.py"
    ok.write_text("import terarec.config\nfrom terarec.client import x\nfrom . import cli_x\n")
    assert not _imports_cli(ok)


def test_plain_training_does_not_import_the_search():
    """train/ without its search package (the pass loop, checkpoints, the choice by
    validation) trains alone: the search builds on it, never the other way round."""
    train = SRC / "train"
    offenders = {path.relative_to(train).as_posix(): lines
                 for path in sorted(train.rglob("*.py"))
                 if path.relative_to(train).parts[0] != "search"
                 and (lines := _imports_cli(path, "terarec.train.search"))}
    assert not offenders, f"train modules importing terarec.train.search: {offenders}"
