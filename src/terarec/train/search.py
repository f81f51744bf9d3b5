"""Hyper-parameter search: K trials trained side by side in one pass loop.

::

    study = optuna study (random / TPE / grid sampler, a pruner)
    for each wave of K trials (``parallel``):
        ask K trials -> K configs (the base config with the suggested values)
        train.loop.run_passes(K trials)          data read, hashed and planned once per pass
            at every pass boundary: report each live trial's validation metric, then ask
            the pruner; a pruned trial stops and its rows are freed
        tell each trial its best value (or PRUNED)
    out/best/            the best trial as an ordinary model directory
    out/results.json     one row per trial (also results.csv), out/report.html

A trial is exactly ``terarec train`` with its values as flags and the base seed: same
initial weights, same batches, same random stream (``train.loop``). The trials of a wave
share one key index (``embedding.shared``), each keeping only its rows and optimizer
state. With a memory budget (tiered store) each trial keeps its own store and the
budget is split across the live trials and re-split when trials are pruned.

Every live trial commits a checkpoint at every pass end, as ``train`` does; a trial
that trains no more keeps its checkpoints only while it holds the search's best pass.
The study is journaled in ``out/study.journal``: a search stopped or killed is resumed
(``resume``), finished trials kept, the interrupted wave continued from the last pass
all its trials committed. Under torchrun every rank runs this with its ``DistContext``;
rank 0 alone talks to optuna.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from terarec.config import (
    TrainConfig,
    from_dict,
    parse_bytes,
    read_only_by,
    repeated_key,
    to_dict,
)
from terarec.data.positions import InputFile
from terarec.distributed.context import DistContext, resolve_device
from terarec.embedding.shared import (
    SharedKeys,
    SharedRowsStore,
    key_side_config,
    sharing_refusal,
)
from terarec.embedding.tiered import TieredStore
from terarec.embedding.working_set import PassPlan, plan_pass
from terarec.io import (
    LockedError,
    atomic_write_text,
    exclusive_lock,
    finite_json,
    remove_atomic_leftovers,
)
from terarec.modeldir import (
    BEST_FILE,
    LATEST_FILE,
    CheckpointError,
    best_checkpoint,
    clear_best,
    list_checkpoints,
    mark_best,
    pass_name,
    save_checkpoint,
    verify_checkpoint,
    write_train_config,
)
from terarec.train.loop import TrialRun, diverged, run_passes
from terarec.train.passes import group_passes
from terarec.train.selection import (
    STOP_PRUNED,
    SelectionTracker,
    higher_is_better,
)
from terarec.train.trainer import Trainer, make_store
from terarec.types import Batch, FeatureSchema

log = logging.getLogger(__name__)

SAMPLERS = ("random", "tpe", "grid")
PRUNERS = ("none", "halving", "median", "hyperband")
_KINDS = ("float", "int", "categorical")

# Default spaces (dotted TrainConfig paths). Learning rates on a log scale; the widths
# and MLP shapes are choices, so a grid sampler can use the space as it is.
_COMMON: dict[str, dict[str, Any]] = {
    "sparse_optimizer.lr": {"type": "float", "low": 0.01, "high": 0.3, "log": True},
    "model.embedding_dim": {"type": "categorical", "choices": [4, 8, 16]},
}
_DENSE_LR = {"dense_optimizer.lr": {"type": "float", "low": 3e-4, "high": 1e-2, "log": True}}
_DROPOUT = {"model.dropout": {"type": "categorical", "choices": [0.0, 0.1, 0.2]}}
DEFAULT_SPACES: dict[str, dict[str, dict[str, Any]]] = {
    "lr": {"sparse_optimizer.lr": _COMMON["sparse_optimizer.lr"], **_DENSE_LR},
    "fm": {**_COMMON, **_DENSE_LR},
    "widedeep": {**_COMMON, **_DENSE_LR, **_DROPOUT},
    "deepfm": {**_COMMON, **_DENSE_LR, **_DROPOUT},
    "dcnv2": {**_COMMON, **_DENSE_LR, **_DROPOUT},
    "dlrm": {**_COMMON, **_DENSE_LR},
    "dssm": {**_COMMON, **_DENSE_LR},
}


# With a base config, learning rates range over this factor either side of its own.
LR_SPAN = 4.0
_LR_KEYS = {"sparse_optimizer.lr": ("sparse_optimizer", "lr"),
            "dense_optimizer.lr": ("dense_optimizer", "lr")}


def default_space(model: str, base: TrainConfig | None = None) -> dict[str, dict[str, Any]]:
    """A sensible space for ``model``: learning rates, embedding width, dropout. With
    ``base`` (the trials' configuration, data-sized defaults included) the learning rates
    span ``LR_SPAN`` either side of base's own: the sized rates shrink with the batch
    size on small data, below the fixed ranges' floor."""
    if model not in DEFAULT_SPACES:
        raise ValueError(f"no default search space for model {model!r}; known: "
                         f"{', '.join(DEFAULT_SPACES)} (give one with --space)")
    space = {k: dict(v) for k, v in DEFAULT_SPACES[model].items()}
    if base is not None:
        for key, (part, attr) in _LR_KEYS.items():
            if key in space:
                lr = float(getattr(getattr(base, part), attr))
                space[key].update(low=lr / LR_SPAN, high=lr * LR_SPAN)
    return space


def load_space(path: str | Path, base: TrainConfig) -> dict[str, dict[str, Any]]:
    """A search space from a JSON or YAML file: ``{"dotted.config.path": spec}`` where a
    spec is ``{type: float|int, low, high[, log, step]}`` or ``{type: categorical,
    choices: [...]}`` (``[a, b, c]`` alone means categorical)."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not a text file"
        raise ValueError(f"{path}: cannot read search space: {why}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml  # type: ignore[import-untyped]

        try:
            data = yaml.load(text, Loader=_yaml_loader())
        except _RepeatedKey as exc:
            raise ValueError(f"{path}: {exc}") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f"line {mark.line + 1}: " if mark is not None else ""
            what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(f"{path}: not valid YAML ({at}{what})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") \
                from None
        repeated = repeated_key(text)
        if repeated is not None:  # json keeps the last one: the first would be ignored
            raise ValueError(f"{path}: {repeated}: key given twice in one object; keep one")
    return check_space(data, base, str(path))


class _RepeatedKey(ValueError):
    pass


def _unique_mapping(loader: Any, node: Any, deep: bool = False) -> dict:
    """A YAML mapping whose keys are all different: PyYAML keeps the last of a repeated
    key, so the first was silently ignored."""
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise _RepeatedKey(f"line {key_node.start_mark.line + 1}: {key}: key given "
                               "twice in one mapping; keep one")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


def _yaml_loader() -> type:
    """PyYAML's safe loader, refusing a key given twice in one mapping."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                    _unique_mapping)
    return UniqueKeyLoader


# How the shared pass loop reads the data: one setting for every trial of a search.
SHARED_FIELDS = ("pass_rows", "shuffle", "on_bad_row")

_SPEC_KEYS = {"categorical": {"type", "choices"},
              "float": {"type", "low", "high", "log", "step"},
              "int": {"type", "low", "high", "log", "step"}}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def check_space(data: Any, base: TrainConfig, where: str = "space"
                ) -> dict[str, dict[str, Any]]:
    """Validate a space against the config it modifies; errors name the parameter. Every
    value a trial can get is checked like a config file's: each choice, and a range's
    bounds (``low`` and ``high`` as the field's type), so a bad value is an error here,
    not in the middle of a search."""
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{where}: expected a non-empty mapping of config paths to specs")
    config = to_dict(base)
    out: dict[str, dict[str, Any]] = {}
    for name, spec in data.items():
        at = f"{where}: {name}"
        node: Any = config
        for part in str(name).split("."):
            if not isinstance(node, dict) or part not in node:
                raise ValueError(f"{at}: no such config field (e.g. model.embedding_dim, "
                                 f"sparse_optimizer.lr, batch_size)")
            node = node[part]
        if isinstance(node, dict):
            raise ValueError(f"{at}: a section, not a field; name one of its fields: "
                             + ", ".join(f"{name}.{k}" for k in node))
        if name in SHARED_FIELDS:
            raise ValueError(f"{at}: the trials share one pass loop, which reads the data "
                             f"this way for all of them: set it for the whole search "
                             f"(--{str(name).replace('_', '-')}), not per trial")
        if isinstance(spec, list):
            spec = {"type": "categorical", "choices": spec}
        if not isinstance(spec, dict) or spec.get("type") not in _KINDS:
            raise ValueError(f"{at}: expected a list of choices or a mapping with type "
                             f"one of {', '.join(_KINDS)}")
        unknown = sorted(set(spec) - _SPEC_KEYS[spec["type"]])
        if unknown:
            raise ValueError(f"{at}: unknown key(s) {unknown} for type {spec['type']}; "
                             f"known: {', '.join(sorted(_SPEC_KEYS[spec['type']]))}")
        if spec["type"] == "categorical":
            if not isinstance(spec.get("choices"), list) or not spec["choices"]:
                raise ValueError(f"{at}: categorical needs a non-empty list 'choices'")
            values = [("choice", c) for c in spec["choices"]]
        else:
            for bound in ("low", "high"):
                if not _number(spec.get(bound)):
                    raise ValueError(f"{at}: {spec['type']} needs a finite number "
                                     f"'{bound}', got {spec.get(bound)!r}")
            if spec["low"] > spec["high"]:
                raise ValueError(f"{at}: low {spec['low']} > high {spec['high']}")
            if not isinstance(spec.get("log", False), bool):
                raise ValueError(f"{at}: log must be true or false, got {spec['log']!r}")
            if spec.get("log") and spec["low"] <= 0:
                raise ValueError(f"{at}: log scale needs low > 0")
            step = spec.get("step")
            if step is not None and not (_number(step) and step > 0):
                raise ValueError(f"{at}: step must be a number > 0, got {step!r}")
            if spec["type"] == "int" and not all(
                    isinstance(spec.get(k), int) for k in ("low", "high", "step")
                    if k in spec):
                raise ValueError(f"{at}: int needs integer low, high and step")
            values = [("low", spec["low"]), ("high", spec["high"])]
            if spec["type"] == "float" and spec["low"] < spec["high"]:
                # a value between the bounds: a float range on an integer field fails here
                values.append(("a value inside the range", spec["low"] + 0.501 * (
                    spec["high"] - spec["low"])))
        for label, value in values:
            try:
                apply_params(base, {str(name): value})
            except ValueError as exc:
                raise ValueError(f"{at}: {label} {value!r}: {exc}") from None
        out[str(name)] = dict(spec)
    _refuse_unread(out, base, where)
    return out


def _refuse_unread(space: dict[str, dict[str, Any]], base: TrainConfig, where: str) -> None:
    """A parameter that no trial's model or sparse optimizer reads (``model.cross_layers``
    for DeepFM) is an error, as the same key given to ``train`` is: trials differing only
    in it would train alike."""
    names = {"model": base.model.name, "sparse_optimizer": base.sparse_optimizer.name}
    for name in space:
        readers = read_only_by(name)
        section = name.partition(".")[0]
        if readers is None or section not in names:
            continue
        chosen = space.get(f"{section}.name", {}).get("choices", [names[section]])
        used = {str(c).lower() for c in chosen}
        if not used & set(readers):
            raise ValueError(f"{where}: {name}: only {section.replace('_', ' ')} "
                             f"{' / '.join(readers)} reads it, this search's "
                             f"{'are' if len(used) > 1 else 'is'} {', '.join(sorted(used))}")


def suggest(trial, space: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The trial's values for every parameter of ``space`` (optuna's suggest API)."""
    params: dict[str, Any] = {}
    for name, spec in space.items():
        kind = spec["type"]
        if kind == "categorical":
            params[name] = trial.suggest_categorical(name, spec["choices"])
        elif kind == "int":
            params[name] = trial.suggest_int(name, int(spec["low"]), int(spec["high"]),
                                             step=int(spec.get("step", 1)),
                                             log=bool(spec.get("log", False)))
        else:
            params[name] = trial.suggest_float(name, float(spec["low"]), float(spec["high"]),
                                               step=spec.get("step"),
                                               log=bool(spec.get("log", False)))
    return params


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


def base_params(space: Mapping[str, Mapping[str, Any]], base: TrainConfig
                ) -> dict[str, Any] | None:
    """``base``'s own value of every parameter of ``space`` (the trial that is ``train``
    with the run's settings), or None when one of them lies outside its spec."""
    data = to_dict(base)
    params: dict[str, Any] = {}
    for name, spec in space.items():
        node: Any = data
        for part in name.split("."):
            node = node[part]
        if spec["type"] == "categorical":
            if node not in spec["choices"]:
                return None
        elif not float(spec["low"]) <= float(node) <= float(spec["high"]):
            return None
        params[name] = node
    return params


def grid_space(space: Mapping[str, Mapping[str, Any]]) -> dict[str, list]:
    """The grid sampler's search space: every parameter must list its values."""
    grid: dict[str, list] = {}
    for name, spec in space.items():
        if spec["type"] == "categorical":
            grid[name] = list(spec["choices"])
        elif spec["type"] == "int":
            grid[name] = list(range(int(spec["low"]), int(spec["high"]) + 1,
                                    int(spec.get("step", 1))))
        else:
            raise ValueError(f"grid sampler: {name} is a float range; give it choices")
    return grid


def make_sampler(name: str, space: Mapping[str, Mapping[str, Any]], seed: int):
    import optuna

    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "grid":
        return optuna.samplers.GridSampler(grid_space(space), seed=seed)
    raise ValueError(f"sampler {name!r}: expected one of {', '.join(SAMPLERS)}")


# The pruners first compare trials after this many optimizer steps: on small data one
# pass is an epoch of about 30 steps, which shows how fast a trial starts rather than
# where it ends (a trial with Adagrad's damped start always lost there).
FIRST_RUNG_STEPS = 100


def first_rung(rows: int | None, config: TrainConfig) -> int:
    """The pass at which the pruners first compare trials: enough passes for
    ``FIRST_RUNG_STEPS`` steps of ``config``'s batch on ``rows`` training rows (a pass is
    ``pass_rows`` rows, or the epoch when shorter); 1 when ``rows`` is unknown."""
    if rows is None or rows < 1:
        return 1
    per_pass = max(1, math.ceil(min(rows, config.pass_rows) / config.batch_size))
    return max(1, math.ceil(FIRST_RUNG_STEPS / per_pass))


def make_pruner(name: str, first: int = 1):
    """Pruners that work while trials train together: successive halving and hyperband
    compare trials that reached the same pass, first at pass ``first`` (``first_rung``);
    median needs finished trials (earlier waves, ``parallel`` < ``trials``) and prunes
    from pass ``first`` on."""
    import optuna

    if first < 1:
        raise ValueError(f"first rung (--prune-after) {first}: must be >= 1")
    if name == "none":
        return optuna.pruners.NopPruner()
    if name == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=first, reduction_factor=3)
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=first - 1)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=first, reduction_factor=3)
    raise ValueError(f"pruner {name!r}: expected one of {', '.join(PRUNERS)}")


def _in_ram(config: TrainConfig) -> TrainConfig:
    """``config`` with its store all in RAM (no memory budget, no disk tier)."""
    return replace(config, store=replace(config.store, memory_budget=None, disk_path=None))


def free_rows(trainer: Trainer) -> None:
    """Drop a trainer's embedding rows and optimizer state (and a tiered store's files):
    a pruned or finished trial trains no more."""
    store = trainer.store
    path = getattr(getattr(store, "disk", None), "path", None)
    store.close()
    trainer.store = make_store(trainer.model.row_dim, trainer.sparse_optimizer,
                               _in_ram(trainer.config))
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class SearchTrial:
    """One trial: its values, configuration, state, curve and optuna handle. A trial
    that finished before a resumed search started has no ``run``: its selection and
    stop reason were read back from its directory (``kept``)."""

    number: int
    params: dict[str, Any]
    config: TrainConfig
    model_dir: Path
    optuna_trial: Any
    run: TrialRun | None
    state: str = "running"  # running, complete, pruned, failed
    seconds: float = 0.0  # its own training and evaluation time
    history: list[dict] = field(default_factory=list)
    kept: tuple[SelectionTracker, str | None] | None = None
    continued_from: str | None = None  # the checkpoint a resumed search continued it from
    reported: int = 0  # passes optuna was told of (before a stop: they are trained again)

    @property
    def selection(self) -> SelectionTracker:
        if self.kept is not None:
            return self.kept[0]
        assert self.run is not None and self.run.selection is not None
        return self.run.selection

    @property
    def stop_reason(self) -> str | None:
        if self.kept is not None:
            return self.kept[1]
        assert self.run is not None
        return self.run.stop_reason

    @property
    def trainer(self) -> Trainer:
        assert self.run is not None, "a trial restored from disk has no trainer"
        return self.run.trainer

    def row(self) -> dict[str, Any]:
        """Its line in the results table."""
        sel = self.selection
        best = next((h for h in self.history if h["pass_id"] + 1 == sel.best_pass), {})
        return {"trial": self.number, "state": self.state, "value": sel.best_value,
                "select_by": sel.select_by, "best_pass": sel.best_pass,
                "passes": len(self.history), "stop_reason": self.stop_reason,
                "valid_auc": best.get("valid_auc"), "valid_logloss": best.get("valid_logloss"),
                "seconds": round(self.seconds, 3),
                **{f"params.{k}": v for k, v in self.params.items()}}


@dataclass
class SearchResult:
    trials: list[SearchTrial]
    best: SearchTrial | None
    best_dir: Path | None
    study: Any
    seconds: float

    def rows(self) -> list[dict[str, Any]]:
        return [t.row() for t in self.trials]


def run_search(schema: FeatureSchema, base: TrainConfig,
               train_paths: Sequence[str | Path | InputFile],
               valid_batches: list[Batch], out_dir: str | Path, *, trials: int = 8,
               parallel: int | None = None,
               space: Mapping[str, Mapping[str, Any]] | None = None,
               sampler: str = "tpe", pruner: str = "halving", select_by: str = "logloss",
               patience: int | None = 2, seed: int = 0, progress: bool = False,
               fixed: list[dict[str, Any]] | None = None,
               on_boundary: Callable[[list[SearchTrial]], None] | None = None,
               resume: bool = False, ctx: DistContext | None = None,
               checkpoint_every: int = 1, first_rung: int = 1) -> SearchResult:
    """Run ``trials`` trials, ``parallel`` at a time (default: all) in one pass loop,
    and write the best one to ``out_dir/best`` as a model directory.

    ``fixed``: parameter sets to try first (``study.enqueue_trial``), e.g. the defaults.
    ``on_boundary`` sees the wave's trials after each pass's pruning. ``resume``:
    continue the search in ``out_dir`` (``open_study``, ``_resumed_trials``): finished
    trials are kept, the interrupted wave continues from the last pass all its trials
    committed (``_left_wave``; with none, its trials run again with their values).

    ``first_rung``: the pass at which the pruner first compares trials (``first_rung``).

    ``checkpoint_every``: every live trial commits its state every N passes (all at
    the same passes: a resume continues from the last of them), and at each pass that
    leads the search when reached (the search's answer must be on disk).

    ``ctx``: a torchrun rank's topology (every rank calls this): each trial trains on
    all ranks, each rank keeping its key shard's rows; rank 0 alone holds the optuna
    study, asks, reports and prunes, and sends its decisions to the others.
    """
    if not valid_batches:
        raise ValueError("search needs a validation set (--valid)")
    if trials < 1:
        raise ValueError(f"trials {trials}: must be >= 1")
    if parallel is not None and parallel < 1:  # 0 meant "all", a negative one no trial
        raise ValueError(f"parallel {parallel}: must be >= 1 (leave it out for all)")
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every {checkpoint_every}: must be >= 1")
    make_pruner(pruner, first_rung)  # a bad name or rung fails before anything is written
    space = dict(space) if space is not None else default_space(base.model.name, base)
    if sampler == "grid":  # each grid point once
        trials = min(trials, math.prod(len(v) for v in grid_space(space).values()))
    parallel = min(parallel or trials, trials)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = ctx if ctx is not None else DistContext.single(resolve_device(base.device))
    with contextlib.ExitStack() as held:
        failure = None
        if ctx.is_main:  # one search per directory: the journal has one writer
            try:
                held.enter_context(exclusive_lock(out_dir / LOCK_FILE,
                                                  f"search directory {out_dir}"))
                remove_atomic_leftovers(out_dir)  # of a search killed mid-write
            except LockedError as exc:
                failure = str(exc)
        failure = ctx.broadcast_object(failure)
        if failure is not None:
            raise ValueError(failure)
        return _search(schema, base, train_paths, valid_batches, out_dir, trials, parallel,
                       space, sampler, pruner, select_by, patience, seed, progress, fixed,
                       on_boundary, resume, ctx, checkpoint_every, first_rung)


def _search(schema: FeatureSchema, base: TrainConfig,
            train_paths: Sequence[str | Path | InputFile],
            valid_batches: list[Batch], out_dir: Path, trials: int, parallel: int,
            space: dict[str, Any], sampler: str, pruner: str, select_by: str,
            patience: int | None, seed: int, progress: bool,
            fixed: list[dict[str, Any]] | None,
            on_boundary: Callable[[list[SearchTrial]], None] | None, resume: bool,
            ctx: DistContext, every: int, first: int) -> SearchResult:
    """``run_search`` with the directory's lock held."""
    if ctx.world > 1 and "batch_size" in space:
        _check_batch_sizes(space["batch_size"], ctx.world)
    settings = {"space": space, "sampler": sampler, "pruner": pruner,
                "select_by": select_by, "patience": patience, "seed": seed,
                "config": to_dict(base)}
    if first > 1:  # searches saved before it existed pruned from pass 1
        settings["first_rung"] = first
    study = open_study(out_dir, settings, resume) if ctx.is_main else None
    overall = _BestSoFar(SelectionTracker(select_by, patience=None), every=every)
    done, left = _resumed_trials(study, out_dir, base, select_by, patience, overall,
                                 ctx.world) if resume and ctx.is_main else ([], None)
    if study is not None and not resume:
        for params in fixed or []:
            study.enqueue_trial(params)
    # Every rank takes the same checkpoint decisions: from the same best so far.
    tracker = overall.tracker
    tracker.best_value, tracker.best_pass, overall.trial, finished, left = \
        ctx.broadcast_object((tracker.best_value, tracker.best_pass, overall.trial,
                              len(done), left))
    budget = parse_bytes(base.store.memory_budget) if base.store.memory_budget else None
    # The validation set's keys are planned once for every trial and evaluation.
    valid = [plan_pass(group, counts=False)
             for group in group_passes(valid_batches, base.pass_rows)]
    start = time.perf_counter()
    if left is not None:  # the wave a stopped search was training, from its last commit
        wave = _continue_wave(left, study, schema, base, out_dir, budget, select_by,
                              patience, overall, ctx)
        _train_wave(wave, study, train_paths, valid, select_by, budget,
                    progress and ctx.is_main, on_boundary, overall, ctx, out_dir,
                    reader=left.reader)
        done.extend(wave)
        finished += len(wave)
    while finished < trials:
        k = min(parallel, trials - finished)
        # Built one after another, each trainer seeds torch itself: the weights of a
        # trial are those of the same configuration trained alone.
        keys = _KeySides()  # one key index per admission/eviction setting of the wave
        wave = [_ask(study, space, schema, base, out_dir, budget, k, select_by, patience,
                     overall, keys, ctx) for _ in range(k)]
        if ctx.is_main:  # which trial's sizes cut the wave's passes, for a resume
            for t in wave:
                t.optuna_trial.set_user_attr(_READER, wave[0].number)
        _train_wave(wave, study, train_paths, valid, select_by, budget,
                    progress and ctx.is_main, on_boundary, overall, ctx, out_dir)
        done.extend(wave)
        finished += k
    # The trial with the best validation value of all, pruned ones included (a pruned
    # trial's best pass is a whole model): the one whose checkpoint ``overall`` took last.
    best = next((t for t in done if t.number == overall.trial), None)
    best_dir = out_dir / "best" if best is not None else None
    if ctx.is_main:
        if best is not None and (best.model_dir / "checkpoints").exists():
            _write_best(best, out_dir, base)  # else out/best holds it (resumed)
        for t in done:  # only the best trial keeps its checkpoints (in out/best)
            shutil.rmtree(t.model_dir / "checkpoints", ignore_errors=True)
            for pointer in (BEST_FILE, LATEST_FILE):
                (t.model_dir / pointer).unlink(missing_ok=True)
    ctx.barrier()
    return SearchResult(done, best, best_dir, study, time.perf_counter() - start)


LOCK_FILE = ".lock"  # in the search directory: held by the one search using it
STUDY_FILE = "study.journal"  # optuna's journal: every trial asked, reported and told
SETTINGS_FILE = "search.json"  # what the search was started with
_INTERRUPTED = "interrupted"  # user attribute of a trial a stopped search left running
def _check_batch_sizes(spec: dict[str, Any], world: int) -> None:
    """Under torchrun every batch size a trial can get must be a multiple of the ranks
    (each trains ``batch_size / world`` rows a step): refused before any trial runs."""
    why = f"under torchrun each of the {world} ranks trains batch_size / {world} rows a step"
    if spec["type"] == "categorical":
        bad = [c for c in spec["choices"] if c % world]
        if bad:
            raise ValueError(f"space: batch_size: choices {bad} are not multiples of "
                             f"{world} ({why})")
        return
    step = spec.get("step") or 1
    if spec.get("log") or spec["low"] % world or step % world:
        raise ValueError(f"space: batch_size: the range {spec['low']}..{spec['high']} "
                         f"(step {step}{', log' if spec.get('log') else ''}) holds values "
                         f"that are not multiples of {world} ({why}); give choices, or "
                         f"a low and a step that are multiples of {world}")


_READER = "reader"  # user attribute: the trial whose batch and pass sizes cut its wave


def open_study(out_dir: Path, settings: dict[str, Any], resume: bool):
    """The search's optuna study, journaled in ``out_dir/study.journal`` so that a
    search killed at any point can be resumed. A fresh search refuses a directory that
    holds one; a resumed one must have the settings it was started with."""
    import optuna
    from optuna.storages import JournalStorage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    journal, saved = out_dir / STUDY_FILE, out_dir / SETTINGS_FILE
    settings = json.loads(json.dumps(settings))  # as it reads back (lists, not tuples)
    if resume:
        if not journal.exists() or not saved.exists():
            raise ValueError(f"{out_dir}: no search to resume (no {STUDY_FILE} / "
                             f"{SETTINGS_FILE}); run it without --resume first")
        before = json.loads(saved.read_text())
        for key, value in settings.items():
            if before.get(key) != value:
                raise ValueError(f"{saved}: the search was started with a different "
                                 f"{key} ({_diff(before.get(key), value)}); resume it "
                                 "with the settings it was started with")
    elif journal.exists():
        raise ValueError(f"{out_dir} holds a search ({STUDY_FILE}): pass --resume to "
                         "continue it, or choose another --out")
    else:
        atomic_write_text(saved, json.dumps(settings, indent=2))
    storage = JournalStorage(_journal_backend(journal))
    direction: Literal["maximize", "minimize"] = \
        "maximize" if higher_is_better(settings["select_by"]) else "minimize"
    study = optuna.create_study(storage=storage, study_name="search",
                                load_if_exists=resume, direction=direction,
                                pruner=make_pruner(settings["pruner"],
                                                   settings.get("first_rung", 1)))
    # A sampler's random stream is not journaled: a resumed one continues from a seed of
    # its own, so that it does not draw again the values it drew before. The grid
    # sampler's seed orders its grid, which point numbers in the journal refer to.
    shift = len(study.trials) if settings["sampler"] != "grid" else 0
    study.sampler = make_sampler(settings["sampler"], settings["space"],
                                 settings["seed"] + shift)
    return study


def _diff(before: Any, now: Any) -> str:
    """Where two settings differ: the first differing path (dotted) and both values."""
    if isinstance(before, dict) and isinstance(now, dict):
        for key in sorted(set(before) | set(now)):
            if before.get(key) != now.get(key):
                inner = _diff(before.get(key), now.get(key))
                return f"{key}.{inner}" if isinstance(before.get(key), dict) else \
                    f"{key}: {before.get(key)!r} then, {now.get(key)!r} now"
    return f"{before!r} then, {now!r} now"


def _resumed_trials(study, out_dir: Path, base: TrainConfig, select_by: str,
                    patience: int | None, overall: _BestSoFar, world: int
                    ) -> tuple[list[SearchTrial], _LeftWave | None]:
    """The trials a stopped search finished, read back from their directories, the best
    of them so far (``overall``), and the wave it left running, to be continued from the
    last pass all its trials committed (``_left_wave``). A running trial that cannot be
    continued (no such pass) is told FAIL (marked interrupted, left out of the results)
    and asked again with the same values."""
    import optuna

    states = {optuna.trial.TrialState.COMPLETE: "complete",
              optuna.trial.TrialState.PRUNED: "pruned",
              optuna.trial.TrialState.FAIL: "failed"}
    done: list[SearchTrial] = []
    running = []
    for frozen in study.get_trials(deepcopy=False):
        model_dir = trial_dir(out_dir, frozen.number)
        if frozen.state == optuna.trial.TrialState.RUNNING:
            running.append(frozen)
            continue
        if frozen.state not in states or frozen.user_attrs.get(_INTERRUPTED):
            continue
        history = json.loads((model_dir / "history.json").read_text())
        metrics = json.loads((model_dir / "metrics.json").read_text())
        selection = SelectionTracker.from_history(history, select_by, patience)
        stop = history[-1].get("stop_reason") if history else None
        t = SearchTrial(frozen.number, dict(metrics.get("params", frozen.params)),
                        apply_params(base, frozen.params), model_dir, frozen, None,
                        state=states[frozen.state], seconds=float(metrics.get("seconds", 0)),
                        history=history, kept=(selection, stop))
        done.append(t)
        overall.finished[t.number] = model_dir
        # the best so far holds a BEST checkpoint, or, once a search ended, is out/best
        if (model_dir / BEST_FILE).exists() or _best_dir_trial(out_dir) == t.number:
            overall.consider(t.number, selection)
    left = _left_wave(study, running, out_dir, world, select_by, patience, overall) \
        if running else None
    if left is None:
        for frozen in running:
            study._storage.set_trial_user_attr(frozen._trial_id, _INTERRUPTED, True)
            _tell(study, frozen.number, state=optuna.trial.TrialState.FAIL)
            _ask_again(study, frozen)
            shutil.rmtree(trial_dir(out_dir, frozen.number), ignore_errors=True)
    return done, left


def trial_dir(out_dir: Path, number: int) -> Path:
    """A trial's model directory."""
    return out_dir / "trials" / f"trial-{number:03d}"


@dataclass(frozen=True)
class _LeftWave:
    """The trials a stopped search left running, to be continued from checkpoint
    ``name``, which each of them committed: (number, values) each, and the values of the
    trial whose batch and pass sizes cut the wave's passes when it is not one of them."""

    name: str
    trials: list[tuple[int, dict[str, Any]]]
    reader: dict[str, Any] | None


def _left_wave(study, running: list, out_dir: Path, world: int, select_by: str,
               patience: int | None, overall: _BestSoFar) -> _LeftWave | None:
    """The wave ``running`` (optuna's RUNNING trials), continued from the newest pass
    every one of them committed at this world size, or None where there is none. The
    trials of a wave train the same passes in step, so a kill leaves each at that pass or
    one after it; checkpoints and ``BEST`` newer than it are dropped (training them again
    writes them again, the same), and the best so far takes in their best passes."""
    running = sorted(running, key=lambda f: f.number)
    common: set[str] | None = None
    for frozen in running:
        have = {p.name for p in list_checkpoints(trial_dir(out_dir, frozen.number))}
        common = have if common is None else common & have
    if not common or any(set(f.params) != set(f.distributions) for f in running):
        return None
    found = next(((n, metas) for n in sorted(common, reverse=True)
                  if (metas := _loadable(out_dir, running, n, world)) is not None), None)
    if found is None:
        return None
    name, metas = found
    for frozen, meta in zip(running, metas, strict=True):
        model_dir = trial_dir(out_dir, frozen.number)
        for newer in list_checkpoints(model_dir):
            if newer.name > name:
                shutil.rmtree(newer)
        atomic_write_text(model_dir / LATEST_FILE, name)
        selection = SelectionTracker.from_history(meta.get("history", []), select_by,
                                                  patience)
        clear_best(model_dir)
        best = pass_name(selection.best_pass or 0)
        if selection.best_pass and (model_dir / "checkpoints" / best).is_dir():
            mark_best(model_dir, best)
            overall.consider(frozen.number, selection)
    reader_number = running[0].user_attrs.get(_READER, running[0].number)
    reader = None
    if reader_number not in {f.number for f in running}:
        reader = dict(study.trials[reader_number].params)
    return _LeftWave(name, [(f.number, dict(f.params)) for f in running], reader)


def _loadable(out_dir: Path, running: list, name: str, world: int) -> list[dict] | None:
    """The metas of every trial's checkpoint ``name``, if each verifies (checksums) and
    was written at this world size with input positions to read on from; else None."""
    metas = []
    for frozen in running:
        try:
            meta = verify_checkpoint(trial_dir(out_dir, frozen.number) / "checkpoints" / name)
        except CheckpointError as exc:
            log.warning("search --resume: not continuing from %s: %s", name, exc)
            return None
        if int(meta.get("world_size", 1)) != world or not meta.get("inputs"):
            return None
        metas.append(meta)
    return metas


def _best_dir_trial(out_dir: Path) -> int | None:
    """The trial ``out/best`` was written from (by a search that ended), or None."""
    metrics = out_dir / "best" / "metrics.json"
    if not metrics.exists():
        return None
    return json.loads(metrics.read_text()).get("trial")


def _ask_again(study, frozen) -> None:
    """Queue a trial with the values of the interrupted ``frozen`` (all of them, or
    the grid sampler's point of it); the grid point number goes with it, since the grid
    counts the interrupted trial as visited. A trial interrupted before it drew its
    values is simply replaced by the next one asked."""
    import optuna

    params = dict(frozen.params)
    sampler = study.sampler
    grid_id = frozen.system_attrs.get("grid_id")
    if isinstance(sampler, optuna.samplers.GridSampler) and grid_id is not None:
        params = dict(zip(sampler._param_names, sampler._all_grids[grid_id], strict=True))
    elif set(params) != set(frozen.distributions) or not params:
        return
    study.enqueue_trial(params)
    waiting = study._storage.get_all_trials(study._study_id, deepcopy=False)[-1]
    for key in ("grid_id", "search_space"):
        if key in frozen.system_attrs:
            study._storage.set_trial_system_attr(waiting._trial_id, key,
                                                 frozen.system_attrs[key])


def _journal_backend(path: Path):
    """optuna's journal file, written at every call but fsynced only by ``sync_journal``
    (at pass boundaries): a search appends a few records per trial and pass, and an
    fsync each costs more than a small trial's pass. A kill -9 loses nothing written
    (the kernel has it); a power loss at most what followed the last boundary. No lock
    file: the search directory's lock (``LOCK_FILE``, held by rank 0 for the whole
    search) makes this process the only writer, and optuna's lock files would outlive a
    kill -9 and stall the resume."""
    from optuna.storages.journal import JournalFileBackend

    class _OnlyWriter:
        def acquire(self) -> bool:
            return True

        def release(self) -> None:
            pass

    class _Journal(JournalFileBackend):
        def append_logs(self, logs: list[dict[str, Any]]) -> None:
            text = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs)
            with open(path, "ab") as fh:
                fh.write(text.encode("utf-8"))

    return _Journal(str(path), lock_obj=_OnlyWriter())  # type: ignore[arg-type]


def sync_journal(out_dir: Path) -> None:
    """Make the study's journal durable (``_journal_backend``)."""
    with open(out_dir / STUDY_FILE, "rb") as fh:
        os.fsync(fh.fileno())


def _ask(study, space, schema: FeatureSchema, base: TrainConfig, out_dir: Path,
         budget: int | None, live: int, select_by: str, patience: int | None,
         overall: _BestSoFar, keys: _KeySides, ctx: DistContext) -> SearchTrial:
    trial = study.ask() if ctx.is_main else None
    number, params = ctx.broadcast_object(
        (trial.number, suggest(trial, space)) if trial is not None else None)
    model_dir = trial_dir(out_dir, number)
    if ctx.is_main:
        shutil.rmtree(model_dir, ignore_errors=True)
    config = _trial_config(base, params, model_dir, budget, live)
    trainer = Trainer(schema, config, ctx=ctx)
    keys.attach(trainer)
    run = TrialRun(trainer, SelectionTracker(select_by, patience),
                   _commit_pass(model_dir, number, overall), stop_on_divergence=True)
    return SearchTrial(number, params, config, model_dir, trial, run)


def _trial_config(base: TrainConfig, params: Mapping[str, Any], model_dir: Path,
                  budget: int | None, live: int) -> TrainConfig:
    """A trial's configuration: base with its values, its share of the memory budget
    among the ``live`` trials of its wave, a tiered store's folder in its directory."""
    config = apply_params(base, params)
    if budget is not None:
        config.store.memory_budget = budget // live
    if config.store.tiered:
        config.store.disk_path = str(model_dir / "store")
    return config


def _continue_wave(left: _LeftWave, study, schema: FeatureSchema, base: TrainConfig,
                   out_dir: Path, budget: int | None, select_by: str,
                   patience: int | None, overall: _BestSoFar, ctx: DistContext
                   ) -> list[SearchTrial]:
    """The trials of ``left`` restored from their checkpoint ``left.name`` (collective),
    sharing one key index as the wave did, each with its optuna trial, selection and
    random stream as they were after that pass."""
    import optuna

    keys = _KeySides()
    by_number = {f.number: f for f in study.get_trials(deepcopy=False)} \
        if study is not None else {}
    wave = []
    for number, params in left.trials:
        model_dir = trial_dir(out_dir, number)
        config = _trial_config(base, params, model_dir, budget, len(left.trials))
        trainer = Trainer.from_checkpoint(model_dir, config, name=left.name, ctx=ctx,
                                  prepare=keys.attach)  # torch's RNG: the trial's
        selection = SelectionTracker.from_history(trainer.history, select_by, patience)
        run = TrialRun(trainer, selection, _commit_pass(model_dir, number, overall),
                       stop_on_divergence=True)
        trial = optuna.trial.Trial(study, by_number[number]._trial_id) \
            if study is not None else None
        told = max(by_number[number].intermediate_values, default=0) if by_number else 0
        t = SearchTrial(number, params, config, model_dir, trial, run,
                        seconds=sum(_pass_seconds(r) for r in trainer.history),
                        continued_from=left.name, reported=told)
        wave.append(t)
    if ctx.is_main:
        print(f"continuing trial(s) {', '.join(str(t.number) for t in wave)} "
              f"after {left.name}")
    return wave


def _pass_seconds(record: dict) -> float:
    """A trial's own time in one pass: staging, training and writing back its rows."""
    return record["staging_s"] + record["train_s"] + record["write_back_s"]


class _KeySides:
    """The shared key indexes of one wave: trials whose stores admit and evict alike
    share one (``embedding.shared``); a trial whose store cannot share keeps its own."""

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


@dataclass
class _BestSoFar:
    """The best pass of any trial so far and which trial holds it. A trial that trains
    no more (``finished``) keeps its checkpoints only while it holds that pass: the pass
    the search ends up choosing was the best so far when it was reached, so no later
    pass of a trial it does not name is ever needed."""

    tracker: SelectionTracker
    trial: int | None = None
    finished: dict[int, Path] = field(default_factory=dict)
    every: int = 1  # live trials commit every N passes (``_commit_pass``)
    commits: _Commits = field(default_factory=lambda: _Commits(background=False))

    def lead(self, number: int, value: float, best_pass: int, is_main: bool) -> Path | None:
        """Trial ``number`` holds the best pass now. Returns the directory of the trial
        that held it, finished, whose checkpoints are to go once ``number``'s pass is
        committed (None: nothing to drop)."""
        before, self.trial = self.trial, number
        self.tracker.update(value, best_pass)
        if is_main and before is not None and before != number and before in self.finished:
            return self.finished[before]
        return None

    def consider(self, number: int, selection: SelectionTracker) -> None:
        """A resumed search: trial ``number``'s best pass, held on disk, leads if better."""
        value = selection.best_value
        if value is not None and self.tracker.is_better(value):
            self.tracker.update(value, selection.best_pass or 0)
            self.trial = number

    def finish(self, number: int, model_dir: Path, is_main: bool) -> None:
        """Trial ``number`` trains no more."""
        self.finished[number] = model_dir
        if is_main and number != self.trial:
            _drop_checkpoints(model_dir)


def _drop_checkpoints(model_dir: Path) -> None:
    shutil.rmtree(model_dir / "checkpoints", ignore_errors=True)
    for pointer in (BEST_FILE, LATEST_FILE):
        (model_dir / pointer).unlink(missing_ok=True)


def _commit_pass(model_dir: Path, number: int, overall: _BestSoFar
                 ) -> Callable[[Trainer, dict], None]:
    """The pass-end hook of a trial: commit a checkpoint (collective on N ranks), as
    ``train`` does, so a stopped search continues the trial from it (every
    ``overall.every`` passes, the same passes for every trial, the last of which pruning
    keeps); and a pass that leads the whole search so far, which it marks ``BEST``. A
    diverged pass is not committed (the pass loop has stopped its trial)."""

    def hook(trainer: Trainer, record: dict) -> None:
        if diverged(record):  # its run stopped (``TrialRun.stop_on_divergence``)
            return
        value = record[overall.tracker.key]
        leads = bool(record.get("best")) and overall.tracker.is_better(value)
        every = overall.every
        if trainer.pass_id % every and not leads:
            return
        last = trainer.pass_id // every * every
        pinned = pass_name(last) if last else None
        # What the trial's own state cannot tell later is taken now: torch's random
        # state (the next trial's pass replaces it) and the lead (the next trial's pass
        # compares against it). The rest waits, unchanged, until the trial's next pass.
        rng = torch.get_rng_state().tolist()
        is_main = trainer.ctx.is_main
        best = bool(record.get("best"))
        dropped = overall.lead(number, value, int(record["pass_id"]) + 1, is_main) \
            if leads else None

        def write() -> None:
            name = save_checkpoint(model_dir, trainer, pinned=pinned, rng=rng).name
            if best and is_main:
                mark_best(model_dir, name)
            if dropped is not None:  # the former leader's pass, once this one is durable
                _drop_checkpoints(dropped)

        overall.commits.submit(write)

    return hook


class _Commits:
    """The trials' checkpoint commits, written on one background thread in one process.

    In a pass round a trial's state is idle from its pass end until its next pass while
    the other trials train theirs, so its commit is written meanwhile (on the synthetic
    search benchmark the commits were a fifth of the time). Whatever reads or changes
    what a commit reads waits for them first (``wait``): the pass boundary (pruning
    frees rows, the journal records committed passes; the next round's first pull
    changes the shared key index) and the end of a wave. On N ranks a commit is
    collective, so it is written in place (``background=False``)."""

    def __init__(self, background: bool) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="terarec-commit") \
            if background else None
        self._pending: list[Future[None]] = []
        self._failed = False

    def submit(self, write: Callable[[], None]) -> None:
        if self._pool is None:
            write()
        else:
            self._pending.append(self._pool.submit(self._after_the_others, write))

    def _after_the_others(self, write: Callable[[], None]) -> None:
        """Write, unless a commit queued before failed (the search stops with its
        error: nothing after it is written)."""
        if self._failed:
            return
        try:
            write()
        except BaseException:
            self._failed = True
            raise

    def wait(self, raise_error: bool = True) -> None:
        """Block until every submitted commit is written; raise the first one's error
        (``raise_error=False``: the caller is already raising its own)."""
        pending, self._pending = self._pending, []
        errors = [e for e in (f.exception() for f in pending) if e is not None]
        if errors and raise_error:
            raise errors[0]

    def close(self, raise_error: bool = True) -> None:
        """``wait``, then end the thread."""
        try:
            self.wait(raise_error)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)


def _train_wave(wave: list[SearchTrial], study, train_paths, valid: list[PassPlan],
                select_by: str, budget: int | None, progress: bool,
                on_boundary: Callable[[list[SearchTrial]], None] | None,
                overall: _BestSoFar, ctx: DistContext, out_dir: Path,
                reader: dict[str, Any] | None = None) -> None:
    """Train a wave to its end. ``reader``: the values of the trial whose batch and pass
    sizes cut the wave's passes, when it is not in ``wave`` (a continued wave whose
    first trial had finished): a stopped stand-in with its configuration reads."""
    import optuna

    by_run = {id(t.run): t for t in wave}
    runs = [t.run for t in wave if t.run is not None]
    if reader is not None and runs:
        first = runs[0].trainer
        stand_in = TrialRun(Trainer(first.schema, _in_ram(apply_params(first.config, reader)),
                                    ctx=ctx))
        free_rows(stand_in.trainer)
        stand_in.trainer.inputs = first.inputs
        stand_in.stop(STOP_PRUNED)
        runs.insert(0, stand_in)

    def finish(t: SearchTrial, pruned: bool = False) -> None:
        """A trial that trains no more: its files written, then optuna told (so a told
        trial always has its files), its rows freed, its checkpoints dropped unless it
        holds the best pass so far."""
        t.history = list(t.trainer.history)
        value = t.selection.best_value
        t.state = "pruned" if pruned else "complete" if value is not None else "failed"
        if ctx.is_main:  # rank 0 writes the files and tells optuna
            _write_trial_files(t)
            state = optuna.trial.TrialState
            _tell(study, t.optuna_trial, value if value is not None and not pruned else None,
                  state=state.PRUNED if pruned else state.FAIL if value is None else None)
        free_rows(t.trainer)
        overall.finish(t.number, t.model_dir, ctx.is_main)

    def boundary(live: list[TrialRun]) -> None:
        overall.commits.wait()  # the round's commits are durable before anything else
        trials = [by_run[id(r)] for r in live if id(r) in by_run]
        for t in trials:  # every live trial reports before any is pruned
            record = t.trainer.history[-1]
            t.seconds += _pass_seconds(record)
            value = record.get(f"valid_{select_by}")
            step = len(t.trainer.history)
            if ctx.is_main and value is not None and math.isfinite(value) \
                    and step > t.reported:  # a pass trained again was reported before
                t.optuna_trial.report(value, step=step)
        # rank 0 asks the pruner; every rank stops the same trials
        prune = ctx.broadcast_object(
            {t.number for t in trials if t.run is not None and t.run.live
             and t.optuna_trial.should_prune()} if ctx.is_main else None)
        for t in trials:
            assert t.run is not None
            if t.run.live and t.number in prune:
                t.run.stop(STOP_PRUNED)
                finish(t, pruned=True)
        for t in wave:  # patience ran out, it diverged, or its epochs ended (it sat out)
            if t.state == "running" and t.run is not None and not t.run.live:
                finish(t)
        alive = [t for t in trials if t.state == "running"]
        if budget is not None and alive:  # re-split the budget across live trials
            for t in alive:
                store = t.trainer.store
                if isinstance(store, TieredStore) and store.budget is not None:
                    store.budget = budget // len(alive)
        if ctx.is_main:
            sync_journal(out_dir)
        if on_boundary is not None:
            on_boundary(wave)

    overall.commits = _Commits(background=ctx.world == 1)
    try:
        run_passes(runs, train_paths, valid, progress=progress, on_boundary=boundary)
    except BaseException:
        overall.commits.close(raise_error=False)  # nothing is written once it stops
        raise
    overall.commits.close()
    for t in wave:
        if t.state == "running":
            finish(t)
    if ctx.is_main:
        sync_journal(out_dir)


def _tell(study, trial, value: float | None = None, state=None) -> None:
    """``study.tell``. The grid sampler calls ``study.stop()`` once its grid is used up,
    which optuna allows only inside ``optimize``; the trial is stored before that
    (optuna writes it in a ``finally``), so that one error is dropped."""
    try:
        study.tell(trial, value, state=state)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise


def _write_trial_files(t: SearchTrial) -> None:
    """history.json and metrics.json of a trial, as train writes them."""
    t.model_dir.mkdir(parents=True, exist_ok=True)
    history = [*t.history[:-1], {**t.history[-1], "stop_reason": t.stop_reason}] \
        if t.history else []
    atomic_write_text(t.model_dir / "history.json", finite_json(history, indent=2))
    row = t.row()
    metrics = {"auc": row["valid_auc"], "logloss": row["valid_logloss"],
               "evaluated_on": "valid", "checkpoint": pass_name(row["best_pass"])
               if row["best_pass"] else None, "passes": row["passes"],
               "stop_reason": row["stop_reason"], "model": t.config.model.name,
               "trial": t.number, "params": t.params, "state": t.state,
               "seconds": t.seconds, **t.selection.summary(),
               **({"continued_from": t.continued_from} if t.continued_from else {})}
    atomic_write_text(t.model_dir / "metrics.json", finite_json(metrics, indent=2))


def _write_best(best: SearchTrial, out_dir: Path, base: TrainConfig) -> Path:
    """Copy the best trial's directory (less its live store folder) to ``out/best``. Its
    configuration keeps base's store budget and folder, not the trial's share of the
    budget and folder under trials/: ``out/best`` is an ordinary model directory, which
    a refit, ``train --resume`` or ``eval`` uses alone. Of its checkpoints only the one
    ``BEST`` names is copied (and is ``LATEST`` there): the trial's later passes lost."""
    target = out_dir / "best"
    tmp = out_dir / ".best.tmp"
    chosen = best_checkpoint(best.model_dir)

    def skipped(folder: str, names: list[str]) -> list[str]:
        if chosen is not None and Path(folder).name == "checkpoints":
            return [n for n in names if n != chosen]
        return [n for n in names if n == "store"]  # the live disk tier

    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(best.model_dir, tmp, ignore=skipped)
    if chosen is not None:
        atomic_write_text(tmp / LATEST_FILE, chosen)
    store = replace(best.config.store, memory_budget=base.store.memory_budget,
                    disk_path=base.store.disk_path)
    write_train_config(tmp, replace(best.config, store=store))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


@dataclass
class Choice:
    """What ``choose_by_validation`` measured: each value's best validation value."""

    key: str
    chosen: Any
    values: dict[Any, float | None]

    def summary(self) -> dict[str, Any]:
        return {"key": self.key, "chosen": self.chosen,
                "validation": [{"value": v, "best": b} for v, b in self.values.items()]}


def choose_by_validation(schema: FeatureSchema, base: TrainConfig, key: str,
                         choices: Sequence[Any],
                         train_paths: Sequence[str | Path | InputFile],
                         valid_batches: list[Batch], scratch: str | Path, *,
                         select_by: str = "logloss", patience: int | None = 2,
                         ctx: DistContext | None = None) -> Choice:
    """The value of ``key`` (a dotted config path) among ``choices`` whose run reaches
    the best validation value: one trial per value, trained side by side in one pass
    loop (``run_search``: grid, no pruning), in ``scratch``, which is removed after.
    A default the data decides, as scikit-learn's ``LogisticRegressionCV`` picks C."""
    ctx = ctx if ctx is not None else DistContext.single(resolve_device(base.device))
    scratch = Path(scratch)
    if ctx.is_main:  # a run stopped while choosing left its trials: start them again
        shutil.rmtree(scratch, ignore_errors=True)
    ctx.barrier()
    # No try/finally: a rank that fails exits rather than wait for its peers in a
    # barrier; the next run removes what it left.
    result = run_search(schema, base, train_paths, valid_batches, scratch,
                        trials=len(choices),
                        space={key: {"type": "categorical", "choices": list(choices)}},
                        sampler="grid", pruner="none", select_by=select_by,
                        patience=patience, seed=base.seed, ctx=ctx)
    if ctx.is_main:  # every rank is past the search's closing barrier
        shutil.rmtree(scratch, ignore_errors=True)
    reached = {t.params[key]: t.selection.best_value for t in result.trials}
    values = {c: reached[c] for c in choices}
    if result.best is None:
        raise ValueError(f"choosing {key} by validation: no trial reached a finite "
                         "validation value")
    return Choice(key, result.best.params[key], values)


def write_results(result: SearchResult, out_dir: str | Path) -> tuple[Path, Path]:
    """results.json and results.csv: one row per trial, best first."""
    out_dir = Path(out_dir)
    rows = result.rows()
    best = result.best.number if result.best else None
    rows.sort(key=lambda r: (r["trial"] != best, r["state"] != "complete"))
    payload = {"best_trial": best, "best_dir": str(result.best_dir) if result.best_dir
               else None, "seconds": result.seconds, "trials": rows}
    json_path = out_dir / "results.json"
    atomic_write_text(json_path, finite_json(payload, indent=2))
    columns = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    csv_path = out_dir / "results.csv"
    atomic_write_text(csv_path, buf.getvalue())
    return json_path, csv_path


def param_importances(study) -> dict[str, float]:
    """optuna's parameter importances (fANOVA), or {} when too few trials finished or no
    parameter varied."""
    import optuna

    complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    if len(complete) < 2:
        return {}
    try:
        return dict(optuna.importance.get_param_importances(study))
    except (RuntimeError, ValueError, ZeroDivisionError):
        return {}


def write_search_report(result: SearchResult, out_dir: str | Path) -> Path:
    """The HTML report: per-trial validation curves, importances, the results table."""
    from terarec.report import write_search_report as write_page

    metric = result.trials[0].selection.select_by if result.trials else "logloss"
    curves = {}
    for t in result.trials:
        points = [(h["pass_id"] + 1, h[f"valid_{metric}"]) for h in t.history
                  if math.isfinite(h.get(f"valid_{metric}", math.nan))]
        curves[f"trial {t.number}{' (pruned)' if t.state == 'pruned' else ''}"] = (
            [x for x, _ in points], [y for _, y in points])
    best = result.best
    summary = {"trials": len(result.trials),
               "pruned": sum(t.state == "pruned" for t in result.trials),
               "best trial": best.number if best else None,
               f"best validation {metric}": best.selection.best_value if best else None,
               "best model directory": str(result.best_dir) if result.best_dir else None,
               "seconds": result.seconds,
               **({f"best {k}": v for k, v in best.params.items()} if best else {})}
    rows = sorted(result.rows(), key=lambda r: (best is None or r["trial"] != best.number,
                                                r["state"] != "complete"))
    return write_page(out_dir, rows, curves, param_importances(result.study), metric,
                      summary)
