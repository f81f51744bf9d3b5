"""Training flags are generated from TrainConfig; given flags override the --config file."""

import argparse
import json

import pytest

from terarec.cli.common import add_format_args, add_train_args, config_from_args
from terarec.cli.main import main
from terarec.config import flag_fields


@pytest.fixture
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_format_args(p)
    add_train_args(p)
    return p


def write_config(tmp_path, data: dict):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_config_file_values_hold_when_their_flags_are_not_given(parser, tmp_path):
    cfg = write_config(tmp_path, {"on_bad_row": "skip", "batch_size": 256,
                                  "store": {"precision": "int8", "stochastic_rounding": True},
                                  "model": {"name": "fm"}})
    config = config_from_args(parser.parse_args(["--config", cfg]))
    assert config.on_bad_row == "skip" and config.batch_size == 256
    assert config.store.precision == "int8" and config.store.stochastic_rounding
    assert config.model.name == "fm"


def test_given_flags_override_the_config_file(parser, tmp_path):
    cfg = write_config(tmp_path, {"on_bad_row": "skip", "batch_size": 256,
                                  "store": {"stochastic_rounding": True}})
    config = config_from_args(parser.parse_args(
        ["--config", cfg, "--on-bad-row", "error", "--batch-size", "64",
         "--no-stochastic-rounding", "--model", "dlrm"]))
    assert config.on_bad_row == "error" and config.batch_size == 64
    assert not config.store.stochastic_rounding and config.model.name == "dlrm"


def test_no_flags_no_file_gives_the_defaults(parser):
    config = config_from_args(parser.parse_args([]))
    assert config.on_bad_row == "error" and config.batch_size == 4096
    assert config.store.disk_path is None


def test_every_config_flag_reaches_its_field(parser):
    """Each generated flag writes the field it was generated from."""
    samples = {int: "7", float: "0.5", str: "x"}
    for path, flag, _, _ in flag_fields():
        action = next(a for a in parser._actions if flag.name in a.option_strings)
        if action.choices:
            value = list(action.choices)[-1]
            argv = [flag.name, value]
        elif action.nargs == 0:
            argv, value = [flag.name], True
        elif path[-1] in ("variable_dims", "promote_at"):
            # each needs the other (one threshold per width)
            other = "--promote-at" if path[-1] == "variable_dims" else "--variable-dims"
            argv, value = [flag.name, "2,3", other, "2,3"], (2, 3)
        elif path[-1] == "device":
            argv, value = [flag.name, "cpu"], "cpu"
        elif path[-1] == "name" and path[0] == "model":
            argv, value = [flag.name, "dcnv2"], "dcnv2"
        else:
            kind = action.type if action.type in samples else str
            size = path[-1] in ("memory_budget", "admit_sketch_bytes", "max_store_bytes",
                                "device_budget")
            argv = [flag.name, "1GB" if size else samples[kind]]
            value = kind(argv[1]) if not size else "1GB"
        if path[-1] == "admit_sketch_bytes":  # a sketch counts toward a threshold
            argv += ["--admit-min-count", "2"]
        config = config_from_args(parser.parse_args(argv))
        node = config
        for key in path:
            node = getattr(node, key)
        assert node == value, (flag.name, node, value)


def test_bad_flag_values_name_the_flag_and_the_field(parser):
    with pytest.raises(ValueError, match=r"--sparse-lr: sparse_optimizer\.lr: nan is not a "
                                         r"finite number"):
        config_from_args(parser.parse_args(["--sparse-lr", "nan"]))
    with pytest.raises(ValueError, match=r"--batch-size: batch_size: -5 must be > 0"):
        config_from_args(parser.parse_args(["--batch-size", "-5"]))
    with pytest.raises(ValueError, match=r"--memory-budget: store\.memory_budget: size '2XB'"):
        config_from_args(parser.parse_args(["--memory-budget", "2XB"]))


def test_cli_reports_a_bad_config_file_in_one_line(tmp_path, capsys):
    cfg = write_config(tmp_path, {"store": {"precision": "int3"}})
    code = main(["train", "--train", str(tmp_path / "none.tsv"), "--out", str(tmp_path / "m"),
                 "--config", cfg])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("cfg.json: store.precision: 'int3' is not one of fp32, fp16, int8, "
                        "int4")
    assert "\n" not in err


def test_on_bad_row_skip_in_a_config_file_takes_effect(tmp_path):
    from terarec.data.synth import generate

    train = tmp_path / "train.tsv"
    generate(train, 2_000, model_seed=1, sample_seed=1)
    with open(train, "a") as fh:
        fh.write("not-a-label\t1\n")
    cfg = write_config(tmp_path, {"on_bad_row": "skip", "batch_size": 512,
                                  "model": {"name": "lr"}})
    out = tmp_path / "model"
    assert main(["train", "--train", str(train), "--out", str(out), "--config", cfg,
                 "--no-progress"]) == 0
    assert json.loads((out / "metrics.json").read_text())["skipped_rows"] == 1
    # the flag, when given, still wins
    assert main(["train", "--train", str(train), "--out", str(tmp_path / "m2"), "--config",
                 cfg, "--no-progress", "--on-bad-row", "error"]) == 2


def test_resume_keeps_the_runs_settings_that_its_flags_do_not_change(tmp_path, capsys):
    """``--resume --epochs N`` (train longer) kept the model's fixed keys but took the
    defaults for every other key not given: the batch size, pass size and learning rates
    the run was started with fell back to the fixed defaults (4096 rows, ...)."""
    from terarec.data.synth import generate
    from terarec.modeldir import read_model_meta

    data = tmp_path / "train.tsv"
    generate(data, 3000, model_seed=1, sample_seed=2)
    out = tmp_path / "m"
    first = ["--batch-size", "300", "--pass-rows", "600", "--sparse-lr", "0.07",
             "--dense-lr", "0.002", "--epochs", "1", "--threads", "1", "--model", "lr",
             "--valid-split", "0"]  # every row every epoch: the pass count below
    assert main(["train", "--train", str(data), "--out", str(out), "--no-progress",
                 *first]) == 0
    capsys.readouterr()
    assert main(["train", "--train", str(data), "--out", str(out), "--no-progress",
                 "--resume", "--epochs", "2", "--dense-lr", "0.003"]) == 0
    assert "data-sized defaults" not in capsys.readouterr().err  # none were taken
    config = read_model_meta(out)[1]
    assert (config.batch_size, config.pass_rows, config.epochs) == (300, 600, 2)
    assert config.sparse_optimizer.lr == 0.07 and config.dense_optimizer.lr == 0.003
    history = json.loads((out / "history.json").read_text())
    assert [r["rows"] for r in history] == [600] * 10
