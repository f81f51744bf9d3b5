"""Hyper-parameter search: K trials trained side by side in one pass loop.

A trial is exactly ``terarec train`` with its values as flags and the base seed: same
initial weights, same batches, same random stream (``train.loop``). The trials of a wave
share one key index (``embedding.shared``), each keeping only its rows and optimizer
state; with a memory budget (tiered store) each trial keeps its own store and the budget
is split across the live trials, and re-split when trials are pruned (``train.cohort``).

The package, by job:

- ``config``: ``SearchConfig``, the search's settings, checked when made;
- ``space``: search spaces, read and checked against the config they modify;
- ``samplers``: optuna's samplers and pruners by name;
- ``waves``: ``run_search``, the waves of trials and their pass boundaries;
- ``trials``: a trial's state, the best pass so far and the checkpoint commits;
- ``study``: the study journaled in the search directory, and the resume;
- ``results``: the files a search writes (best model, results table, report).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Imported on first use: the command line's parser reads ``samplers``' names without
# loading the pass loop.
_EXPORTS = {"SearchConfig": "config", "SearchResult": "trials", "SearchTrial": "trials",
            "run_search": "waves"}
__all__ = ["SearchConfig", "SearchResult", "SearchTrial", "run_search"]

if TYPE_CHECKING:
    from terarec.train.search.config import SearchConfig
    from terarec.train.search.trials import SearchResult, SearchTrial
    from terarec.train.search.waves import run_search


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'terarec.train.search' has no attribute {name!r}")
    return getattr(importlib.import_module(f"terarec.train.search.{module}"), name)
