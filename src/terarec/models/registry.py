"""Model names -> classes, so configs pick a model by ``ModelConfig.name``: a built-in
name, or ``package.module:ClassName`` for a ``CTRModel`` subclass of the user's own."""

from __future__ import annotations

import importlib

from terarec.config import ModelConfig, is_import_path
from terarec.models.base import CTRModel
from terarec.models.dcn import DCNv2
from terarec.models.dlrm import DLRM
from terarec.models.dssm import DSSM
from terarec.models.fm import FM, DeepFM
from terarec.models.lr import LR
from terarec.models.wide_deep import WideDeep
from terarec.types import FeatureSchema

MODELS: dict[str, type[CTRModel]] = {
    "lr": LR,
    "fm": FM,
    "widedeep": WideDeep,
    "deepfm": DeepFM,
    "dcnv2": DCNv2,
    "dlrm": DLRM,
    "dssm": DSSM,
}


def import_path(cls: type[CTRModel]) -> str:
    """The name a config records for a user's model class: ``module:QualName``."""
    if not (isinstance(cls, type) and issubclass(cls, CTRModel)):
        raise TypeError(f"model {cls!r}: a model class must subclass terarec.CTRModel")
    if "<locals>" in cls.__qualname__:
        raise TypeError(f"model {cls.__qualname__}: define the class at module level, so "
                        "ranks, resumed runs and the server can import it by name")
    return f"{cls.__module__}:{cls.__qualname__}"


def model_class(name: str) -> type[CTRModel]:
    """The class registered as ``name`` (case-insensitive), or the user's class that the
    import path ``package.module:ClassName`` names."""
    if is_import_path(name):
        return _imported(name)
    cls = MODELS.get(name.lower())
    if cls is None:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}, or a "
                         "class of your own as 'package.module:ClassName'")
    return cls


def _imported(path: str) -> type[CTRModel]:
    module_name, _, qualname = path.partition(":")
    try:
        found: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"model {path!r}: cannot import module {module_name!r} ({exc}); "
                         "put it on PYTHONPATH (or install it) where the model is trained, "
                         "resumed and served") from None
    for part in qualname.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise ValueError(f"model {path!r}: module {module_name!r} has no {qualname!r}")
    if not (isinstance(found, type) and issubclass(found, CTRModel)):
        raise ValueError(f"model {path!r} is not a terarec.CTRModel subclass")
    return found


def row_dim_for(name: str, config: ModelConfig) -> int:
    """Floats per key that model ``name`` needs with ``config``, before building it."""
    return model_class(name).row_dim_for(config)


def build_model(schema: FeatureSchema, config: ModelConfig) -> CTRModel:
    """The model ``config.name`` for ``schema``."""
    return model_class(config.name)(schema, config)
