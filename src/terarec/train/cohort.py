"""Models trained side by side in one pass loop (``train.loop.run_passes``): a cohort.

Each member is the base configuration with a few dotted values set (``apply_params``),
built right after the one before so that it seeds torch itself: its weights are those of
the same configuration trained alone. The members share one key index where their
stores admit and evict alike (``KeySides``) and split a memory budget between them
(``member_config``, ``split_budget``); a member that trains no more gives its rows back
(``free_rows``). A search's waves and ``train``'s choice by validation are cohorts.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from terarec.config import TrainConfig, from_dict, to_dict
from terarec.embedding.shared import (
    SharedKeys,
    SharedRowsStore,
    key_side_config,
    sharing_refusal,
)
from terarec.embedding.tiered import TieredStore
from terarec.train.trainer import Trainer, make_store


def apply_params(base: TrainConfig, params: Mapping[str, Any]) -> TrainConfig:
    """``base`` with each dotted path set to its value (checked like a config file)."""
    data = to_dict(base)
    for name, value in params.items():
        node = data
        *parents, leaf = name.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = list(value) if isinstance(value, tuple) else value
    config = from_dict(TrainConfig, data)
    if "model.embedding_dim" in params and "model.bottom_mlp" not in params:
        # dlrm's bottom MLP ends at base's width: a width from the space moves it along
        bottom = base.model.with_embedding_dim(config.model.embedding_dim).bottom_mlp
        config = replace(config, model=replace(config.model, bottom_mlp=bottom))
    return config


def in_ram(config: TrainConfig) -> TrainConfig:
    """``config`` with its store all in RAM (no memory budget, no disk tier)."""
    return replace(config, store=replace(config.store, memory_budget=None, disk_path=None))


def free_rows(trainer: Trainer) -> None:
    """Drop a trainer's embedding rows and optimizer state (and a tiered store's files):
    a pruned or finished member trains no more."""
    store = trainer.store
    path = getattr(getattr(store, "disk", None), "path", None)
    store.close()
    trainer.store = make_store(trainer.model.row_dim, trainer.sparse_optimizer,
                               in_ram(trainer.config))
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def member_config(base: TrainConfig, params: Mapping[str, Any], model_dir: Path,
                  budget: int | None, live: int) -> TrainConfig:
    """A member's configuration: base with its values, its share of the memory budget
    among the ``live`` members training together, a tiered store's folder in
    ``model_dir``."""
    config = apply_params(base, params)
    if budget is not None:
        config.store.memory_budget = budget // live
    if config.store.tiered:
        config.store.disk_path = str(model_dir / "store")
    return config


class KeySides:
    """The shared key indexes of one cohort: members whose stores admit and evict alike
    share one (``embedding.shared``); a member whose store cannot share keeps its own."""

    def __init__(self) -> None:
        self.by_setting: dict[tuple, SharedKeys] = {}

    def attach(self, trainer: Trainer) -> None:
        """Give ``trainer`` a view of its key side in place of the store it built."""
        config = trainer.config
        if sharing_refusal(config.store, config.sparse_optimizer) is not None:
            return
        setting = (key_side_config(config.store), config.seed)
        shared = self.by_setting.setdefault(setting, SharedKeys(config.store, config.seed))
        trainer.store = SharedRowsStore(shared, trainer.model.row_dim,
                                        trainer.sparse_optimizer, config.store,
                                        seed=config.seed)


def split_budget(trainers: Sequence[Trainer], budget: int | None) -> None:
    """Share ``budget`` (bytes) evenly across the tiered stores of the ``trainers``
    still training: a member that stopped gave its share back."""
    if budget is None or not trainers:
        return
    for trainer in trainers:
        store = trainer.store
        if isinstance(store, TieredStore) and store.budget is not None:
            store.budget = budget // len(trainers)
