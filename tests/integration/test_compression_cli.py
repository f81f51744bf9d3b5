"""``terarec train`` with compressed rows, as a user runs it."""

import argparse
import json

import pytest

from terarec.cli.common import add_train_args, config_from_args
from terarec.cli.main import main
from terarec.data.synth import generate

FAST = ["--no-progress", "--batch-size", "1024", "--pass-rows", "2500", "--seed", "0",
        "--model", "fm", "--embedding-dim", "31"]


def test_compression_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    args = parser.parse_args(["--precision", "int4", "--stochastic-rounding",
                              "--variable-dims", "1,8", "--promote-at", "3,20",
                              "--group-lasso", "0.01"])
    config = config_from_args(args)
    assert config.store.precision == "int4" and config.store.stochastic_rounding
    assert config.store.variable_dims == (1, 8) and config.store.promote_at == (3.0, 20.0)
    assert config.sparse_optimizer.group_lasso == 0.01
    defaults = config_from_args(parser.parse_args([]))
    assert defaults.store.precision == "fp32" and not defaults.store.stochastic_rounding
    with pytest.raises(SystemExit):
        parser.parse_args(["--variable-dims", "1,x"])


def test_train_int8_variable_rows_with_group_lasso(tmp_path):
    train, valid = tmp_path / "train.tsv", tmp_path / "valid.tsv"
    generate(train, 10_000, model_seed=3, sample_seed=1)
    generate(valid, 3_000, model_seed=3, sample_seed=2)
    out = tmp_path / "small"
    assert main(["train", "--train", str(train), "--valid", str(valid), "--out", str(out),
                 *FAST, "--precision", "int8", "--stochastic-rounding", "--variable-dims",
                 "1,8", "--promote-at", "3,20", "--group-lasso", "1e-4"]) == 0
    small = json.loads((out / "metrics.json").read_text())
    assert small["store_precision"] == "int8" and small["pruned_keys"] > 0
    # rows of 32 floats are 128 B in fp32; most keys are rare and keep 1 value (fp16, 2 B)
    assert 2 <= small["store_bytes_per_key"] < 0.25 * 128
    assert small["auc"] > 0.55
    saved = json.loads((tmp_path / "small" / "train_config.json").read_text())
    assert saved["store"]["precision"] == "int8" and saved["store"]["variable_dims"] == [1, 8]
    # the saved model reloads with its compressed store and scores as at the end of training
    scored = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tmp_path / "small"), "--data", str(valid),
                 "--out", str(scored)]) == 0
    assert json.loads(scored.read_text())["auc"] == pytest.approx(small["auc"], abs=2e-3)
