"""The search's study through optuna's public API: its journal is optuna's file format,
and a grid trial interrupted before it drew its values is asked again at its point."""

from __future__ import annotations

import json

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

from terarec.config import TrainConfig, to_dict
from terarec.train.search.space import suggest
from terarec.train.search.study import STUDY_FILE, _ask_again, _journal, open_study

SPACE = {"model.embedding_dim": {"type": "categorical", "choices": [4, 8, 16]},
         "batch_size": {"type": "categorical", "choices": [256, 512]}}


def _settings(sampler: str = "grid") -> dict:
    return {"space": SPACE, "sampler": sampler, "pruner": "none", "select_by": "logloss",
            "patience": 2, "seed": 7, "config": to_dict(TrainConfig())}


def test_the_journal_reads_what_optunas_file_backend_wrote(tmp_path):
    """A journal written by optuna's own file backend (a search of an earlier version)
    reads back the same trials, and a last line cut short by a kill is not a record."""
    path = tmp_path / STUDY_FILE
    backend = JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path)))
    study = optuna.create_study(storage=JournalStorage(backend), study_name="search")
    for value in (0.5, 0.4):
        trial = study.ask()
        trial.suggest_float("x", 0.0, 1.0)
        study.tell(trial, value)
    with open(path, "ab") as fh:
        fh.write(b'{"op_code": 4, "worker_id"')  # a record cut short
    ours = optuna.load_study(storage=JournalStorage(_journal(path)), study_name="search")
    assert [(t.number, t.params, t.value) for t in ours.trials] == \
        [(t.number, t.params, t.value) for t in study.trials]


def test_a_grid_trial_cut_before_it_drew_is_asked_again_at_its_point(tmp_path):
    """Killed between ask and suggest: the trial asked again draws its grid point, the
    values the uninterrupted search's trial drew."""
    (tmp_path / "a").mkdir()
    uninterrupted = open_study(tmp_path / "a", _settings(), resume=False)
    expected = suggest(uninterrupted.study.ask(), SPACE)

    (tmp_path / "b").mkdir()
    cut = open_study(tmp_path / "b", _settings(), resume=False)
    cut.study.ask()  # no values drawn
    frozen = cut.study.trials[0]
    cut.study.tell(0, state=optuna.trial.TrialState.FAIL)
    _ask_again(cut, frozen)
    again = cut.study.ask()
    assert again.number == 1
    assert suggest(again, SPACE) == expected
    assert cut.study.trials[1].system_attrs["grid_id"] == frozen.system_attrs["grid_id"]


def test_a_trial_of_another_sampler_is_asked_again_with_its_values(tmp_path):
    journaled = open_study(tmp_path, _settings("random"), resume=False)
    first = journaled.study.ask()
    values = suggest(first, SPACE)
    journaled.study.tell(first.number, state=optuna.trial.TrialState.FAIL)
    _ask_again(journaled, journaled.study.trials[0])
    assert suggest(journaled.study.ask(), SPACE) == values


def test_a_resume_needs_the_settings_the_search_started_with(tmp_path):
    open_study(tmp_path, _settings(), resume=False)
    assert json.loads((tmp_path / "search.json").read_text())["seed"] == 7
    with pytest.raises(ValueError, match="different seed"):
        open_study(tmp_path, {**_settings(), "seed": 8}, resume=True)
