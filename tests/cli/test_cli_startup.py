"""``terarec --help`` and ``terarec CMD --help`` import no heavy stack: the listing comes
from ``SUBCOMMANDS``, and a subcommand's module imports what its ``run`` needs inside it.
Checked on the modules imported (in a fresh interpreter), not on time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from terarec.cli.main import SUBCOMMANDS, build_parser

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numba", "duckdb", "pyarrow", "optuna", "fastapi", "matplotlib",
         "sklearn", "uvicorn")
# Subcommands whose parser still needs heavy modules (cli.common, the training flags):
# empty this set, never grow it.
PENDING = {"autofeature"}

_PROBE = """
import contextlib, io, json, sys
from terarec.cli.main import main
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    main(sys.argv[1:])
print(json.dumps({"help": out.getvalue(), "modules": sorted(sys.modules)}))
"""


def _help(*argv: str) -> tuple[str, set[str]]:
    """What ``terarec ARGV`` printed and the modules it had imported."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    answer = json.loads(done.stdout)
    return answer["help"], set(answer["modules"])


def _heavy(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules} & set(HEAVY)


def test_the_listing_imports_no_subcommand() -> None:
    shown, modules = _help("--help")
    for name, summary in SUBCOMMANDS.items():
        assert name in shown and summary in shown
    assert {m for m in modules if m.startswith("terarec.cli.")} == {"terarec.cli.main"}
    assert not _heavy(modules), sorted(_heavy(modules))


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_a_subcommands_help_imports_nothing_heavy(name: str) -> None:
    shown, modules = _help(name, "--help")
    assert shown.startswith(f"usage: terarec {name}")
    heavy = _heavy(modules)
    if name in PENDING:
        assert heavy, f"terarec {name} --help is light now: drop it from PENDING"
    else:
        assert not heavy, f"terarec {name} --help imported {sorted(heavy)}"


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_each_summary_is_the_one_its_module_registers(name: str) -> None:
    """The listing's summaries (``SUBCOMMANDS``) and the subcommands' own agree."""
    parser = build_parser(name)
    sub = next(a for a in parser._actions if a.dest == "command")
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    assert helps[name] == SUBCOMMANDS[name]
