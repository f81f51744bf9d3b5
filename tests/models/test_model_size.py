"""Sizes that cannot fit the machine are refused up front, in one line naming the bytes
they would need: they ended in an allocator's traceback (``--embedding-dim 100000``) or
built a network for minutes in silence (``model.cross_layers: 100000``)."""

from __future__ import annotations

import json
import time

import pytest

from terarec.cli.main import main
from terarec.config import ModelConfig
from terarec.data.synth import generate
from terarec.models import build_model
from terarec.models.registry import check_model_fits, dense_param_bytes
from terarec.types import FeatureSchema

SCHEMA = FeatureSchema.criteo()


@pytest.mark.parametrize("name", ["lr", "fm", "widedeep", "deepfm", "dcnv2", "dlrm"])
def test_dense_bytes_are_counted_without_allocating(name):
    config = ModelConfig(name=name, cross_layers=5)
    model = build_model(SCHEMA, config)
    assert dense_param_bytes(SCHEMA, config) == sum(p.numel() * p.element_size()
                                                    for p in model.parameters())


def test_a_default_model_fits():
    check_model_fits(SCHEMA, ModelConfig(name="dcnv2"), 4096)


def test_a_hundred_thousand_cross_layers_are_refused_at_once():
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"needs about .* \(\d+ bytes: \d+ for its dense"):
        check_model_fits(SCHEMA, ModelConfig(name="dcnv2", cross_layers=100_000), 256)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("extra,config", [
    (["--embedding-dim", "10000000"], None),
    (["--model", "dcnv2"], {"model": {"name": "dcnv2", "cross_layers": 100000}}),
])
def test_train_refuses_a_model_too_large_in_one_line(tmp_path, capsys, extra, config):
    data = tmp_path / "f.tsv"
    generate(data, 300, model_seed=1, sample_seed=1)
    args = ["train", "--train", str(data), "--out", str(tmp_path / "m"), "--no-progress",
            "--threads", "1", *extra]
    if config is not None:
        (tmp_path / "c.json").write_text(json.dumps(config))
        args += ["--config", str(tmp_path / "c.json")]
    started = time.monotonic()
    assert main(args) == 2
    assert time.monotonic() - started < 60
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "needs about" in err[0] and "this machine has" in err[0], err
