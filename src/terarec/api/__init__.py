"""The public Python calls: ``fit``, ``load`` -> ``Model``, ``search``, and the recipes
the command line runs (``training.run_training``, ``search.run_search_job``)."""

from terarec.api.fit import fit
from terarec.api.model import Model, load
from terarec.api.search import SearchOutcome, search

__all__ = ["Model", "SearchOutcome", "fit", "load", "search"]
