"""The package type-checks: ``mypy src`` with the settings in pyproject.toml reports no
error (the README's test command runs it, so CI does)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy not installed")
def test_mypy_reports_no_errors() -> None:
    done = subprocess.run([sys.executable, "-m", "mypy", "src"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
