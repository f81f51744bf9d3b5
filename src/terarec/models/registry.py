"""Model names -> classes, so configs pick a model by ``ModelConfig.name``: a built-in
name, or ``package.module:ClassName`` for a ``CTRModel`` subclass of the user's own."""

from __future__ import annotations

import dataclasses
import importlib
import os

import torch

from terarec.config import ModelConfig, is_import_path
from terarec.models.base import CTRModel
from terarec.models.dcn import DCNv2
from terarec.models.din import DIN, SeqPool
from terarec.models.dlrm import DLRM
from terarec.models.dssm import DSSM
from terarec.models.fm import FM, DeepFM
from terarec.models.lr import LR
from terarec.models.multitask import ESMM, MMoE, SharedBottom
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
    "din": DIN,
    "seqpool": SeqPool,
    "sharedbottom": SharedBottom,
    "mmoe": MMoE,
    "esmm": ESMM,
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


# A step's rows and activations: the working set's rows, their optimizer state and
# gradients, the pooled rows, their concatenation into the deep input and its gradient.
_STEP_COPIES = 8
# Dense weights, their gradients and two Adam moments.
_DENSE_COPIES = 4


def dense_param_bytes(schema: FeatureSchema, config: ModelConfig) -> int:
    """Bytes of the dense network's parameters, counted on the meta device (nothing is
    allocated). A DCN's cross layers are all the same size: counted from one and two and
    extrapolated, as building 10^5 layers takes minutes even there."""
    def count(cfg: ModelConfig) -> int:
        with torch.device("meta"):
            model = build_model(schema, cfg)
        return sum(p.numel() * p.element_size() for p in model.parameters())

    layers = config.cross_layers if config.name.lower() == "dcnv2" else 0
    if layers > 2:
        one = count(dataclasses.replace(config, cross_layers=1))
        two = count(dataclasses.replace(config, cross_layers=2))
        return one + (layers - 1) * (two - one)
    return count(config)


def machine_memory(device: torch.device | str = "cpu") -> int | None:
    """Total memory of ``device``: the GPU's, or this machine's RAM (None: unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_model_fits(schema: FeatureSchema, config: ModelConfig, batch_size: int,
                     device: torch.device | str = "cpu") -> None:
    """Refuse, in one line with the bytes it would need, a model whose dense training
    state and one step's rows cannot fit ``device``'s memory: such a run otherwise ends
    in an allocator's traceback, or builds its network for minutes in silence."""
    total = machine_memory(device)
    if total is None:
        return
    row_dim = row_dim_for(config.name, config)
    fields = len(schema.sparse_fields)
    step = _STEP_COPIES * batch_size * max(fields, 1) * row_dim * 4
    # A step too large is known without building anything.
    dense = 0 if step > total else _DENSE_COPIES * dense_param_bytes(schema, config)
    need = dense + step
    if need > total:
        raise ValueError(
            f"model {config.name} (embedding_dim {config.embedding_dim}, cross_layers "
            f"{config.cross_layers}, row_dim {row_dim}) needs about {_human(need)} "
            f"({need} bytes: {dense} for its dense weights, gradients and optimizer state, "
            f"{step} for one step's rows of {batch_size} x {fields} fields); "
            f"{'this GPU' if torch.device(device).type == 'cuda' else 'this machine'} "
            f"has {_human(total)}")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError
