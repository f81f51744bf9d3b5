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

from terarec.train.search.config import SearchConfig
from terarec.train.search.trials import SearchResult, SearchTrial
from terarec.train.search.waves import run_search

__all__ = ["SearchConfig", "SearchResult", "SearchTrial", "run_search"]
