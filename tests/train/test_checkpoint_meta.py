"""meta.json is validated before a checkpoint is trusted; errors name the file and path."""

import json

import pytest

from terarec.config import ModelConfig, TrainConfig
from terarec.modeldir import CheckpointError, save_checkpoint, verify_checkpoint
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema, FieldSpec


@pytest.fixture
def checkpoint(tmp_path):
    schema = FeatureSchema(label="y", fields=(FieldSpec("c", "categorical"),))
    trainer = Trainer(schema, TrainConfig(threads=1, model=ModelConfig(name="lr")))
    return save_checkpoint(tmp_path / "model", trainer)


META_ERRORS = [
    (lambda m: m.update(pass_id="3"), "pass_id must be an integer, got string '3'"),
    (lambda m: m.update(pass_id=-1), "pass_id: -1 must be >= 0"),
    (lambda m: m.pop("sha256"), "missing field(s) ['sha256']"),
    (lambda m: m.update(sparse_format="zip"), "sparse_format: 'zip' is not one of arrays, tiered"),
    (lambda m: m["rng"].update(torch=[1, 300]), "rng.torch[1]: 300 must be <= 255"),
    (lambda m: m.update(sha256={"dense.safetensors": 5}),
     "sha256['dense.safetensors'] must be a string, got integer 5"),
]


@pytest.mark.parametrize(("edit", "message"), META_ERRORS,
                         ids=[m.split(":")[0].split(" ")[0] for _, m in META_ERRORS])
def test_bad_meta_is_refused_naming_the_path(checkpoint, edit, message):
    verify_checkpoint(checkpoint)
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["writer_note"] = "extra keys are kept"
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    assert verify_checkpoint(checkpoint)["writer_note"] == "extra keys are kept"
    edit(meta)
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(checkpoint)
    assert "meta.json: " in str(info.value) and message in str(info.value)
