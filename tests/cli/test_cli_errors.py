"""A careless user's command lines (issue 14, items 7 and 8): each ends in one line naming
the flag, file or field and what is wrong (exit 2, no traceback), or in a correct run;
nothing half-trained is left in ``--out``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import terarec
from terarec.cli.main import main as cli_main
from terarec.data.synth import generate

TRAIN = ["--pass-rows", "1000", "--batch-size", "250", "--embedding-dim", "4",
         "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("errors") / "train.tsv"
    generate(path, 2000, model_seed=0, sample_seed=1, vocab_scale=0.01)
    return path


@pytest.fixture(scope="module")
def lr_model(data, tmp_path_factory) -> Path:
    """A two-pass LR model (two checkpoints), trained once and copied by tests that
    change it."""
    out = tmp_path_factory.mktemp("lr") / "model"
    assert cli_main(["train", "--train", str(data), "--out", str(out), *TRAIN,
                     "--model", "lr", "--valid-split", "0"]) == 0
    return out


def _train(data: Path, out: Path, *extra: str) -> int:
    return cli_main(["train", "--train", str(data), "--out", str(out), *TRAIN, *extra])


def _one_line(capsys) -> str:
    """The error line; it must be the last of stderr, printable and not a traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err
    line = err.strip().splitlines()[-1]
    assert line.isprintable(), line
    return line


FLAG_ERRORS = [
    (["--memory-budget", "1KB"], "memory budget 1,024 B leaves room for no hot rows"),
    (["--device", "tpu"], "--device: device: 'tpu' is not a device terarec trains on"),
    (["--device", "cuda:x"], "--device: device: 'cuda:x' is not a device"),
    (["--threads", "-1"], "--threads: threads: -1 must be > 0"),
    (["--threads", "0"], "--threads: threads: 0 must be > 0"),
    (["--epochs", "0"], "--epochs: epochs: 0 must be > 0"),
    (["--epochs", "-1"], "--epochs: epochs: -1 must be > 0"),
    (["--evict-after-passes", "0"], "--evict-after-passes: store.evict_after_passes: 0 "
                                    "must be > 0"),
    (["--sparse-lr", "-1"], "--sparse-lr: sparse_optimizer.lr: -1.0 must be > 0"),
    (["--sparse-lr", "nan"], "--sparse-lr: sparse_optimizer.lr: nan is not a finite number"),
    (["--admit-min-count", "-1"], "--admit-min-count: store.admit_min_count: -1 must be >= 0"),
    (["--checkpoint-every", "0"], "--checkpoint-every 0: must be >= 1"),
    (["--export-to", "EXPORT", "--delta-every", "0"], "--delta-every 0: must be >= 1"),
    (["--export-to", "EXPORT", "--delta-minutes", "0"], "--delta-minutes 0.0: must be > 0"),
    (["--label", "click"], "--label: only for --format csv or parquet; the Criteo format's "
                           "columns are fixed"),
    (["--log1p", "I1"], "--log1p: only for --format csv or parquet"),
    (["--numeric", "I1", "--categorical", "C1"], "--numeric, --categorical: only for "
                                                 "--format csv or parquet"),
    (["--promote-at", "10"], "promote_at [10.0] (--promote-at) needs one width per threshold "
                             "in variable_dims (--variable-dims), got none"),
    (["--variable-dims", "2"], "variable_dims [2] (--variable-dims) needs the show counts "
                               "that move a key up a class: promote_at (--promote-at)"),
    (["--variable-dims", "1,2", "--promote-at", "5"], "promote_at [5.0] (--promote-at) needs "
                                                      "one width per threshold"),
    (["--patience", "5", "--valid-split", "0"], "--patience needs --valid"),
    (["--valid-split", "2"], "--valid-split 2.0: must be a share of the training rows in "
                             "[0, 0.5]"),
    (["--patience", "0", "--valid", "VALID"], "--patience 0: must be >= 1"),
    (["--dgc-ratio", "0.1"], "--dgc-ratio applies only with --dense-comm dgc (got "
                             "--dense-comm none)"),
    (["--select-by", "auc", "--eval-every", "4", "--valid-split", "0"],
     "--eval-every, --select-by needs --valid"),
]

# Checked only once the exporter was made (after the statistics pass, leaving a model
# directory), without the flag's name; NaN and inf were taken and never came due.
EXPORT_SCHEDULE_ERRORS = [
    (["--delta-every", "2"], "--delta-every / --delta-minutes / --full-every-hours / "
                             "--full-at / --publish-to need --export-to"),
    (["--export-to", "EXPORT", "--full-at", "25:00"], "--full-at: full version time "
                                                      "'25:00': expected HH:MM"),
    (["--export-to", "EXPORT", "--full-every-hours", "0"], "--full-every-hours 0.0: must be "
                                                           "> 0 and finite"),
    (["--export-to", "EXPORT", "--full-every-hours", "nan"], "--full-every-hours nan: must "
                                                             "be > 0 and finite"),
    (["--export-to", "EXPORT", "--delta-minutes", "inf"], "--delta-minutes inf: must be > 0 "
                                                          "and finite"),
]


@pytest.mark.parametrize("extra,message", EXPORT_SCHEDULE_ERRORS,
                         ids=[" ".join(a) for a, _ in EXPORT_SCHEDULE_ERRORS])
def test_export_schedule_flags_are_checked_before_any_work(data, tmp_path, capsys, extra,
                                                            message):
    extra = [str(tmp_path / "export") if a == "EXPORT" else a for a in extra]
    assert _train(data, tmp_path / "model", *extra) == 2
    assert message in _one_line(capsys)
    assert not (tmp_path / "model").exists() and not (tmp_path / "export").exists()


@pytest.mark.parametrize("extra,message", FLAG_ERRORS, ids=[" ".join(a) for a, _ in FLAG_ERRORS])
def test_nonsense_flags_are_refused_naming_the_flag(data, tmp_path, capsys, extra, message):
    valid = tmp_path / "valid.tsv"
    shutil.copy(data, valid)  # a file of its own: --train's is refused as --valid
    names = {"EXPORT": str(tmp_path / "export"), "VALID": str(valid)}
    extra = [names.get(a, a) for a in extra]
    out = tmp_path / "model"
    assert _train(data, out, *extra) == 2
    assert message in _one_line(capsys)
    assert not (out / "checkpoints").exists()


def test_a_bare_valid_is_refused(data, tmp_path, capsys):
    """--valid with no file after it (an empty shell variable) trained without a
    validation set, as if the flag had not been given."""
    out = tmp_path / "model"
    with pytest.raises(SystemExit) as exit_:
        cli_main(["train", "--train", str(data), "--valid", "--out", str(out), *TRAIN])
    assert exit_.value.code == 2
    assert "argument --valid: expected at least one argument" in _one_line(capsys)
    assert not out.exists()


@pytest.mark.parametrize("command", ["train", "search"])
@pytest.mark.parametrize("flag", ["--train", "--valid"])
def test_a_file_named_twice_is_refused(data, tmp_path, capsys, command, flag):
    """A file named twice in --train (under another spelling or through a link too) had
    every row trained twice per epoch; in --valid every row scored twice."""
    link = tmp_path / "link.tsv"
    link.symlink_to(data)
    twice = [str(data), str(link)]
    files = {"--train": twice, "--valid": [str(data)]} if flag == "--train" else {
        "--train": [str(data)], "--valid": twice}
    out = tmp_path / "model"
    argv = [command, "--train", *files["--train"], "--valid", *files["--valid"],
            "--out", str(out), *TRAIN]
    assert cli_main(argv) == 2
    assert (f"{flag}: {link} is named twice (as {data}): its rows would be read twice"
            in _one_line(capsys))
    assert not out.exists()


@pytest.mark.parametrize("command", ["train", "search"])
def test_a_file_in_both_train_and_valid_is_refused(data, tmp_path, capsys, command):
    """--valid naming a --train file selected on rows the model had trained on, and the
    refit (on by default at this size) trained them twice."""
    other = tmp_path / "other.tsv"
    generate(other, 300, model_seed=0, sample_seed=9, vocab_scale=0.01)
    link = tmp_path / "link.tsv"
    link.symlink_to(data)
    out = tmp_path / "model"
    assert cli_main([command, "--train", str(data), "--valid", str(other), str(link),
                     "--out", str(out), *TRAIN]) == 2
    assert (f"--valid: {link} is also a --train file (as {data}): validation must hold "
            "rows training does not see") in _one_line(capsys)
    assert not out.exists()


def test_config_keys_the_model_or_optimizer_does_not_read_are_refused(data, tmp_path,
                                                                     capsys):
    """A DCN cross setting with DeepFM or an FTRL setting with Adam was silently ignored;
    at their defaults (a saved train_config.json lists every key) they are left alone."""
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"model": {"cross_layers": 2},
                                  "sparse_optimizer": {"name": "adam", "ftrl_l1": 0.5}}))
    out = tmp_path / "model"
    assert _train(data, out, "--config", str(config)) == 2
    assert _one_line(capsys).endswith(
        f"--config {config}: model.cross_layers: only model dcnv2 reads it, this run's is "
        "deepfm; sparse_optimizer.ftrl_l1: only sparse optimizer ftrl reads it, this run's "
        "is adam")
    assert not (out / "checkpoints").exists()
    assert _train(data, out, "--config", str(config), "--model", "dcnv2",
                  "--sparse-optimizer", "ftrl", "--epochs", "1") == 0
    saved = json.loads((out / "train_config.json").read_text())  # every key
    saved["model"]["cross_layers"] = 3  # back at the defaults: not read, not refused
    saved["sparse_optimizer"]["ftrl_l1"] = 0.0
    config.write_text(json.dumps(saved))
    assert _train(data, tmp_path / "lr", "--config", str(config), "--model", "lr",
                  "--sparse-optimizer", "adagrad", "--epochs", "1") == 0


# The models with an MLP (dropout and batch norm read it), as errors list them.
MLP_MODELS = ("widedeep / deepfm / dcnv2 / dlrm / dssm / din / seqpool / sharedbottom / "
              "mmoe / esmm")


@pytest.mark.parametrize(("extra", "message"), [
    (["--model", "lr", "--dropout", "0.3"],
     f"--dropout: only model {MLP_MODELS} reads it, this run's is lr"),
    (["--model", "fm", "--batch-norm"],
     f"--batch-norm: only model {MLP_MODELS} reads it, this run's is fm"),
])
def test_flags_the_model_does_not_read_are_refused(data, tmp_path, capsys, extra, message):
    """An MLP setting for a model without an MLP was silently ignored."""
    out = tmp_path / "model"
    assert _train(data, out, *extra) == 2
    assert _one_line(capsys).endswith(message)
    assert not (out / "checkpoints").exists()


def test_config_and_flag_keys_not_read_are_named_each_by_its_source(data, tmp_path, capsys):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"model": {"deep_mlp": [8]},
                                  "sparse_optimizer": {"name": "ftrl", "eps": 1e-6}}))
    assert _train(data, tmp_path / "model", "--config", str(config), "--model", "fm",
                  "--dropout", "0.1") == 2
    assert _one_line(capsys).endswith(
        f"--dropout: only model {MLP_MODELS} reads it, this run's is fm; --config {config}: "
        f"model.deep_mlp: only model {MLP_MODELS.replace('dlrm / ', '')} reads it, this run's "
        "is fm; sparse_optimizer.eps: only sparse optimizer adagrad / adam reads it, this "
        "run's is ftrl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_says_so(data, tmp_path, capsys, device):
    assert _train(data, tmp_path / "model", "--device", device) == 2
    assert f"--device {device}: CUDA is not available" in _one_line(capsys)


def test_paths_that_name_a_file_are_refused(data, lr_model, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert _train(data, afile) == 2
    assert f"--out {afile} is a file, not a model directory" in _one_line(capsys)
    assert _train(data, tmp_path / "m", "--store-dir", str(afile)) == 2
    assert f"--store-dir {afile} is a file, not a folder" in _one_line(capsys)
    assert _train(data, tmp_path / "m", "--export-to", str(afile)) == 2
    assert f"--export-to {afile} is a file, not an export folder" in _one_line(capsys)
    assert cli_main(["export", "--model", str(lr_model), "--out", str(afile)]) == 2
    assert f"--out {afile} is a file, not an export folder" in _one_line(capsys)
    for command in ("predict", "eval"):  # a traceback once every row was scored
        out = afile / "sub" / "scores"
        assert cli_main([command, "--model", str(lr_model), "--data", str(data),
                         "--out", str(out)]) == 2
        assert f"--out {out}: {afile} is a file, not a folder" in _one_line(capsys)
    assert afile.read_text() == "x"



def test_export_targets_that_cannot_be_used_are_refused_naming_the_flag(data, lr_model,
                                                                         tmp_path, capsys):
    # Options for a local folder were ignored; an unknown protocol did not name the flag.
    local = str(tmp_path / "exp")
    for argv, flag in ((["export", "--model", str(lr_model), "--out", local], "--out"),
                       (["train", "--train", str(data), "--out", str(tmp_path / "m"), *TRAIN,
                         "--export-to", local], "--export-to")):
        assert cli_main([*argv, "--storage-options", '{"anon": true}']) == 2
        assert (f"--storage-options: {flag} {local} is a local folder; the options are for "
                "fsspec URLs") in _one_line(capsys)
    assert cli_main(["export", "--model", str(lr_model), "--out", "nosuch://bucket/x"]) == 2
    assert ("--out nosuch://bucket/x: cannot be used (ValueError: Protocol not known: "
            "nosuch)") in _one_line(capsys)
    assert not (tmp_path / "exp").exists() and not (tmp_path / "m" / "checkpoints").exists()




def test_an_export_into_a_model_directory_is_refused(data, lr_model, tmp_path, capsys):
    """Both keep a LATEST file: an export there overwrote the model's pointer."""
    model = tmp_path / "model"
    shutil.copytree(lr_model, model)
    latest = (model / "LATEST").read_text()
    assert cli_main(["export", "--model", str(model), "--out", str(model)]) == 2
    assert f"--out {model} is a model directory; export to a folder of its own" \
        in _one_line(capsys)
    assert _train(data, tmp_path / "m", "--export-to", str(model)) == 2
    assert f"--export-to {model} is a model directory" in _one_line(capsys)
    assert _train(data, tmp_path / "m", "--export-to", str(tmp_path / "m")) == 2
    assert f"--export-to {tmp_path / 'm'} is the model directory (--out)" in _one_line(capsys)
    assert (model / "LATEST").read_text() == latest and not list(model.glob("v0*"))
    assert not (tmp_path / "m").exists()
    assert cli_main(["export", "--model", str(model), "--out", str(model / "export")]) == 0


def test_an_export_into_a_version_folder_is_refused(data, lr_model, tmp_path, capsys):
    """An export into ``URI/v000001`` wrote its own LATEST and v000001 inside that version,
    files its manifest does not list, and a server of URI never saw the new version."""
    uri = tmp_path / "exp"
    assert cli_main(["export", "--model", str(lr_model), "--out", str(uri)]) == 0
    capsys.readouterr()
    version = uri / "v000001"
    before = sorted(p.name for p in version.iterdir())
    assert cli_main(["export", "--model", str(lr_model), "--out", str(version)]) == 2
    assert (f"--out {version} is one exported version (it holds manifest.json); export to "
            f"the export folder above it ({uri})") in _one_line(capsys)
    assert _train(data, tmp_path / "m", "--export-to", f"file://{version}") == 2
    assert f"--export-to file://{version} is one exported version" in _one_line(capsys)
    assert sorted(p.name for p in version.iterdir()) == before
    assert not (tmp_path / "m").exists()


EXPORT_FLAG_ERRORS = [
    (["--shard-rows", "0"], "--shard-rows 0: must be >= 1"),
    (["--shard-rows", "-5", "--slice", "C1"], "--shard-rows -5: must be >= 1"),
    (["--codebook"], "--codebook takes --bits 1, 2, 4, 8, got --bits 32"),
    (["--codebook", "--bits", "16"], "--codebook takes --bits 1, 2, 4, 8, got --bits 16"),
]


@pytest.mark.parametrize("extra,message", EXPORT_FLAG_ERRORS,
                         ids=[" ".join(a) for a, _ in EXPORT_FLAG_ERRORS])
def test_export_flag_errors_name_the_flag(lr_model, tmp_path, capsys, extra, message):
    # They named the exporter's arguments (shard_rows, bits) rather than the flags.
    assert cli_main(["export", "--model", str(lr_model), "--out", str(tmp_path / "x"),
                     *extra]) == 2
    assert message in _one_line(capsys)
    assert not (tmp_path / "x").exists()


def test_an_object_store_that_cannot_be_used_is_one_line(lr_model, s3_server, capsys,
                                                          monkeypatch):
    """A storage option s3fs does not take, or no credentials, was a traceback."""
    pytest.importorskip("s3fs")
    argv = ["export", "--model", str(lr_model), "--out", "s3://models/ctr"]
    bad = json.dumps({**s3_server, "no_such_option": 1})
    assert cli_main([*argv, "--storage-options", bad]) == 2
    assert ("--out s3://models/ctr: cannot be used with --storage-options (TypeError: "
            in _one_line(capsys))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert cli_main([*argv, "--storage-options", json.dumps(s3_server)]) == 2
    assert "(NoCredentialsError: Unable to locate credentials)" in _one_line(capsys)


RESUME = ["--pass-rows", "1000", "--batch-size", "250", "--threads", "1", "--no-progress"]
RESUME_CHANGES = [
    (["--model", "fm"], "model.name (--model): was 'lr', now 'fm'"),
    (["--embedding-dim", "8"], "model.embedding_dim (--embedding-dim): was 4, now 8"),
    (["--seed", "5"], "seed (--seed): was 0, now 5"),
    (["--sparse-optimizer", "adam"], "sparse_optimizer.name (--sparse-optimizer): was "
                                     "'adagrad', now 'adam'"),
    (["--precision", "int8"], "store.precision (--precision): was 'fp32', now 'int8'"),
    (["--config", "CFG"], "dense_optimizer.name: was 'adam', now 'sgd'"),
]


@pytest.mark.parametrize("extra,message", RESUME_CHANGES,
                         ids=[a[0] for a, _ in RESUME_CHANGES])
def test_resume_refuses_what_the_checkpoints_fix(data, lr_model, tmp_path, capsys, extra,
                                                 message):
    out = tmp_path / "model"
    shutil.copytree(lr_model, out)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"dense_optimizer": {"name": "sgd"}}))
    extra = [str(cfg) if a == "CFG" else a for a in extra]
    assert cli_main(["train", "--train", str(data), "--out", str(out), "--resume",
                     *RESUME, *extra]) == 2
    line = _one_line(capsys)
    assert f"--resume: {out} was trained with other settings that its checkpoints fix" in line
    assert message in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


@pytest.mark.parametrize("extra,differ", [
    (["--numeric-transform", "none"], "fields differs"),
    (["--format", "csv", "--label", "label", "--categorical", "C1"],
     "format, delimiter, fields differ"),
])
def test_resume_refuses_format_flags_describing_other_columns(data, lr_model, tmp_path,
                                                              capsys, extra, differ):
    """A resumed run reads its files with the model's schema: flags describing other
    columns or transforms were silently ignored. The same flags (none here) resume."""
    out = tmp_path / "model"
    shutil.copytree(lr_model, out)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert cli_main(["train", "--train", str(data), "--out", str(out), "--resume",
                     *RESUME, *extra]) == 2
    assert (f"--resume: {out} was trained on other columns than the format flags describe "
            f"({differ}); resume with the flags it was trained with") in _one_line(capsys)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert cli_main(["train", "--train", str(data), "--out", str(out), "--resume",
                     *RESUME, "--numeric-transform", "log1p", "--epochs", "2"]) == 0


def test_resume_with_a_file_lacking_a_column_prints_no_progress_bar(tmp_path, capsys):
    """A resumed run checks an input's header in the pass loop (a fresh one, while taking
    statistics): the empty bar ``train: 0.00 rows [00:00, ? rows/s]`` was printed twice
    above the error."""
    rows = [f"{i % 2},{i},u{i % 7}" for i in range(200)]
    full, short = tmp_path / "full.csv", tmp_path / "short.csv"
    full.write_text("click,price,user\n" + "\n".join(rows) + "\n")
    short.write_text("click,price\n1,2\n")
    flags = ["--format", "csv", "--label", "click", "--numeric", "price",
             "--categorical", "user", "--model", "lr", "--epochs", "1", "--threads", "1"]
    out = tmp_path / "model"
    assert cli_main(["train", "--train", str(full), "--out", str(out), *flags,
                     "--no-progress"]) == 0
    capsys.readouterr()
    assert cli_main(["train", "--train", str(full), str(short), "--out", str(out),
                     "--resume", "--epochs", "2", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert "field(s) ['user' (categorical)] are not among the file's columns" in err
    assert "rows/s" not in err and "Traceback" not in err


def test_predict_refuses_to_write_its_scores_over_an_input(data, lr_model, tmp_path, capsys):
    """``predict --out`` naming one of its ``--data`` files (or a link to it) replaced the
    input with its scores, then failed on the next run with a header of scores."""
    rows = tmp_path / "rows.tsv"
    shutil.copy(data, rows)
    (tmp_path / "link.tsv").symlink_to(rows)
    before = rows.read_bytes()
    for named in (rows, tmp_path / "link.tsv"):
        assert cli_main(["predict", "--model", str(lr_model), "--data", str(data), str(named),
                         "--out", str(rows)]) == 2
        assert _one_line(capsys).endswith(f"--out {rows} is the input file {named}: its "
                                          "scores would replace it; write them to another "
                                          "file")
    assert rows.read_bytes() == before


def test_resume_keeps_the_saved_model_and_takes_free_knobs(data, lr_model, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(lr_model, out)
    # Neither --model nor --embedding-dim given: the run continues the saved LR model;
    # a learning rate and the epoch count may change.
    assert cli_main(["train", "--train", str(data), "--out", str(out), "--resume", *RESUME,
                     "--sparse-lr", "0.01", "--epochs", "2"]) == 0
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["model"]["name"] == "lr" and saved["model"]["embedding_dim"] == 4
    assert saved["sparse_optimizer"]["lr"] == 0.01
    assert json.loads((out / "metrics.json").read_text())["passes"] == 4


def _drop_sha256(checkpoint: Path) -> None:
    meta = json.loads((checkpoint / "meta.json").read_text())
    del meta["sha256"]
    (checkpoint / "meta.json").write_text(json.dumps(meta))


def test_a_meta_json_without_sha256_is_refused_naming_the_file(data, lr_model, tmp_path,
                                                               capsys, caplog):
    model = tmp_path / "model"
    shutil.copytree(lr_model, model)
    newest, older = sorted((model / "checkpoints").glob("pass-*"), reverse=True)
    _drop_sha256(newest)
    # The previous checkpoint loads, and the refusal says why.
    assert cli_main(["eval", "--model", str(model), "--data", str(data),
                     "--out", str(tmp_path / "e.json")]) == 0
    assert f"{newest / 'meta.json'}: missing field(s) ['sha256']" in caplog.text
    assert json.loads((tmp_path / "e.json").read_text())["rows"] == 2000
    # With no good checkpoint left, every reader fails in one line.
    _drop_sha256(older)
    for argv in (["eval", "--model", str(model), "--data", str(data), "--out",
                  str(tmp_path / "e2.json")],
                 ["export", "--model", str(model), "--out", str(tmp_path / "exp")],
                 ["train", "--train", str(data), "--out", str(model), "--resume", *RESUME]):
        assert cli_main(argv) == 2
        line = _one_line(capsys)
        assert "no loadable checkpoint" in line and "missing field(s) ['sha256']" in line



def test_a_best_file_naming_no_checkpoint_is_named(data, lr_model, tmp_path, capsys):
    """It was reported as a half-written checkpoint of that name."""
    model = tmp_path / "model"
    shutil.copytree(lr_model, model)
    have = ", ".join(sorted((p.name for p in (model / "checkpoints").iterdir()),
                            reverse=True))
    for name in ("pass-000009", "../../elsewhere"):
        (model / "BEST").write_text(name)
        for argv in (["export", "--model", str(model), "--out", str(tmp_path / "x")],
                     ["predict", "--model", str(model), "--data", str(data)]):
            assert cli_main(argv) == 2
            assert (f"{model / 'BEST'} names {name!r}, which is not a checkpoint here "
                    f"(have: {have}); --checkpoint latest") in _one_line(capsys)
    assert cli_main(["export", "--model", str(model), "--out", str(tmp_path / "x"),
                     "--checkpoint", "latest"]) == 0


def test_binary_garbage_is_named_by_offset_not_dumped(data, lr_model, tmp_path, capsys):
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(bytes(range(256)) * 64)
    for extra in ([], ["--on-bad-row", "skip"]):
        assert _train(garbage, tmp_path / "m", *extra) == 2
        assert (f"{garbage}: line 1: not text (byte 0x00 at offset 0); expected UTF-8 "
                "delimited text") in _one_line(capsys)
    assert cli_main(["eval", "--model", str(lr_model), "--data", str(garbage),
                     "--out", str(tmp_path / "e.json")]) == 2
    assert f"{garbage}: line 1: not text" in _one_line(capsys)
    # Binary bytes past the first 64 KiB: the line is still named, the bytes never shown.
    mixed = tmp_path / "mixed.tsv"
    text = data.read_bytes()
    mixed.write_bytes(text + b"\xff\xfe\x00garbage\x90\x91\n" + text)
    lines = text.count(b"\n")
    for extra in ([], ["--on-bad-row", "skip"]):
        assert _train(mixed, tmp_path / "m", *extra) == 2
        assert f"{mixed}: line {lines + 1}: not UTF-8 text (binary data?)" in _one_line(capsys)
    assert not (tmp_path / "m" / "checkpoints").exists()


def test_binary_garbage_under_skip_exits_cleanly_as_a_process(data, tmp_path):
    """The process itself: exit 2 with one line (a pyarrow reader left open used to abort
    the interpreter at exit, and the undecodable row printed a traceback)."""
    mixed = tmp_path / "mixed.tsv"
    mixed.write_bytes(data.read_bytes() + b"\xff\xfe\tx\n" * 3 + data.read_bytes())
    src = Path(terarec.__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src),
                                                       os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "terarec", "train", "--train", str(mixed),
                           "--out", str(tmp_path / "m"), *TRAIN, "--on-bad-row", "skip"],
                          env=env, capture_output=True, timeout=300)
    err = done.stderr.decode("utf-8")
    assert done.returncode == 2, err
    assert "Traceback" not in err and "terminate called" not in err
    assert err.strip().splitlines()[-1].endswith("not UTF-8 text (binary data?)")


def test_corrupt_model_files_and_configs_name_the_file(data, lr_model, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(lr_model, model)
    (model / "schema.json").write_text('{"fields": [')
    assert cli_main(["eval", "--model", str(model), "--data", str(data),
                     "--out", str(tmp_path / "e.json")]) == 2
    assert f"{model / 'schema.json'}: not valid JSON" in _one_line(capsys)
    (model / "schema.json").write_bytes(b"\xff\xfe\x00")
    assert cli_main(["export", "--model", str(model), "--out", str(tmp_path / "x")]) == 2
    assert f"{model / 'schema.json'}: not valid JSON" in _one_line(capsys)
    shutil.copy(lr_model / "schema.json", model / "schema.json")
    (model / "train_config.json").write_text('{"batch')
    for argv in (["eval", "--model", str(model), "--data", str(data), "--out",
                  str(tmp_path / "e.json")],
                 ["train", "--train", str(data), "--out", str(model), "--resume", *RESUME]):
        assert cli_main(argv) == 2
        assert f"{model / 'train_config.json'}: config: invalid JSON" in _one_line(capsys)
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"batch_size": 3,')
    assert _train(data, tmp_path / "m", "--config", str(cfg)) == 2
    assert f"{cfg}: config: invalid JSON (EOF while parsing" in _one_line(capsys)
    assert _train(data, tmp_path / "m", "--config", str(tmp_path / "none.json")) == 2
    assert (f"{tmp_path / 'none.json'}: cannot read config file: No such file or "
            "directory") in _one_line(capsys)



def _strict_json(text: str) -> dict:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in JSON output")

    return json.loads(text, parse_constant=refuse)


def test_eval_on_one_class_writes_valid_json(data, lr_model, tmp_path, capsys):
    """AUC is undefined on one class: it was written as NaN, which JSON readers refuse."""
    clicks = tmp_path / "clicks.tsv"
    clicks.write_text("".join("1" + line[1:] + "\n"
                              for line in data.read_text().splitlines()[:50]))
    out = tmp_path / "e.json"
    assert cli_main(["eval", "--model", str(lr_model), "--data", str(clicks),
                     "--out", str(out)]) == 0
    captured = capsys.readouterr()
    metrics = _strict_json(out.read_text())
    assert metrics["auc"] is None and metrics["ctr"] == 1.0 and metrics["rows"] == 50
    assert _strict_json(captured.out.strip().splitlines()[-1]) == metrics
    assert "AUC is undefined: every label in --data is the same class" in captured.err


def test_every_row_skipped_fails_and_writes_no_checkpoint(tmp_path, capsys):
    junk = tmp_path / "junk.tsv"
    junk.write_text("".join(f"row {i} is not criteo\n" for i in range(50)))
    out = tmp_path / "model"
    assert _train(junk, out, "--on-bad-row", "skip", "--valid-split", "0") == 2
    line = _one_line(capsys)
    assert (f"no training rows in {junk}: all 50 rows read were bad and skipped "
            f"(--on-bad-row skip); first: {junk}: line 1:") in line
    assert not (out / "checkpoints").exists() and not (out / "metrics.json").exists()
    # the last 6 rows carved as validation rows are read first: named in the file
    assert _train(junk, out, "--on-bad-row", "skip") == 2
    assert (f"no validation rows in {junk}: all 6 rows read were bad and skipped "
            f"(--on-bad-row skip); first: {junk}: line 45:") in _one_line(capsys)
    assert not out.exists()  # nor the copies the rows were cut into
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    assert _train(empty, tmp_path / "m2") == 2
    assert f"{empty}: empty file" in _one_line(capsys)
    assert not (tmp_path / "m2" / "checkpoints").exists()



def test_eval_or_predict_with_every_row_skipped_fails_naming_the_file(lr_model, tmp_path,
                                                                      capsys):
    """eval with every row skipped did not name the file; predict says the same."""
    junk = tmp_path / "junk.tsv"
    junk.write_text("x\n" * 3)
    out = tmp_path / "eval.out"
    assert cli_main(["eval", "--model", str(lr_model), "--data", str(junk),
                     "--on-bad-row", "skip", "--out", str(out)]) == 2
    assert (f"no rows to score in {junk}: all 3 rows read were bad and skipped "
            f"(--on-bad-row skip); first: {junk}: line 1:") in _one_line(capsys)
    assert not out.exists()
    out = tmp_path / "predict.out"
    assert cli_main(["predict", "--model", str(lr_model), "--data", str(junk),
                     "--on-bad-row", "skip", "--out", str(out)]) == 2
    assert (f"no rows to score in {junk}: all 3 rows read were bad and skipped "
            f"(--on-bad-row skip); first: {junk}: line 1:") in _one_line(capsys)
    assert not out.exists()


def test_every_validation_row_skipped_is_refused_before_training(data, tmp_path, capsys):
    junk = tmp_path / "junk.tsv"
    junk.write_text("x\n" * 5)
    out = tmp_path / "model"
    assert cli_main(["train", "--train", str(data), "--valid", str(junk), "--out", str(out),
                     *TRAIN, "--on-bad-row", "skip"]) == 2
    assert f"no validation rows in {junk}: all 5 rows read were bad" in _one_line(capsys)
    assert not (out / "checkpoints").exists()


def test_a_bad_row_is_reported_once_over_several_epochs(data, tmp_path, capsys):
    bad = tmp_path / "bad.tsv"
    bad.write_bytes(data.read_bytes() + b"notalabel\t1\n")
    out = tmp_path / "model"
    assert _train(bad, out, "--epochs", "2", "--on-bad-row", "skip", "--valid-split",
                  "0") == 0  # (every row trained every epoch)
    err = capsys.readouterr().err
    assert "skipped 1 bad rows; first: " in err
    assert err.count("line 2001") == 1
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["skipped_rows"] == 1 and metrics["rows"] == 2 * 2000


def test_numeric_transform_applies_to_criteo(data, tmp_path):
    out = tmp_path / "model"
    assert _train(data, out, "--numeric-transform", "none", "--model", "lr") == 0
    fields = json.loads((out / "schema.json").read_text())["fields"]
    numeric = [f for f in fields if f["kind"] == "numeric"]
    assert len(numeric) == 13 and {f["transform"] for f in numeric} == {"none"}


def test_csv_without_its_columns_fails_before_any_work(tmp_path, capsys):
    """A CSV needs its label and feature columns named: the error comes first, before the
    data is sized (no "data-sized defaults" line) and before anything is written."""
    csv = tmp_path / "clicks.csv"
    csv.write_text("click,site\n" + "".join(f"{i % 2},s{i % 7}\n" for i in range(200)))
    out = tmp_path / "model"
    assert cli_main(["train", "--train", str(csv), "--format", "csv", "--label", "click",
                     "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "data-sized defaults" not in err
    assert err.strip().splitlines()[-1].endswith(
        "--format csv needs --label and --numeric and/or --categorical")
    assert not (out / "checkpoints").exists()


COLUMN_ERRORS = [
    (["--categorical", "site,site"], "--categorical names 'site' twice"),
    (["--numeric", "site", "--categorical", "site"],
     "--numeric and --categorical both name 'site': a column is one of label, numeric or "
     "categorical"),
    (["--categorical", "click,site"],
     "--label and --categorical both name 'click': a column is one of label, numeric or "
     "categorical"),
    (["--categorical", "site", "--multi-valued", "tags"],
     "--multi-valued names 'tags', not among --categorical: only categorical columns hold "
     "several values"),

    (["--categorical", "site", "--multi-valued", "site", "--multi-sep", ","],
     "separator ',' must be non-empty and differ from the delimiter"),
]


@pytest.mark.parametrize("extra,message", COLUMN_ERRORS,
                         ids=[" ".join(a) for a, _ in COLUMN_ERRORS])
def test_inconsistent_column_flags_fail_before_the_data_is_sized(tmp_path, capsys, extra,
                                                                 message):
    """The schema the column flags describe is built before any work: these failed only
    after the data had been sized (a "data-sized defaults" line first)."""
    csv = tmp_path / "clicks.csv"
    csv.write_text("click,site\n" + "".join(f"{i % 2},s{i % 7}\n" for i in range(200)))
    out = tmp_path / "model"
    assert cli_main(["train", "--train", str(csv), "--format", "csv", "--label", "click",
                     *extra, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "data-sized defaults" not in err
    assert err.strip().splitlines()[-1].endswith(message)
    assert not (out / "checkpoints").exists()


def test_a_column_the_file_lacks_is_named_with_what_it_was_to_be(tmp_path, capsys):
    csv = tmp_path / "clicks.csv"
    csv.write_text("click,site\n" + "".join(f"{i % 2},s{i % 7}\n" for i in range(200)))
    assert cli_main(["train", "--train", str(csv), "--format", "csv", "--label", "y",
                     "--numeric", "age", "--categorical", "site", "--out",
                     str(tmp_path / "m"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"{csv}: line 1: field(s) ['y' (label), 'age' (numeric)] are not among the file's "
        "columns ['click', 'site']")


DELIMITER_ERRORS = [
    ("csv", "", "--delimiter '': must be exactly one character, got 0"),
    ("csv", ";;", "--delimiter ';;': must be exactly one character, got 2"),
    ("csv", "\\t", "got 2 (for a tab, pass a tab character"),
    ("csv", '"', "a quote or a line break cannot separate fields"),
    ("parquet", ";", "--delimiter: only for csv data; this data is parquet"),
]


@pytest.mark.parametrize("fmt,delimiter,message", DELIMITER_ERRORS,
                         ids=[f"{f}-{d!r}" for f, d, _ in DELIMITER_ERRORS])
def test_a_delimiter_that_cannot_be_used_is_refused_before_any_work(tmp_path, capsys, fmt,
                                                                    delimiter, message):
    """--delimiter takes one character and only for csv: an empty or longer one failed
    in the header reader with a TypeError traceback, and parquet ignored it."""
    data = tmp_path / f"clicks.{fmt}"
    if fmt == "csv":
        data.write_text("click,site\n" + "".join(f"{i % 2},s{i % 7}\n" for i in range(200)))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"click": [i % 2 for i in range(200)],
                                 "site": [f"s{i % 7}" for i in range(200)]}), data)
    out = tmp_path / "model"
    assert cli_main(["train", "--train", str(data), "--format", fmt, "--label", "click",
                     "--categorical", "site", "--delimiter", delimiter, "--out", str(out),
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "data-sized defaults" not in err and "Traceback" not in err
    assert message in err.strip().splitlines()[-1]
    assert not (out / "checkpoints").exists()


SERVE_ERRORS = [
    (["--poll-seconds", "0"], "--poll-seconds must be a finite number > 0, got 0.0"),
    (["--poll-seconds", "-1"], "--poll-seconds must be a finite number > 0, got -1.0"),
    (["--max-candidates", "0"], "--max-candidates must be a finite number >= 1, got 0"),
    (["--max-body-bytes", "-5"], "--max-body-bytes must be a finite number >= 1, got -5"),
    (["--max-top-k", "0"], "--max-top-k must be a finite number >= 1, got 0"),
    (["--incomplete-seconds", "-1"], "--incomplete-seconds must be a finite number >= 0, got -1.0"),
    (["--max-batch-rows", "0"], "--max-batch-rows must be a finite number >= 1, got 0"),
    (["--max-delay-ms", "inf"], "--max-delay-ms must be a finite number >= 0, got inf"),
    (["--hedge-ms", "nan", "--sparse-tier", "redis://127.0.0.1:1"],
     "--hedge-ms must be a finite number >= 0, got nan"),
    (["--workers", "0"], "--workers must be a finite number >= 1, got 0"),
    (["--port", "70000"], "--port must be <= 65535, got 70000"),
    (["--hot-rows", "-1"], "--hot-rows must be a finite number >= 0, got -1"),
    (["--name", ""], "--name '': a model name is letters, digits"),
    (["--hot-rows", "10", "--strict-sparse"],
     "--hot-rows, --strict-sparse: only with --sparse-tier (rows are read from a cluster)"),
    (["--sparse-tier", "redis://127.0.0.1:1", "--no-hedge", "--hedge-ms", "3"],
     "--hedge-ms: no hedged reads with --no-hedge"),
    (["--name", "a/b"], "--name 'a/b': a model name is letters, digits"),
]


@pytest.mark.parametrize("extra,message", SERVE_ERRORS,
                         ids=[" ".join(a) for a, _ in SERVE_ERRORS])
def test_serve_refuses_out_of_range_flags_before_starting(tmp_path, capsys, extra, message):
    """A poll interval of 0 re-listed the export in a busy loop, a body limit or candidate
    limit of 0 refused every request: each is refused at once, naming the flag."""
    assert cli_main(["serve", str(tmp_path / "export"), *extra]) == 2
    assert _one_line(capsys).startswith(f"terarec serve: error: {message}")


def test_serve_refuses_a_version_folder_a_model_and_a_bad_cache_dir(lr_model, tmp_path,
                                                                      capsys):
    """Each used to start a server that polled for versions that never come (or failed
    later): refused at once, saying what to serve instead."""
    version = tmp_path / "export" / "v000001"
    version.mkdir(parents=True)
    (version / "manifest.json").write_text("{}")
    assert cli_main(["serve", str(version)]) == 2
    assert _one_line(capsys) == (
        f"terarec serve: error: {version} is one exported version (it holds manifest.json): "
        f"serve the export folder above it ({tmp_path / 'export'}), which names the newest "
        "version")
    assert cli_main(["serve", str(lr_model)]) == 2
    assert f"{lr_model} is a model directory, not an export" in _one_line(capsys)
    # options a local folder ignores were taken silently (export refuses them); the port
    # is taken so that a server which would start fails at once instead
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert cli_main(["serve", str(tmp_path / "export"), "--storage-options",
                         '{"anon": true}', "--port", str(taken.getsockname()[1])]) == 2
    assert _one_line(capsys) == (
        f"terarec serve: error: --storage-options: {tmp_path / 'export'} is a local folder; "
        "the options are for fsspec URLs such as s3://bucket/prefix")
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli_main(["serve", str(tmp_path / "export"), "--cache-dir", str(afile)]) == 2
    assert _one_line(capsys) == f"terarec serve: error: --cache-dir {afile}: a file, not a folder"
    assert cli_main(["serve", str(tmp_path / "export"), "--cache-dir",
                     str(afile / "sub")]) == 2
    assert _one_line(capsys).startswith(f"terarec serve: error: --cache-dir {afile / 'sub'}: ")


def test_serve_refuses_a_taken_port_before_loading(tmp_path, capsys):
    """uvicorn said so only once the model had loaded, and exited 3."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for extra in ([], ["--workers", "2"]):
            assert cli_main(["serve", str(tmp_path / "export"), "--port", str(port),
                             *extra]) == 2
            assert _one_line(capsys) == (f"terarec serve: error: --host 127.0.0.1 --port "
                                         f"{port}: cannot listen there: Address already in use")
    assert cli_main(["serve", str(tmp_path / "export"), "--host", "no-such-host.invalid"]) == 2
    assert _one_line(capsys).startswith("terarec serve: error: --host no-such-host.invalid "
                                        "--port 8080: cannot listen there: ")


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="no /sys to fail to write in")
def test_a_place_that_cannot_be_written_is_one_line(data, lr_model, tmp_path, capsys):
    """eval / predict / export / train to a folder that refuses writes (permissions, a
    read-only filesystem) ended in a traceback naming a temp file the user never named."""
    for argv, where in (
            (["eval", "--model", str(lr_model), "--data", str(data)], "/sys/x.json"),
            (["predict", "--model", str(lr_model), "--data", str(data)], "/sys/x.txt"),
            (["export", "--model", str(lr_model)], "/sys/terarec-export"),
            (["train", "--train", str(data), *TRAIN], "/sys/terarec-model")):
        assert cli_main([*argv, "--out", where]) == 2, argv
        line = _one_line(capsys)
        assert line.startswith(f"terarec {argv[0]}: error: ") and where in line, line
        assert ".tmp" not in line


QUICKSTART_ERRORS = [
    (["--model", "bogus"], "--model: unknown model 'bogus'; known models: lr, fm"),
    (["--rows", "0"], "--rows must be >= 1, got 0"),
    (["--valid-rows", "0"], "--valid-rows must be >= 1, got 0"),
    (["--seed", "-1"], "--seed: seed: -1 must be >= 0"),
    (["--workdir", "AFILE"], "--workdir AFILE: AFILE is a file, not a folder"),
]


@pytest.mark.parametrize("extra,message", QUICKSTART_ERRORS,
                         ids=[" ".join(a) for a, _ in QUICKSTART_ERRORS])
def test_quickstart_checks_its_flags_before_synthesising(tmp_path, capsys, extra, message):
    """A bad --model or --seed failed only after the (default: a million) rows were
    synthesised; --valid-rows 0 was reported as "rows must be positive"."""
    work, afile = tmp_path / "work", tmp_path / "afile"
    afile.write_text("")
    extra = [str(afile) if a == "AFILE" else a for a in extra]
    assert cli_main(["quickstart", "--workdir", str(work), "--no-progress", *extra]) == 2
    assert _one_line(capsys).startswith(
        f"terarec quickstart: error: {message.replace('AFILE', str(afile))}")
    assert not work.exists()


SYNTH_VALID_ERRORS = [
    (["--valid-rows", "0"], "--valid-rows must be positive, got 0"),
    (["--valid-rows", "0", "--valid-out", "V"], "--valid-rows must be positive, got 0"),
    (["--valid-rows", "10"], "--valid-rows needs --valid-out: --valid-rows N --valid-out "
                             "FILE writes N validation rows"),
    (["--valid-out", "V"], "--valid-out needs --valid-rows: --valid-rows N --valid-out FILE "
                           "writes N validation rows"),
]


@pytest.mark.parametrize("extra,message", SYNTH_VALID_ERRORS,
                         ids=[" ".join(a) for a, _ in SYNTH_VALID_ERRORS])
def test_synth_validation_flags(tmp_path, capsys, extra, message):
    """--valid-rows 0 alone wrote no validation file and exited 0; with --valid-out it
    said the two flags "go together" though both were given."""
    extra = [str(tmp_path / "v.tsv") if a == "V" else a for a in extra]
    assert cli_main(["synth", "--rows", "50", "--out", str(tmp_path / "t.tsv"), *extra]) == 2
    assert _one_line(capsys) == f"terarec synth: error: {message}"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("command", ["eval", "predict"])
def test_scoring_out_that_is_a_folder_is_refused_before_scoring(data, lr_model, tmp_path,
                                                                capsys, command):
    """It failed with an IsADirectoryError traceback once every row was scored."""
    folder = tmp_path / "scores"
    folder.mkdir()
    assert cli_main([command, "--model", str(lr_model), "--data", str(data),
                     "--out", str(folder)]) == 2
    assert _one_line(capsys) == f"terarec {command}: error: --out {folder} is a folder, " \
                                "not a file"
    assert list(folder.iterdir()) == [] and not list(tmp_path.glob(".scores.*"))


@pytest.mark.parametrize("command", ["eval", "predict"])
def test_scoring_a_folder_that_is_not_a_model_leaves_it_untouched(data, tmp_path, capsys,
                                                                   command):
    """It was refused, but a .scratch folder was left inside it."""
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    assert cli_main([command, "--model", str(folder), "--data", str(data)]) == 2
    assert _one_line(capsys) == f"terarec {command}: error: {folder}: not a terarec model " \
                                "directory (no schema.json)"
    assert list(folder.iterdir()) == []


def test_scoring_takes_delimiter_and_refuses_column_flags(tmp_path, capsys):
    """The model's schema fixes the columns: --label / --numeric-transform on eval were
    silently ignored, and so was --delimiter unless --format named another container, so
    a csv model could not score a file written with another delimiter."""
    rows = "".join(f"{i % 2},{i % 13},s{i % 7}\n" for i in range(300))
    comma, semi = tmp_path / "comma.csv", tmp_path / "semi.csv"
    comma.write_text("click,n,site\n" + rows)
    semi.write_text(("click,n,site\n" + rows).replace(",", ";"))
    model = tmp_path / "model"
    assert cli_main(["train", "--train", str(comma), "--format", "csv", "--label", "click",
                     "--numeric", "n", "--categorical", "site", "--out", str(model),
                     *TRAIN, "--model", "lr"]) == 0
    capsys.readouterr()

    def scored(*extra: str) -> list[str]:
        out = tmp_path / "scores.txt"
        assert cli_main(["predict", "--model", str(model), "--out", str(out), *extra]) == 0
        return out.read_text().splitlines()

    expected = scored("--data", str(comma))
    assert len(expected) == 300
    assert scored("--data", str(semi), "--delimiter", ";") == expected
    assert scored("--data", str(semi), "--delimiter", ";", "--format", "csv") == expected
    for extra, flags in ((["--label", "n"], "--label"),
                         (["--numeric-transform", "none"], "--numeric-transform"),
                         (["--numeric", "n", "--log1p", "n"], "--numeric, --log1p")):
        assert cli_main(["eval", "--model", str(model), "--data", str(comma), *extra]) == 2
        assert _one_line(capsys).startswith(
            f"terarec eval: error: {flags}: the model's schema fixes its columns")


def test_publish_checks_its_source_and_grace_before_connecting(lr_model, tmp_path, capsys):
    """A missing version or a bad grace period was reported only after connecting to the
    cluster (here: nothing listens, so its connection error hid them)."""
    nowhere = "redis://127.0.0.1:1"
    export = tmp_path / "export"
    assert cli_main(["export", "--model", str(lr_model), "--out", str(export)]) == 0
    capsys.readouterr()
    cases = [
        ([str(export), "--gc-grace-seconds", "-1"],
         "--gc-grace-seconds must be a finite number >= 0, got -1.0"),
        ([str(export), "--gc-grace-seconds", "inf"],
         "--gc-grace-seconds must be a finite number >= 0, got inf"),
        ([str(export / "v000009")], f"{export / 'v000009'}: no such version (no "
                                    "manifest.json in it)"),
        ([str(lr_model)], f"{lr_model}: no version to publish (not an export written by "
                          "`terarec export` or `train --export-to`)"),
        # ignored for a local folder, as export refuses them
        ([str(export), "--storage-options", '{"anon": true}'],
         f"--storage-options: {export} is a local folder; the options are for fsspec URLs "
         "such as s3://bucket/prefix"),
    ]
    for extra, message in cases:
        assert cli_main(["publish", *extra, "--to", nowhere]) == 2
        assert _one_line(capsys) == f"terarec publish: error: {message}"
    assert cli_main(["publish", str(export), "--to", nowhere]) == 2  # now the cluster
    assert "no cluster node answered" in _one_line(capsys)


def test_a_run_failing_before_its_first_write_leaves_no_model_folder(data, tmp_path, capsys):
    """DSSM without user fields failed once the model was built, after the model folder
    and its lock files were made: the empty folder was left behind. A folder that was
    there before the run stays."""
    out = tmp_path / "model"
    assert _train(data, out, "--model", "dssm") == 2
    assert "user_fields is empty" in _one_line(capsys)
    assert not out.exists()
    out.mkdir()
    assert _train(data, out, "--model", "dssm") == 2
    assert out.is_dir()


def test_a_one_class_valid_file_writes_its_undefined_auc_as_null(data, tmp_path, capsys):
    """AUC over rows of one class is NaN, which is not JSON: metrics.json, history.json
    and the printed line could not be read by a strict reader."""
    valid = tmp_path / "valid.tsv"
    valid.write_text("".join("0" + line[line.index("\t"):] + "\n"
                             for line in data.read_text().splitlines()[:300]))
    out = tmp_path / "model"
    assert cli_main(["train", "--train", str(data), "--valid", str(valid), "--out",
                     str(out), *TRAIN, "--no-refit"]) == 0
    captured = capsys.readouterr()
    assert "AUC is undefined: every validation label is the same class" in captured.err

    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))

    line = next(x for x in captured.out.splitlines() if x.startswith("{"))
    assert strict(line)["auc"] is None
    assert strict((out / "metrics.json").read_text())["auc"] is None
    history = strict((out / "history.json").read_text())
    assert history and all(h["valid_auc"] is None for h in history)
    assert all(h["valid_logloss"] > 0 for h in history)  # the loss is defined
