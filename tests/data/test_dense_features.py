"""``dense_features`` builds its per-field constants once per schema: the values must be
those of the plain per-field definition, and a changed schema must not reuse another's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from terarec.data.readers import MAX_STANDARDISED, dense_features
from terarec.types import FeatureSchema, FieldSpec


def _schema(missing_flags: bool) -> FeatureSchema:
    return FeatureSchema(label="label", missing_flags=missing_flags, fields=(
        FieldSpec("a", "numeric", transform="log1p", mean=1.0, std=2.0),
        FieldSpec("c", "categorical"),
        FieldSpec("b", "numeric"),                                  # raw, not standardised
        FieldSpec("d", "numeric", transform="log1p"),              # log1p, not standardised
        FieldSpec("e", "numeric", mean=-3.0, std=0.5),              # raw, standardised
        FieldSpec("f", "numeric", transform="log1p", mean=0.0, std=1e-6)))  # clipped


def _reference(numeric: np.ndarray, schema: FeatureSchema) -> np.ndarray:
    """One field at a time, as the definition reads."""
    specs = schema.numeric
    n = numeric.shape[1]
    out = np.zeros((n, schema.dense_dim), np.float32)
    for j, spec in enumerate(specs):
        x = numeric[j]
        missing = np.isnan(x)
        if spec.transform == "log1p":
            x = np.sign(x) * np.log1p(np.abs(x))
        if spec.std is not None:
            x = np.clip((x - spec.mean) / spec.std, -MAX_STANDARDISED, MAX_STANDARDISED)
        out[:, j] = np.where(missing, 0.0, x)
        if schema.missing_flags:
            out[:, len(specs) + j] = missing
    return out


@pytest.mark.parametrize("missing_flags", [True, False])
@pytest.mark.parametrize("rows", [1, 7])
def test_dense_features_match_the_per_field_definition(missing_flags: bool, rows: int
                                                       ) -> None:
    schema = _schema(missing_flags)
    rng = np.random.default_rng(rows)
    numeric = rng.normal(0, 50, (5, rows))
    numeric[rng.random((5, rows)) < 0.3] = np.nan
    numeric[:, 0] = [np.nan, 0.0, -7.5, 1e30, 2.0]  # a missing value, zero, big values
    got = dense_features(numeric, schema)
    assert got.dtype == np.float32 and got.shape == (rows, schema.dense_dim)
    np.testing.assert_array_equal(got, _reference(numeric, schema))
    np.testing.assert_array_equal(numeric[:, 0], [np.nan, 0.0, -7.5, 1e30, 2.0])  # untouched


def test_a_changed_schema_gets_its_own_constants() -> None:
    schema = _schema(True)
    numeric = np.array([[3.0], [4.0], [5.0], [6.0], [7.0]])
    first = dense_features(numeric, schema)
    moved = replace(schema, fields=tuple(
        replace(f, mean=f.mean + 1.0) if f.mean is not None else f for f in schema.fields))
    np.testing.assert_array_equal(dense_features(numeric, moved), _reference(numeric, moved))
    assert not np.array_equal(dense_features(numeric, moved), first)
    np.testing.assert_array_equal(dense_features(numeric, schema), first)  # still its own


def test_schema_field_lists_follow_replace() -> None:
    schema = _schema(True)
    assert [f.name for f in schema.numeric] == ["a", "b", "d", "e", "f"]
    assert schema.dense_dim == 10 and schema.sparse_names == ("c",)
    fewer = replace(schema, fields=schema.fields[:3], missing_flags=False)
    assert [f.name for f in fewer.numeric] == ["a", "b"]
    assert fewer.dense_dim == 2 and fewer.sparse_names == ("c",)
    assert schema.numeric is schema.numeric  # computed once
