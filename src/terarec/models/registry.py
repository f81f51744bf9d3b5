"""Model names -> classes, so configs pick a model by ``ModelConfig.name``."""

from __future__ import annotations

from terarec.config import ModelConfig
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


def model_class(name: str) -> type[CTRModel]:
    """The class registered as ``name`` (case-insensitive)."""
    cls = MODELS.get(name.lower())
    if cls is None:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return cls


def row_dim_for(name: str, config: ModelConfig) -> int:
    """Floats per key that model ``name`` needs with ``config``, before building it."""
    return model_class(name).row_dim_for(config)


def build_model(schema: FeatureSchema, config: ModelConfig) -> CTRModel:
    """The model ``config.name`` for ``schema``."""
    return model_class(config.name)(schema, config)
