"""Data flows downward: only the command line (terarec/cli) imports terarec.cli; inside
terarec/serving, modules share public names only and import each other without a cycle."""

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


SERVING = "terarec.serving"


def _module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(("terarec", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _serving_imports(path: Path, src: Path, modules: set[str]
                     ) -> tuple[set[str], list[str]]:
    """The serving modules ``path`` imports (at any depth: a call-time import is an
    edge too) and the private names it takes from them, as ``module.name``, imported or
    read as an attribute of an imported module."""
    tree = ast.parse(path.read_text(), str(path))
    me = _module_name(path, src)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    edges: set[str] = set()
    private: list[str] = []
    bound: dict[str, str] = {}  # local name -> the serving module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    edges.add(alias.name)
                    if alias.asname:
                        bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in modules:  # from terarec.serving import binary
                    edges.add(target)
                    bound[alias.asname or alias.name] = target
                    if alias.name.startswith("_"):
                        private.append(target)
                elif base in modules:
                    edges.add(base)
                    if alias.name.startswith("_") and base != me:
                        private.append(target)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in bound and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            private.append(f"{bound[node.value.id]}.{node.attr}")
    edges.discard(me)
    return edges, private


def _serving_graph(src: Path) -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    paths = sorted((src / "serving").rglob("*.py"))
    modules = {_module_name(p, src) for p in paths}
    graph, private = {}, {}
    for path in paths:
        edges, names = _serving_imports(path, src, modules)
        graph[_module_name(path, src)] = edges - {SERVING}  # the package's empty __init__
        if names:
            private[_module_name(path, src)] = names
    return graph, private


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_serving_modules_share_only_public_names():
    """A serving module uses another's public names only: what one module keeps
    private can change without breaking its neighbours."""
    _, private = _serving_graph(SRC)
    assert not private, f"private names imported across serving modules: {private}"


def test_serving_has_no_import_cycle():
    """serving/ modules import each other in one direction (a call-time import too),
    so each can be read, tested and split on its own."""
    graph, _ = _serving_graph(SRC)
    cycle = _cycle(graph)
    assert cycle is None, "import cycle in terarec/serving: " + " -> ".join(cycle or [])


def test_the_serving_checks_see_private_names_and_cycles(tmp_path):
    pkg = tmp_path / "terarec" / "serving"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from terarec.serving.b import _hidden\n_mine = 1\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n    return c._x\n_hidden = 1\n")
    (pkg / "c.py").write_text("import terarec.serving.a as a\nfrom .a import _mine\n")
    graph, private = _serving_graph(tmp_path / "terarec")
    assert private == {"terarec.serving.a": ["terarec.serving.b._hidden"],
                       "terarec.serving.b": ["terarec.serving.c._x"],
                       "terarec.serving.c": ["terarec.serving.a._mine"]}
    assert _cycle(graph) is not None
    (pkg / "c.py").write_text("x = 1\n")
    graph, _ = _serving_graph(tmp_path / "terarec")
    assert _cycle(graph) is None
