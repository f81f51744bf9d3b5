"""CTR models as pure ``nn.Module``s over dense features and a batch's embedding rows.

Pick one by name with ``build_model(schema, config)``; size the store first with
``row_dim_for(config.name, config)``.
"""

from terarec.models.base import CTRModel
from terarec.models.dcn import DCNv2
from terarec.models.dlrm import DLRM
from terarec.models.dssm import DSSM
from terarec.models.fm import FM, DeepFM
from terarec.models.lr import LR
from terarec.models.registry import MODELS, build_model, model_class, row_dim_for
from terarec.models.wide_deep import WideDeep

__all__ = [
    "CTRModel", "DCNv2", "DLRM", "DSSM", "DeepFM", "FM", "LR", "MODELS", "WideDeep",
    "build_model", "model_class", "row_dim_for",
]
