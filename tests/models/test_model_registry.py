"""Name lookup, config validation with readable errors, and the public signatures."""

from __future__ import annotations

import inspect

import pytest
from model_helpers import (
    MODEL_NAMES,
    MULTI_TASK_NAMES,
    SEQUENCE_MODEL_NAMES,
    small_config,
    tiny_schema,
)

import terarec.models as models
from terarec.config import ModelConfig, from_dict
from terarec.models import MODELS, CTRModel, build_model, model_class, row_dim_for


def test_registry_holds_exactly_the_documented_models() -> None:
    assert tuple(MODELS) == MODEL_NAMES + SEQUENCE_MODEL_NAMES + MULTI_TASK_NAMES
    for name, cls in MODELS.items():
        assert issubclass(cls, CTRModel)
        assert model_class(name.upper()) is cls


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_build_model_picks_the_class_and_row_dim_for_agrees(name: str) -> None:
    schema = tiny_schema()
    config = small_config(name, schema)
    model = build_model(schema, config)
    assert type(model) is MODELS[name]
    assert row_dim_for(name, config) == model.row_dim


def test_configs_accept_exactly_the_registered_models() -> None:
    """config.py checks model names without importing the models: the lists agree."""
    from terarec.config import MODEL_NAMES as CONFIG_NAMES

    assert tuple(MODELS) == CONFIG_NAMES


def test_unknown_model_name_lists_the_known_ones() -> None:
    schema = tiny_schema()
    with pytest.raises(ValueError, match="unknown model 'deepfn'; known models: lr, fm, "
                                         "widedeep, deepfm, dcnv2, dlrm, dssm"):
        build_model(schema, ModelConfig(name="deepfn"))
    with pytest.raises(ValueError, match="unknown model 'xdeepfm'"):
        row_dim_for("xdeepfm", ModelConfig())


def test_dlrm_rejects_bottom_mlp_not_ending_at_embedding_dim() -> None:
    schema = tiny_schema()
    bad = small_config("dlrm", schema, embedding_dim=16, bottom_mlp=(64, 32))
    message = r"bottom_mlp's last width must equal embedding_dim \(16\).*last width 32"
    with pytest.raises(ValueError, match=message):
        build_model(schema, bad)
    with pytest.raises(ValueError, match=message):  # caught before the store is sized
        row_dim_for("dlrm", bad)
    with pytest.raises(ValueError, match="last width none"):
        build_model(schema, small_config("dlrm", schema, bottom_mlp=()))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"embedding_dim": 0}, "embedding_dim must be >= 1, got 0"),
    ({"dropout": 1.0}, r"dropout must be in \[0, 1\), got 1.0"),
    ({"deep_mlp": (32, 0)}, r"deep_mlp widths must be >= 1, got \(32, 0\)"),
])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_shared_config_errors(name: str, overrides: dict, message: str) -> None:
    schema = tiny_schema()
    with pytest.raises(ValueError, match=message):
        build_model(schema, small_config(name, schema, **overrides))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"cross_layers": -1}, "cross_layers must be >= 0, got -1"),
    ({"cross_rank": -2}, "cross_rank must be >= 0"),
])
def test_dcnv2_config_errors(overrides: dict, message: str) -> None:
    schema = tiny_schema()
    with pytest.raises(ValueError, match=message):
        build_model(schema, small_config("dcnv2", schema, **overrides))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"user_fields": ()}, r"user_fields is empty.*\['user', 'item', 'ctx'\]"),
    ({"user_fields": ("usr",)}, r"user_fields \['usr'\] are not categorical fields"),
    ({"user_fields": ("x1",)}, r"user_fields \['x1'\] are not categorical fields"),
    ({"user_fields": ("user",), "item_fields": ("itm",)}, r"item_fields \['itm'\]"),
    ({"user_fields": ("user", "user")}, "user_fields repeats a field"),
    ({"user_fields": ("user", "item"), "item_fields": ("item",)},
     r"fields \['item'\] are in both"),
    ({"user_fields": ("user", "item", "ctx")}, "no item-side fields left"),
    ({"tower_similarity": "euclid"}, "tower_similarity must be one of"),
    ({"cosine_scale": 0.0}, "cosine_scale must be > 0"),
    ({"deep_mlp": ()}, "deep_mlp must have at least one width"),
])
def test_dssm_config_errors(overrides: dict, message: str) -> None:
    schema = tiny_schema()
    with pytest.raises(ValueError, match=message):
        build_model(schema, small_config("dssm", schema, **overrides))


def test_model_config_from_json_mapping_builds_a_two_tower_model() -> None:
    config = from_dict(ModelConfig, {"name": "dssm", "user_fields": ["user"],
                                     "item_fields": ["item", "ctx"], "deep_mlp": [16, 8]})
    assert config.user_fields == ("user",)
    model = build_model(tiny_schema(), config)
    assert model.item_fields == ("item", "ctx")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \[.user_field.\]"):
        from_dict(ModelConfig, {"name": "dssm", "user_field": ["user"]})


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


POS = inspect.Parameter.POSITIONAL_OR_KEYWORD


def test_public_signatures_are_stable() -> None:
    """Guard: other packages build and call models only through these signatures."""
    for cls in MODELS.values():
        assert _params(cls.__init__) == [("self", POS), ("schema", POS), ("config", POS)]
        # DSSM's forward also gives its towers' vectors (sampled softmax through DDP)
        extra = [("towers", inspect.Parameter.KEYWORD_ONLY)] if cls is models.DSSM else []
        if cls.uses_sequences:  # the sequence fields' rows (models/sequence.py)
            extra = [("sequences", POS)]
        assert _params(cls.forward) == [("self", POS), ("dense", POS), ("emb", POS), *extra]
        assert _params(cls.row_dim_for) == [("config", POS)]
    assert _params(build_model) == [("schema", POS), ("config", POS)]
    assert _params(row_dim_for) == [("name", POS), ("config", POS)]
    assert _params(models.DSSM.user_embedding) == [("self", POS), ("dense", POS),
                                                   ("user_emb", POS)]
    assert _params(models.DSSM.item_embedding) == [("self", POS), ("item_emb", POS)]
    assert set(models.__all__) >= {"CTRModel", "LR", "FM", "WideDeep", "DeepFM", "DCNv2",
                                   "DLRM", "DSSM", "build_model", "row_dim_for", "MODELS"}
