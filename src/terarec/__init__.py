"""terarec: train and serve CTR models whose sparse embedding tables outgrow one machine.

``terarec.fit(train, valid, out=...)`` trains and returns a ``Model``;
``terarec.load(dir)`` opens one; ``Model.predict`` / ``evaluate`` / ``export`` score
and ship it. Subclass ``terarec.CTRModel`` to train a network of your own. Names are
imported on first use, so ``import terarec`` (and the command line's ``--help``) stays
fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "fit": "terarec.api.fit",
    "load": "terarec.api.model",
    "Model": "terarec.api.model",
    "search": "terarec.api.search",
    "SearchOutcome": "terarec.api.search",
    "CTRModel": "terarec.models.base",
    "TrainConfig": "terarec.config",
    "ModelConfig": "terarec.config",
    "DataSpec": "terarec.data.spec",
    "ExportSchedule": "terarec.api.training",
    "Batch": "terarec.types",
    "FeatureSchema": "terarec.types",
    "FieldSpec": "terarec.types",
    "KeyedIds": "terarec.types",
}

__all__ = ["Batch", "CTRModel", "DataSpec", "ExportSchedule", "FeatureSchema", "FieldSpec",
           "KeyedIds", "Model", "ModelConfig", "SearchOutcome", "TrainConfig", "fit", "load",
           "search"]

if TYPE_CHECKING:
    from terarec.api.fit import fit
    from terarec.api.model import Model, load
    from terarec.api.search import SearchOutcome, search
    from terarec.api.training import ExportSchedule
    from terarec.config import ModelConfig, TrainConfig
    from terarec.data.spec import DataSpec
    from terarec.models.base import CTRModel
    from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'terarec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
