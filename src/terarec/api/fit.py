"""``terarec.fit``: train a model from Python, the same recipe as ``terarec train``.

Settings are the ``TrainConfig`` fields (``batch_size=2048``, ``model="dcnv2"`` or
``model={"name": "dcnv2", "embedding_dim": 32}``, ``store={"precision": "int8"}``)
and the data description (``format``, ``label``, ``numeric``, ``categorical`` ...), by
keyword. A keyword that is neither is a TypeError naming it; a bad value is an error
naming its path, as for a ``--config`` file.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from terarec.api.model import Model
from terarec.api.training import ExportSchedule, TrainJob, run_training
from terarec.config import DenseCommConfig, TrainConfig, from_dict, to_dict
from terarec.data.spec import DataSpec

Paths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def fit(train: Paths, valid: Paths | None = None, *, out: str | os.PathLike[str],
        config: TrainConfig | None = None, resume: bool = False, refit: bool | None = None,
        select_by: str = "logloss", patience: int | None = None,
        select_task: str | None = None, eval_every: int | None = None,
        features: str | os.PathLike[str] | None = None,
        export_to: str | None = None, export: ExportSchedule | None = None,
        dense_comm: DenseCommConfig | None = None, checkpoint_every: int = 1,
        progress: bool = True, choose: str | None = None, valid_split: float | None = None,
        **settings: Any) -> Model:
    """Train a model on ``train`` files into the model directory ``out`` and return it.

    With ``valid`` files, training is validation-driven: the best pass by ``select_by``
    (``logloss`` or ``auc``; with several labels their ``label_weights`` mean, or the
    task ``select_task`` names) is kept, training stops after ``patience`` epochs of
    evaluations without improvement (default 2; with ``eval_every``, evaluations), and
    below 100,000 training rows a fresh model is refit on train + valid for the chosen
    number of epochs (``refit=False`` keeps the selected pass). Without ``valid``, below
    100,000 training rows the last 1/8 of them are carved as validation rows and the run
    goes on as with ``valid``
    (``valid_split``: another share, which carves at any size; 0 turns it off;
    metrics.json's ``validation`` says which rows). Settings not given follow the
    data's size, as on the command line; ``choose="auto"`` (with validation rows) races
    a small portfolio of settings against them on the validation rows
    (docs/training.md; off by default).

    ``config``: a whole ``TrainConfig`` (its values that differ from the defaults count
    as given); keyword settings apply on top of it. ``model`` may also be a
    ``terarec.CTRModel`` subclass of your own, defined at module level in an importable
    module (ranks, resumed runs and the server import it by name). Runs as one of N
    ranks when the script is launched by ``torchrun``.
    """
    job = job_settings(train, valid, out=out, config=config, resume=resume, refit=refit,
                       select_by=select_by, patience=patience, eval_every=eval_every,
                       select_task=select_task, features=features, export=export,
                       export_to=export_to,
                       dense_comm=dense_comm, checkpoint_every=checkpoint_every,
                       progress=progress, settings=settings)
    job.choose = choose
    job.valid_split = valid_split
    run_training(job)
    return Model(out)


def job_settings(train: Paths, valid: Paths | None, *, out: str | os.PathLike[str],
                 config: TrainConfig | None, resume: bool, refit: bool | None,
                 select_by: str, patience: int | None, eval_every: int | None,
                 features: str | os.PathLike[str] | None, export: ExportSchedule | None,
                 export_to: str | None, dense_comm: DenseCommConfig | None,
                 checkpoint_every: int, progress: bool,
                 settings: dict[str, Any], select_task: str | None = None) -> TrainJob:
    """The ``TrainJob`` of ``fit``'s arguments (``search`` builds its trials' the same
    way): ``settings`` split into the data description and config keys."""
    from terarec.train.selection import DEFAULT_PATIENCE

    data_keys = set(DataSpec.__dataclass_fields__)
    data = DataSpec.of(**{k: v for k, v in settings.items() if k in data_keys})
    given_settings = {k: v for k, v in settings.items() if k not in data_keys}
    train_config, given = _config(config, given_settings)
    return TrainJob(
        out=Path(out), config=train_config, train=_paths(train, "train"),
        valid=_paths(valid, "valid") if valid is not None else [], data=data, given=given,
        named={k: f"{k}=" for k in given}, config_origin="config", resume=resume,
        refit=refit, checkpoint_every=checkpoint_every, progress=progress,
        features=Path(features) if features is not None else None, select_by=select_by,
        select_task=select_task,
        patience=DEFAULT_PATIENCE if patience is None else patience, eval_every=eval_every,
        export=_export(export, export_to), dense_comm=dense_comm or DenseCommConfig())


def _paths(value: Paths, name: str) -> list[Path]:
    if isinstance(value, str | os.PathLike):
        return [Path(value)]
    paths = [Path(p) for p in value]
    if not paths:
        raise ValueError(f"{name}: no files given")
    return paths


def _export(export: ExportSchedule | None, export_to: str | None) -> ExportSchedule:
    if export is not None and export_to is not None and export.to != export_to:
        raise ValueError("export_to and export.to name two targets; give one")
    if export is None:
        return ExportSchedule(to=export_to)
    return export


def _config(config: TrainConfig | None, settings: dict[str, Any]
            ) -> tuple[TrainConfig, set[str]]:
    """The run's config and the dotted keys given: ``config``'s non-default values, then
    the keyword settings (a model class becomes its import path)."""
    from terarec.models.registry import import_path

    base = config if config is not None else TrainConfig()
    given = _changed(to_dict(base), to_dict(TrainConfig())) if config is not None else set()
    known = set(TrainConfig.__dataclass_fields__)
    unknown = sorted(set(settings) - known)
    if unknown:
        hints = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(
            k, known | set(DataSpec.__dataclass_fields__), n=1)) else k for k in unknown]
        raise TypeError(f"fit() got unknown setting(s): {', '.join(hints)}")
    merged = to_dict(base)
    for key, value in settings.items():
        if key == "model":
            value = _model_setting(value, import_path)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = to_dict(value)
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
            given |= {f"{key}.{k}" for k in _flat_keys(value)}
        else:
            merged[key] = value
            given.add(key)
    return from_dict(TrainConfig, merged), given


def _model_setting(value: Any, import_path: Any) -> Any:
    """``model=``: a name, a class of the user's own, or a dict / ModelConfig."""
    if isinstance(value, type):
        return {"name": import_path(value)}
    if isinstance(value, str):
        return {"name": value}
    if isinstance(value, dict) and isinstance(value.get("name"), type):
        return {**value, "name": import_path(value["name"])}
    return value


def _flat_keys(node: dict[str, Any], prefix: str = "") -> list[str]:
    keys: list[str] = []
    for k, v in node.items():
        keys += _flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]
    return keys


def _changed(now: dict[str, Any], default: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for k, v in now.items():
        if isinstance(v, dict):
            out |= _changed(v, default.get(k, {}), f"{prefix}{k}.")
        elif default.get(k) != v:
            out.add(prefix + k)
    return out
