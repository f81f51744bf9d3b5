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


def test_the_model_directory_format_sits_below_what_reads_it():
    """modeldir/ (the on-disk model directory) is read by training, export, serving and
    the command line, so it imports none of them."""
    above = ("terarec.train", "terarec.distributed", "terarec.export", "terarec.serving",
             "terarec.retrieval", "terarec.sparsetier", "terarec.api", "terarec.cli")
    offenders = {f"{path.name}: {target}": lines
                 for path in sorted((SRC / "modeldir").glob("*.py"))
                 for target in above if (lines := _imports_cli(path, target))}
    assert not offenders, f"modeldir modules importing upper layers: {offenders}"


def test_export_and_retrieval_read_model_directories_without_the_trainer():
    offenders = {path.relative_to(SRC).as_posix(): lines
                 for folder in ("export", "retrieval")
                 for path in sorted((SRC / folder).glob("*.py"))
                 if (lines := _imports_cli(path, "terarec.train"))}
    assert not offenders, f"modules importing terarec.train: {offenders}"


def test_the_store_protocol_imports_no_store():
    """The interface sits above its implementations: protocol.py names its values from
    embedding/types.py and no store module (memory, tiered, shared, device, disk)."""
    allowed = {"terarec.embedding.types", "terarec.embedding.optimizers"}
    path = SRC / "embedding" / "protocol.py"
    imported = {".".join(name.split(".")[:3]) for name, _ in _module_imports(path)
                if name.startswith("terarec.embedding.")}
    assert imported <= allowed, f"protocol.py imports {sorted(imported - allowed)}"


def _module_imports(path: Path) -> list[tuple[str, int]]:
    """(module, line) for each terarec module ``path`` imports when it runs, at import or
    at call time (``if TYPE_CHECKING:`` blocks never run): for ``from m import n`` both
    ``m`` and ``m.n`` (``n`` may be a submodule)."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(("terarec", *path.relative_to(SRC).parent.parts))
    type_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and getattr(block.test, "id", getattr(block.test, "attr", None))
                 == "TYPE_CHECKING" for stmt in block.body for node in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found += [(base, node.lineno)]
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return [(name, line) for name, line in found if name.startswith("terarec")]


def import_cycle(package: str) -> list[str] | None:
    """A cycle of imports (``_module_imports``) among the modules of ``package`` (each
    module once, the first repeated at the end), or None when the graph is acyclic. An
    import inside a function closes a cycle as surely as one at the top: it only moves
    the failure to call time."""
    folder = SRC.joinpath(*package.split(".")[1:])
    modules = {(f"{package}.{p.stem}" if p.stem != "__init__" else package): p
               for p in sorted(folder.glob("*.py"))}
    graph = {name: sorted({m for m, _ in _module_imports(path) if m in modules and m != name})
             for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> list[str] | None:
        if name in stack:
            return stack[stack.index(name):] + [name]
        if name in done:
            return None
        for other in graph[name]:
            if (cycle := visit(other, [*stack, name])) is not None:
                return cycle
        done.add(name)
        return None

    for name in graph:
        if (cycle := visit(name, [])) is not None:
            return cycle
    return None


def test_the_training_modules_import_each_other_one_way():
    """Inside train/ (trainer, pass loop, search, run) each import runs one way: a helper
    two modules share lives in the lower one, never imported back from the higher."""
    cycle = import_cycle("terarec.train")
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "terarec" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from terarec.demo.b import x\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from terarec.demo.a import y\n"
                              "def f():\n    from terarec.demo import a\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path / "terarec")
    assert import_cycle("terarec.demo") == ["terarec.demo.a", "terarec.demo.b",
                                            "terarec.demo.a"]  # at call time
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from terarec.demo.a import y\n")
    assert import_cycle("terarec.demo") is None  # type-only imports never run
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "b.py").write_text("import terarec.demo.c\n")
    assert import_cycle("terarec.demo") == ["terarec.demo.a", "terarec.demo.b",
                                            "terarec.demo.c", "terarec.demo.a"]


def test_only_the_command_line_imports_the_public_api():
    """api/ (fit, load, search and the recipes they run) sits above every stage and below
    cli/: no stage calls back up into it."""
    offenders = {path.relative_to(SRC).as_posix(): lines
                 for path in sorted(SRC.rglob("*.py"))
                 if path.relative_to(SRC).parts[0] not in ("api", "cli")
                 and path.relative_to(SRC).as_posix() != "__init__.py"
                 and (lines := _imports_cli(path, "terarec.api"))}
    assert not offenders, f"modules importing terarec.api: {offenders}"


def test_the_command_line_runs_no_training_recipe_of_its_own():
    """train and search are recipes of api/; their commands only parse flags, so they
    import neither the pass loop's driver nor the search's waves."""
    recipes = ("terarec.train.run", "terarec.train.search.waves", "terarec.train.choose")
    offenders = {f"{path.name}: {target}": lines
                 for path in sorted((SRC / "cli").glob("*.py"))
                 for target in recipes if (lines := _imports_cli(path, target))}
    assert not offenders, f"cli modules running recipes themselves: {offenders}"


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


def test_serving_modules_share_only_public_names():
    """A serving module uses another's public names only: what one module keeps
    private can change without breaking its neighbours."""
    _, private = _serving_graph(SRC)
    assert not private, f"private names imported across serving modules: {private}"


def test_serving_has_no_import_cycle():
    """serving/ modules import each other in one direction (a call-time import too),
    so each can be read, tested and split on its own."""
    cycle = import_cycle("terarec.serving")
    assert cycle is None, "import cycle in terarec/serving: " + " -> ".join(cycle or [])


def test_the_serving_check_sees_private_names(tmp_path):
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
    (pkg / "c.py").write_text("x = 1\n")
    assert "terarec.serving.c" not in _serving_graph(tmp_path / "terarec")[1]


_PLAN_TYPES = {"PassPlan", "ShardedPassPlan", "RankPassPlan"}


def _names(node: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, ast.Name | ast.Attribute)}


def _union_members(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union_members(node.left) + _union_members(node.right)
    return [node]


def _pass_type_forks(root: Path) -> list[str]:
    """Where train/ tells plans apart: an ``isinstance`` naming a plan type, or an
    annotation that is a union of a plan type with anything but None."""
    found = []
    for path in sorted((root / "train").rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = f"{path.relative_to(root)}:"
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "isinstance" and len(node.args) == 2 \
                    and _names(node.args[1]) & _PLAN_TYPES:
                found.append(f"{where}{node.lineno} isinstance")
            annotations = []
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                annotations = [a.annotation for a in args if a.annotation is not None]
                if node.returns is not None:
                    annotations.append(node.returns)
            elif isinstance(node, ast.AnnAssign):
                annotations = [node.annotation]
            for annotation in annotations:
                for inner in ast.walk(annotation):
                    members = _union_members(inner)
                    if len(members) < 2 or not any(_names(m) & _PLAN_TYPES for m in members):
                        continue
                    if any(not (isinstance(m, ast.Constant) and m.value is None)
                           and not _names(m) & _PLAN_TYPES for m in members) \
                            or sum(bool(_names(m) & _PLAN_TYPES) for m in members) > 1:
                        found.append(f"{where}{inner.lineno} union")
                        break
    return found


def test_training_takes_one_pass_type():
    """train/ takes one ``Pass`` at any world size: no union of batch lists and plan
    types in a signature, no ``isinstance`` telling a local plan from a rank's."""
    assert not _pass_type_forks(SRC), _pass_type_forks(SRC)


def test_the_pass_type_check_sees_forks(tmp_path):
    train = tmp_path / "train"
    train.mkdir()
    (train / "a.py").write_text(
        "def f(p: list[Batch] | PassPlan, q: Pass | None = None) -> None:\n"
        "    if isinstance(p, (lookup.ShardedPassPlan, list)):\n        pass\n"
        "x: RankPassPlan | ShardedPassPlan\ny: PassPlan | None = None\n")
    assert sorted(_pass_type_forks(tmp_path)) == [
        "train/a.py:1 union", "train/a.py:2 isinstance", "train/a.py:4 union"]
