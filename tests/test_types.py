import json

import pytest
import torch

from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds


def jagged() -> KeyedIds:
    # the layout of the KeyedIds docstring: fields a, b; batch of 3
    values = torch.tensor([11, 12, 13, 21, 22, 23, 24])
    lengths = torch.tensor([2, 1, 0, 1, 1, 2])
    return KeyedIds.from_lengths(("a", "b"), values, lengths)


def test_offsets_and_derived_views():
    kid = jagged()
    assert kid.batch_size == 3
    assert kid.offsets.tolist() == [0, 2, 3, 3, 4, 5, 7]
    assert kid.lengths.tolist() == [2, 1, 0, 1, 1, 2]
    assert kid.field_values("b").tolist() == [21, 22, 23, 24]
    assert not kid.one_per_slot


def test_slice_select_concat_roundtrip():
    kid = jagged()
    head, tail = kid.slice(0, 1), kid.slice(1, 3)
    assert head.values.tolist() == [11, 12, 21]
    assert tail.values.tolist() == [13, 22, 23, 24]
    back = KeyedIds.concat([head, tail])
    assert torch.equal(back.values, kid.values) and torch.equal(back.offsets, kid.offsets)
    only_b = kid.select_fields(["b"])
    assert only_b.values.tolist() == [21, 22, 23, 24] and only_b.batch_size == 3


def test_dense_layout_is_one_per_slot_and_sample_major():
    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    kid = KeyedIds.from_dense(("a", "b"), ids)
    assert kid.one_per_slot
    assert kid.values.tolist() == [1, 3, 5, 2, 4, 6]  # field-major
    assert torch.equal(kid.sample_major, ids)


def test_int64_is_enforced():
    with pytest.raises(TypeError, match="int64"):
        KeyedIds(("a",), torch.tensor([1.0]), torch.tensor([0, 1]))
    big = 2**62 + 1  # not representable in float32: ids must never pass through floats
    kid = KeyedIds.from_dense(("a",), torch.tensor([[big]]))
    assert int(kid.values[0]) == big


def test_batch_checks_sizes_and_slices():
    kid = jagged()
    batch = Batch(torch.zeros(3, 2), kid, torch.tensor([0.0, 1.0, 0.0]))
    assert len(batch) == 3
    assert len(batch.slice(1, 3)) == 2
    with pytest.raises(ValueError, match="batch sizes differ"):
        Batch(torch.zeros(2, 2), kid, torch.zeros(3))


def test_schema_json_roundtrip(tmp_path):
    schema = FeatureSchema.criteo()
    path = tmp_path / "schema.json"
    schema.save(path)
    loaded = FeatureSchema.load(path)
    assert loaded == schema
    assert loaded.dense_dim == 26 and len(loaded.sparse_names) == 26


def test_schema_rejects_unknown_keys():
    d = FeatureSchema(label="y", fields=(FieldSpec("c", "categorical"),)).to_dict()
    d["typo"] = 1
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['typo'\]"):
        FeatureSchema.from_dict(d)


def _schema_dict() -> dict:
    return FeatureSchema(label="y", fields=(FieldSpec("n", "numeric"),
                                            FieldSpec("c", "categorical"))).to_dict()


SCHEMA_ERRORS = [
    (lambda d: d["fields"][1].update(kind="categorcal"),
     "fields[1].kind: 'categorcal' is not one of numeric, categorical"),
    (lambda d: d["fields"][0].update(transform="log"),
     "fields[0].transform: 'log' is not one of none, log1p"),
    (lambda d: d["fields"][1].update(pooling="max"),
     "fields[1].pooling: 'max' is not one of sum, mean"),
    (lambda d: d["fields"][1].pop("kind"), "fields[1]: missing field(s) ['kind']"),
    (lambda d: d["fields"][0].update(sep="|"), "fields[0]: unknown field(s) ['sep']"),
    (lambda d: d.update(missing_flags="yes"), "missing_flags must be a boolean, got string"),
    (lambda d: d.update(fields={"n": "numeric"}), "fields must be an array, got object"),
    (lambda d: d.update(label=None), "label must be a string, got null"),
    (lambda d: d["fields"][1].update(name="n"), "fields[1].name: 'n' repeats fields[0]"),
    (lambda d: d["fields"][1].update(name="y"), "label: 'y' is also an input field"),
    (lambda d: d.update(schema_version=2), "schema_version: 2 is not 1"),
]


@pytest.mark.parametrize(("edit", "message"), SCHEMA_ERRORS,
                         ids=[m.split(":")[0] for _, m in SCHEMA_ERRORS])
def test_schema_errors_name_the_path(tmp_path, edit, message):
    d = _schema_dict()
    edit(d)
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError) as info:
        FeatureSchema.load(path)
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def test_per_schema_builds_once_per_schema_object() -> None:
    from dataclasses import replace

    from terarec.types import FeatureSchema, per_schema

    calls: list[FeatureSchema] = []

    def build(schema: FeatureSchema) -> int:
        calls.append(schema)
        return len(schema.numeric)

    derived = per_schema(build)
    schema = FeatureSchema.criteo()
    assert derived(schema) == derived(schema) == 13 and len(calls) == 1
    fewer = replace(schema, fields=schema.fields[1:])  # a new object: built again
    assert derived(fewer) == 12 and len(calls) == 2
    assert fewer == replace(fewer) and derived(schema) == 13 and len(calls) == 2
