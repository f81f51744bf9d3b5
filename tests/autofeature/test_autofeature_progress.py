"""DuckDB's progress bar is drawn only on a terminal: redirected to a log it was one
line of tens of kB (DuckDB redraws it in place on standard output)."""

from __future__ import annotations

import sys

import pytest

from terarec.autofeature import AutoFeatureEngine
from terarec.autofeature.engine import default_engine


def _bar_enabled(engine: AutoFeatureEngine) -> bool:
    con = engine.cursor()
    try:
        return bool(con.execute("select current_setting('enable_progress_bar')").fetchone()[0])
    finally:
        con.close()


@pytest.mark.parametrize("tty, progress, drawn", [(False, True, False), (True, True, True),
                                                  (True, False, False)])
def test_the_bar_only_on_a_terminal_and_when_asked(monkeypatch, tty, progress, drawn):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty, raising=False)
    with AutoFeatureEngine(progress=progress) as engine:
        assert _bar_enabled(engine) is drawn


def test_the_library_engine_draws_no_bar_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    with AutoFeatureEngine() as engine:
        assert not _bar_enabled(engine)
    assert not _bar_enabled(default_engine())
