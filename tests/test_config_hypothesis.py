"""Arbitrary config values (hypothesis): a TrainConfig document is either accepted with
every value in range, or refused with one ``InvalidInput`` naming each bad JSON path;
never another exception, and never a value accepted that a run could not use."""

from __future__ import annotations

import dataclasses
import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from terarec.config import TrainConfig, flag_fields, from_dict, parse_bytes, to_dict
from terarec.validation import InvalidInput

scalars = (st.none() | st.booleans() | st.integers(-10, 10) | st.integers()
           | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from(["", "fp32", "int3", "adam", "cpu", "cuda", "tpu", "1KB",
                              "2GB", "4096", "nan", "skip", "lfu"]) | st.text(max_size=8))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
PATHS = [path for path, _, _, _ in flag_fields()] + [
    ("model", "bottom_mlp"), ("model", "cross_layers"), ("sparse_optimizer", "beta1"),
    ("store", "class_precisions"), ("dense_optimizer", "name"), ("unknown_key",),
    ("store", "nope")]


def _document(assignments: list[tuple[tuple[str, ...], object]]) -> dict:
    doc: dict = {}
    for path, value in assignments:
        node = doc
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                break
        else:
            node[path[-1]] = value
    return doc


def _check_accepted(config: TrainConfig) -> None:
    """What a run relies on, whatever the document said."""
    def walk(node: object) -> None:
        if dataclasses.is_dataclass(node):
            for f in dataclasses.fields(node):
                walk(getattr(node, f.name))
        elif isinstance(node, float):
            assert math.isfinite(node)
        elif isinstance(node, tuple):
            for item in node:
                walk(item)

    walk(config)
    assert config.batch_size > 0 and config.pass_rows > 0 and config.epochs > 0
    assert config.sparse_optimizer.lr > 0 and config.dense_optimizer.lr > 0
    assert config.store.admit_min_count >= 0
    assert config.store.evict_after_passes is None or config.store.evict_after_passes > 0
    assert config.threads is None or config.threads > 0
    if config.store.memory_budget is not None:
        assert parse_bytes(config.store.memory_budget) > 0
    assert len(config.store.promote_at) == len(config.store.variable_dims)
    # an accepted config survives its own train_config.json
    assert from_dict(TrainConfig, json.loads(json.dumps(to_dict(config)))) == config


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(PATHS), values), max_size=4))
def test_any_document_is_accepted_in_range_or_refused_by_path(assignments):
    doc = _document(assignments)
    try:
        config = from_dict(TrainConfig, doc, "cfg.json")
    except InvalidInput as exc:
        assert str(exc).startswith("cfg.json: ") and "\n" not in str(exc)
        assert exc.problems and all(p.message for p in exc.problems)
        named = " ".join(p.message for p in exc.problems)
        # each refused top-level key appears in the message
        assert any(key in named for key in doc), (doc, named)
    else:
        _check_accepted(config)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_any_file_content_is_a_config_or_a_named_error(tmp_path_factory, raw):
    from terarec.config import load_train_config

    path = tmp_path_factory.mktemp("cfg") / "cfg.json"
    path.write_bytes(raw)
    try:
        config = load_train_config(path)
    except InvalidInput as exc:
        assert str(exc).startswith(f"{path}: ") and str(exc).isprintable()
    else:
        _check_accepted(config)
