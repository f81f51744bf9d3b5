import json
import math

import pytest

from terarec.config import TrainConfig, from_dict, load_train_config, to_dict
from terarec.validation import InvalidInput


def test_nested_config_roundtrip():
    cfg = from_dict(TrainConfig, {"batch_size": 64, "model": {"name": "dlrm", "top_mlp": [8, 4]}})
    assert cfg.batch_size == 64 and cfg.model.top_mlp == (8, 4)
    assert from_dict(TrainConfig, to_dict(cfg)) == cfg


def test_unknown_keys_are_rejected_with_their_path():
    with pytest.raises(ValueError, match=r"sparse_optimizer: unknown field\(s\) \['lrr'\]; "
                                         r"known: name, lr"):
        from_dict(TrainConfig, {"sparse_optimizer": {"lrr": 0.1}})


BAD = [
    ({"batch_size": "4096"}, "batch_size must be an integer, got string '4096'"),
    ({"batch_size": 4096.0}, "batch_size must be an integer, got number 4096.0"),
    ({"batch_size": True}, "batch_size must be an integer, got boolean true"),
    ({"batch_size": -1}, "batch_size: -1 must be > 0"),
    ({"epochs": 0}, "epochs: 0 must be > 0"),
    ({"store": {"precision": "int3"}},
     "store.precision: 'int3' is not one of fp32, fp16, int8, int4"),
    ({"store": {"class_precisions": ["fp16", "int3"]}},
     "store.class_precisions[1]: 'int3' is not one of fp32, fp16, int8, int4"),
    ({"sparse_optimizer": {"lr": 0}}, "sparse_optimizer.lr: 0 must be > 0"),
    ({"sparse_optimizer": {"lr": math.nan}}, "sparse_optimizer.lr: nan is not a finite number"),
    ({"dense_optimizer": {"lr": math.inf}}, "dense_optimizer.lr: inf is not a finite number"),
    ({"dense_optimizer": {"lr": 1e300}}, "dense_optimizer.lr: 1e+300 must be <= 1000.0"),
    ({"sparse_optimizer": {"beta1": 1.0}}, "sparse_optimizer.beta1: 1.0 must be < 1"),
    ({"model": {"top_mlp": [8, -4]}}, "model.top_mlp[1]: -4 must be > 0"),
    ({"model": {"dropout": -0.1}}, "model.dropout: -0.1 must be >= 0"),
    ({"store": {"memory_budget": "5XB"}}, "store.memory_budget: size '5XB': expected a number"),
    ({"store": {"memory_budget": 1.5}},
     "store.memory_budget: expected an integer or a string, got number 1.5"),
    ({"store": "big"}, "store must be an object, got string 'big'"),
    ({"on_bad_row": "ignore"}, "on_bad_row: 'ignore' is not one of error, skip"),
    ({"threads": 0}, "threads: 0 must be > 0"),
    ({"model": {"name": "deepfn"}}, "model.name: unknown model 'deepfn'; known models: lr, fm, "
                                    "widedeep, deepfm, dcnv2, dlrm, dssm"),
]


@pytest.mark.parametrize(("data", "message"), BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_values_name_their_path_and_value(data, message):
    with pytest.raises(InvalidInput) as info:
        from_dict(TrainConfig, data)
    assert message in str(info.value)


def test_good_values_pass_and_json_arrays_fill_tuples():
    cfg = from_dict(TrainConfig, {"threads": None, "store": {
        "memory_budget": "2GB", "variable_dims": [1, 4], "promote_at": [3, 20.5],
        "class_precisions": ["int4", "int8", "fp16"]}})
    assert cfg.store.memory_budget == "2GB" and cfg.store.variable_dims == (1, 4)
    assert cfg.store.promote_at == (3.0, 20.5) and cfg.threads is None


def test_every_problem_is_reported_at_once():
    with pytest.raises(InvalidInput) as info:
        from_dict(TrainConfig, {"epochs": 0, "device": 3})
    assert [p.path for p in info.value.problems] == ["epochs", "device"]
    assert "device must be a string, got integer 3" in str(info.value)


def test_config_file_errors_name_the_file(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"store": {"precision": "int3"}}))
    with pytest.raises(ValueError, match=r"cfg\.json: store\.precision: 'int3' is not one of"):
        load_train_config(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"cfg\.json: config must be an object, got array"):
        load_train_config(path)
    path.write_text('{"batch_size": ')
    with pytest.raises(ValueError, match=r"cfg\.json: config: invalid JSON"):
        load_train_config(path)


def test_a_key_given_twice_is_refused_naming_its_path(tmp_path):
    """JSON parsers keep a repeated key's last value: the first was silently ignored."""
    path = tmp_path / "cfg.json"
    path.write_text('{"batch_size": 64, "batch_size": 128}')
    with pytest.raises(ValueError, match=r"cfg\.json: batch_size: key given twice"):
        load_train_config(path)
    path.write_text('{"epochs": 2, "store": {"max_keys": 5, "precision": "fp16", '
                    '"max_keys": 6}}')
    with pytest.raises(ValueError, match=r"cfg\.json: store\.max_keys: key given twice"):
        load_train_config(path)
    path.write_text('{"store": {"max_keys": 5}, "model": {"max_keys": 5}}')  # not repeats
    with pytest.raises(ValueError, match=r"model: unknown field\(s\) \['max_keys'\]"):
        load_train_config(path)


def test_a_byte_order_mark_is_not_part_of_the_json(tmp_path):
    """Editors on Windows start UTF-8 files with a byte order mark; the file was refused
    as invalid JSON at line 1 column 1, and the keys it sets are read past it too."""
    from terarec.config import config_file_keys

    path = tmp_path / "cfg.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"batch_size": 64,
                                                  "model": {"name": "lr"}}).encode())
    assert load_train_config(path).batch_size == 64
    assert config_file_keys(path) == {"batch_size", "model.name"}


def test_a_yaml_config_is_refused_as_such(tmp_path):
    """A YAML file was refused as "invalid JSON (expected value at line 1 column 1)"."""
    path = tmp_path / "cfg.yaml"
    path.write_text("batch_size: 64\n")
    with pytest.raises(ValueError, match=r"cfg\.yaml: a config file is JSON, not YAML"):
        load_train_config(path)
    path.write_text('{"batch_size": 64}')  # JSON is YAML too: read as it always was
    assert load_train_config(path).batch_size == 64
