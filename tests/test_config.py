import pytest

from terarec.config import TrainConfig, from_dict, to_dict


def test_nested_config_roundtrip():
    cfg = from_dict(TrainConfig, {"batch_size": 64, "model": {"name": "dlrm", "top_mlp": [8, 4]}})
    assert cfg.batch_size == 64 and cfg.model.top_mlp == (8, 4)
    assert from_dict(TrainConfig, to_dict(cfg)) == cfg


def test_unknown_keys_are_rejected_with_their_path():
    with pytest.raises(ValueError, match=r"config\.sparse_optimizer: unknown keys \['lrr'\]"):
        from_dict(TrainConfig, {"sparse_optimizer": {"lrr": 0.1}})
