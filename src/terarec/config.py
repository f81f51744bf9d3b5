"""Typed configuration. Unknown keys are errors, so a typo never silently does nothing."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

SparseOptimizerName = Literal["adagrad", "adam", "ftrl", "sgd"]
T = TypeVar("T")


@dataclass
class ModelConfig:
    """Network shape. ``embedding_dim`` is the width of one key's deep embedding."""

    name: str = "deepfm"
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64, 16)
    top_mlp: tuple[int, ...] = (512, 256)
    deep_mlp: tuple[int, ...] = (256, 128)
    cross_layers: int = 3
    cross_rank: int = 0  # DCN-v2: 0 = full-rank cross weights, r > 0 = low-rank U V^T
    dropout: float = 0.0  # after every hidden layer of the MLPs
    batch_norm: bool = False  # BatchNorm1d before every hidden activation of the MLPs
    # Two-tower (DSSM) split: ``item_fields`` empty means every categorical field that is
    # not a user field. Both towers use ``deep_mlp``; its last width is the vector size.
    user_fields: tuple[str, ...] = ()
    item_fields: tuple[str, ...] = ()
    tower_similarity: Literal["cosine", "dot"] = "cosine"
    cosine_scale: float = 10.0


@dataclass
class SparseOptimizerConfig:
    """Per-key optimizer, applied to a pass's working set inside the backward pass."""

    name: SparseOptimizerName = "adagrad"
    lr: float = 0.05
    eps: float = 1e-8
    initial_accumulator: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    ftrl_alpha: float = 0.05
    ftrl_beta: float = 1.0
    ftrl_l1: float = 0.0
    ftrl_l2: float = 0.0
    weight_decay: float = 0.0
    # L2 on the embeddings a batch looks up (BARS's embedding_regularizer), per occurrence
    # and relative to the batch size: see terarec.embedding.optimizers.
    embedding_l2: float = 0.0
    # Group lasso: after each update a row shrinks by ``step * group_lasso`` in L2 norm
    # (to exactly zero when shorter); zero rows are pruned from the store at pass end.
    group_lasso: float = 0.0


@dataclass
class DenseOptimizerConfig:
    name: Literal["adam", "adagrad", "sgd"] = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0


@dataclass
class StoreConfig:
    """Embedding store policies: admission by count, eviction by age, row initialisation.

    ``memory_budget`` (bytes, or a size such as "512MB" / "2GB", powers of 1024) or
    ``disk_path`` selects the tiered store: hot rows in RAM under the budget, every row
    in slab files under ``disk_path`` (a temporary folder when unset). ``cache_policy``
    picks which rows stay in RAM: "lfu" (highest show count) or "lru" (latest use).
    """

    admit_min_count: int = 1
    evict_after_passes: int | None = None
    init_std: float = 0.01
    memory_budget: int | str | None = None
    disk_path: str | None = None
    cache_policy: Literal["lfu", "lru"] = "lfu"
    # Compression (docs/compression.md). ``precision`` is how row values are kept (the
    # optimizer state stays fp32); ``variable_dims`` are the widths of the rarer frequency
    # classes below the full row, ``promote_at`` the show counts that move a key up a class,
    # ``class_precisions`` optionally one precision per class (rarest first, full row last).
    precision: Literal["fp32", "fp16", "int8", "int4"] = "fp32"
    stochastic_rounding: bool = False
    variable_dims: tuple[int, ...] = ()
    promote_at: tuple[float, ...] = ()
    class_precisions: tuple[str, ...] = ()

    @property
    def tiered(self) -> bool:
        return self.memory_budget is not None or self.disk_path is not None


_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
               "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30,
               "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_bytes(size: int | str) -> int:
    """``2GB`` -> 2 * 2**30. Units B, KB, MB, GB, TB (and KiB ... TiB), powers of 1024:
    memory budgets are about RAM, which comes in binary sizes."""
    if isinstance(size, int) and not isinstance(size, bool):
        value, unit = float(size), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
        if m is None or m.group(2).upper() not in _SIZE_UNITS:
            raise ValueError(f"size {size!r}: expected a number with an optional unit "
                             f"(B, KB, MB, GB, TB), e.g. 512MB")
        value, unit = float(m.group(1)), m.group(2).upper()
    out = int(value * _SIZE_UNITS[unit])
    if out <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return out


@dataclass
class TrainConfig:
    batch_size: int = 4096
    pass_rows: int = 200_000
    epochs: int = 1
    seed: int = 0
    threads: int | None = None
    device: str = "auto"
    on_bad_row: Literal["error", "skip"] = "error"
    model: ModelConfig = field(default_factory=ModelConfig)
    sparse_optimizer: SparseOptimizerConfig = field(default_factory=SparseOptimizerConfig)
    dense_optimizer: DenseOptimizerConfig = field(default_factory=DenseOptimizerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, recursing into nested config dataclasses and
    rejecting keys the dataclass does not declare."""
    if not isinstance(data, dict):
        raise TypeError(f"config{where or ''}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"config{where}: unknown keys {unknown}; known: {sorted(names)}")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            kwargs[key] = from_dict(hint, value, f"{where}.{key}")
        elif typing.get_origin(hint) is tuple and isinstance(value, list):
            kwargs[key] = tuple(value)
        else:
            kwargs[key] = value
    return cls(**kwargs)


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def load_train_config(path: str | Path) -> TrainConfig:
    with open(path) as fh:
        return from_dict(TrainConfig, json.load(fh))
