"""Search spaces: which config values a trial may take, read and checked before any work.

A space maps dotted ``TrainConfig`` paths to specs, ``{type: float|int, low, high[,
log, step]}`` or ``{type: categorical, choices: [...]}``; every value a trial can get is
checked as a config file's would be, so a bad one is an error naming its parameter
before the search starts, not in the middle of it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from terarec.config import TrainConfig, read_only_by, refuse_yaml, repeated_key, to_dict

if TYPE_CHECKING:
    from optuna.trial import Trial

Space = dict[str, dict[str, Any]]
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


def default_space(model: str, base: TrainConfig | None = None) -> Space:
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


def load_space(path: str | Path, base: TrainConfig) -> Space:
    """A search space from a JSON file: ``{"dotted.config.path": spec}`` where a
    spec is ``{type: float|int, low, high[, log, step]}`` or ``{type: categorical,
    choices: [...]}`` (``[a, b, c]`` alone means categorical)."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not a text file"
        raise ValueError(f"{path}: cannot read search space: {why}") from None
    refuse_yaml(path, text, "a search space", '{"model.embedding_dim": [8, 16]}')
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    repeated = repeated_key(text)
    if repeated is not None:  # json keeps the last one: the first would be ignored
        raise ValueError(f"{path}: {repeated}: key given twice in one object; keep one")
    return check_space(data, base, str(path))


# How the shared pass loop reads the data: one setting for every trial of a search.
SHARED_FIELDS = ("pass_rows", "shuffle", "on_bad_row")

_SPEC_KEYS = {"categorical": {"type", "choices"},
              "float": {"type", "low", "high", "log", "step"},
              "int": {"type", "low", "high", "log", "step"}}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def check_space(data: Any, base: TrainConfig, where: str = "space"
                ) -> Space:
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
        from terarec.train.cohort import apply_params  # the trainer: not for --help

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


def suggest(trial: Trial, space: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
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
def check_batch_sizes(spec: dict[str, Any], world: int) -> None:
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
