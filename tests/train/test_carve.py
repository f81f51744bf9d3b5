"""Validation rows carved from the training input: the last share of its rows, cut in
input order, each row on exactly one side; a run given no --valid on small data selects
on them and refits on all rows; --valid-split 0 and --valid restore the old runs."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from terarec.cli.main import main
from terarec.data.spec import DataSpec
from terarec.data.synth import generate
from terarec.train.carve import CarveError, carve, check_valid_split

CSV = DataSpec.of(format="csv", label="y", numeric="x", categorical="c").schema()
CRITEO = DataSpec().schema()
TRAIN = ["--batch-size", "200", "--embedding-dim", "4", "--threads", "1", "--no-progress",
         "--seed", "3", "--model", "lr", "--epochs", "3"]


def _csv(path: Path, rows: range) -> list[str]:
    lines = [f"{i % 2},{i},v{i}\n" for i in rows]
    path.write_text("y,x,c\n" + "".join(lines))
    return lines


def _data_lines(path: Path, header: bool) -> list[str]:
    lines = path.read_text().splitlines(keepends=True)
    return lines[1:] if header else lines


def test_the_cut_falls_in_one_file_the_others_are_used_as_they_are(tmp_path):
    files = [tmp_path / f"part{i}.csv" for i in range(3)]
    rows = [_csv(f, range(lo, hi)) for f, (lo, hi) in
            zip(files, ((0, 50), (50, 90), (90, 100)), strict=True)]
    carved = carve(files, CSV, 0.125, tmp_path / "carved")
    assert carved is not None
    assert (carved.fit_rows, carved.valid_rows) == (88, 12)  # floor(100 / 8) validate
    # part0 trains as it is, part2 validates as it is, part1 is cut at its 38th row
    assert [p.path for p in carved.fit][0] == files[0]
    assert [p.path for p in carved.valid][-1] == files[2]
    assert [(p.source.name, p.first, p.end) for p in carved.fit] == [
        ("part0.csv", 0, 50), ("part1.csv", 0, 38)]
    assert [(p.source.name, p.first, p.end) for p in carved.valid] == [
        ("part1.csv", 38, 40), ("part2.csv", 0, 10)]
    fit = [line for p in carved.fit for line in _data_lines(p.path, True)]
    valid = [line for p in carved.valid for line in _data_lines(p.path, True)]
    everything = [line for part in rows for line in part]
    assert fit + valid == everything  # no row twice, none left out, order kept
    for p in [*carved.fit, *carved.valid]:  # every copy keeps the header
        assert p.path.read_text().startswith("y,x,c\n")
    summary = carved.summary()
    assert summary["valid_files"][0] == {"file": str(files[1]), "rows": [38, 40]}


def test_criteo_and_compressed_files_are_cut_by_lines(tmp_path):
    plain, packed = tmp_path / "train.tsv", tmp_path / "train.tsv.gz"
    generate(plain, 801, model_seed=1, sample_seed=2)
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for source in (plain, packed):
        carved = carve([source], CRITEO, 0.25, tmp_path / f"carved-{source.suffix}")
        assert carved is not None and (carved.fit_rows, carved.valid_rows) == (601, 200)
        fit, valid = carved.fit[0].path, carved.valid[0].path
        assert fit.name == "fit-train.tsv"  # written decompressed
        assert fit.read_bytes() + valid.read_bytes() == plain.read_bytes()
        assert len(_data_lines(valid, False)) == 200


def test_parquet_is_cut_by_rows(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"y": [i % 2 for i in range(40)], "x": list(range(40))}),
                   path, row_group_size=7)
    carved = carve([path], DataSpec.of(format="parquet", label="y", numeric="x").schema(),
                   0.125, tmp_path / "carved")
    assert carved is not None
    assert pq.read_table(carved.fit[0].path)["x"].to_pylist() == list(range(35))
    assert pq.read_table(carved.valid[0].path)["x"].to_pylist() == list(range(35, 40))


def test_a_value_spanning_lines_cannot_be_cut(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text('y,x,c\n1,2,"a\nb"\n0,3,c\n')
    with pytest.raises(CarveError, match="spanning lines"):
        carve([path], CSV, 0.125, tmp_path / "carved")


@pytest.mark.parametrize("value", [-0.1, 0.6, math.nan, "0.1", True])
def test_a_bad_share_is_refused_naming_the_flag(value):
    with pytest.raises(ValueError, match=r"--valid-split .*\[0, 0.5\]"):
        check_valid_split(value)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("carve") / "train.tsv"
    generate(path, 1600, model_seed=1, sample_seed=2)
    return path


def _train(data: Path, out: Path, *extra: str) -> dict:
    assert main(["train", "--train", str(data), "--out", str(out), *TRAIN, *extra]) == 0
    return json.loads((out / "metrics.json").read_text())


def test_small_data_without_valid_selects_on_its_last_rows_and_refits_on_all(
        data, tmp_path, capsys):
    out = tmp_path / "m"
    metrics = _train(data, out)
    assert "validation: last 12.5% of training rows carved (200 of 1,600" \
        in capsys.readouterr().err
    assert metrics["validation"] == {
        "carved": True, "fraction": 0.125, "rows": 200, "fit_rows": 1400,
        "valid_files": [{"file": str(data), "rows": [1400, 1600]}],
        "fit_files": [{"file": str(data), "rows": [0, 1400]}]}
    assert metrics["evaluated_on"] == "valid" and metrics["eval_rows"] == 200
    history = json.loads((out / "history.json").read_text())
    # the selection passes train the fit rows only; the refit trains all of them
    assert history and all(h["rows"] == 1400 for h in history)
    assert metrics["rows"] == 1400 * metrics["passes"]
    assert metrics["refit"]["rows"] == 1600 * metrics["refit"]["epochs"]
    assert (out / "BEST").read_text() == metrics["refit"]["checkpoint"]
    assert not (out / "carved").exists()  # the copies go when the run ends
    inputs = json.loads((out / "inputs.json").read_text())["files"]
    assert inputs == [{**inputs[0], "path": str(data), "role": "train", "trained": True,
                       "valid_rows": [1400, 1600]}]


def test_valid_split_zero_trains_every_row_without_validation(data, tmp_path):
    metrics = _train(data, tmp_path / "m", "--valid-split", "0")
    assert metrics["validation"] == {"carved": False, "reason": "turned off (--valid-split 0)"}
    assert metrics["evaluated_on"] == "train" and "refit" not in metrics
    assert metrics["rows"] == 1600 * 3  # every epoch of --epochs, every row


def test_an_explicit_valid_carves_nothing(data, tmp_path):
    valid = tmp_path / "valid.tsv"
    generate(valid, 300, model_seed=1, sample_seed=9)
    metrics = _train(data, tmp_path / "m", "--valid", str(valid))
    assert metrics["validation"] == {"carved": False, "valid_files": [str(valid)]}
    assert metrics["eval_rows"] == 300
    assert metrics["refit"]["rows"] == 1900 * metrics["refit"]["epochs"]


def test_a_given_share_carves_that_share(data, tmp_path):
    metrics = _train(data, tmp_path / "m", "--valid-split", "0.25", "--no-refit")
    assert metrics["validation"]["rows"] == 400 and metrics["eval_rows"] == 400
    assert "refit" not in metrics


@pytest.mark.parametrize(("extra", "message"), [
    (["--valid-split", "0.75"], "--valid-split 0.75: must be a share"),
    (["--valid-split", "0.2", "--valid", "V"], "--valid gives them: give one"),
])
def test_bad_splits_are_one_line_naming_the_flag(data, tmp_path, capsys, extra, message):
    extra = [str(tmp_path / "v.tsv") if e == "V" else e for e in extra]  # never read
    out = tmp_path / "m"
    assert main(["train", "--train", str(data), "--out", str(out), *TRAIN, *extra]) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not out.exists()


def test_follow_refuses_a_split(tmp_path, capsys):
    assert main(["train", "--follow", str(tmp_path), "--out", str(tmp_path / "m"),
                 "--valid-split", "0.1", "--stop-idle", "1"]) == 2
    assert "does not apply to --follow" in capsys.readouterr().err


def test_fit_takes_valid_split(data, tmp_path):
    import terarec

    terarec.fit(data, out=tmp_path / "m", valid_split=0.5, batch_size=200, epochs=2,
                model="lr", threads=1, progress=False, refit=False)
    metrics = json.loads((tmp_path / "m" / "metrics.json").read_text())
    assert metrics["validation"]["rows"] == 800 and metrics["validation"]["fit_rows"] == 800
    with pytest.raises(ValueError, match=r"--valid-split 0.9"):
        terarec.fit(data, out=tmp_path / "n", valid_split=0.9)


def test_a_resumed_run_carves_only_where_it_did(data, tmp_path, capsys):
    plain = tmp_path / "plain"
    _train(data, plain, "--valid-split", "0", "--epochs", "1")
    metrics = _train(data, plain, "--resume", "--epochs", "2")  # trained before: no cut
    assert metrics["validation"]["carved"] is False
    assert "resumed trained without validation" in metrics["validation"]["reason"]
    history = json.loads((plain / "history.json").read_text())
    assert [h["rows"] for h in history] == [1600, 1600]  # every row, both epochs
    carved = tmp_path / "carved"
    _train(data, carved, "--epochs", "1", "--no-refit")
    metrics = _train(data, carved, "--resume", "--epochs", "2", "--no-refit")
    assert metrics["validation"]["carved"] is True and metrics["eval_rows"] == 200
    history = json.loads((carved / "history.json").read_text())
    assert [h["rows"] for h in history] == [1400, 1400]  # the same fit rows again


def test_messages_name_the_input_file_and_its_lines(tmp_path):
    path = tmp_path / "clicks.csv"
    _csv(path, range(16))
    carved = carve([path], CSV, 0.25, tmp_path / "carved")
    assert carved is not None
    fit, valid = carved.fit[0].path, carved.valid[0].path
    # the copy's line 3 is data row 2 of the validation rows: row 14 of the file, line 15
    assert carved.name_sources(f"{valid}: line 3: field 'x': bad; {fit}: line 5") \
        == f"{path}: line 15: field 'x': bad; {path}: line 5"
    assert carved.name_sources(f"{valid}: line 1: empty header line") \
        == f"{path}: line 1: empty header line"
    assert carved.name_sources(f"no rows in {valid}") == f"no rows in {path}"


@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 20])
def test_the_cut_is_exact_whatever_the_read_size(tmp_path, monkeypatch, chunk):
    """Files are copied in chunks (1 MB): the header, the cut and the end may fall
    anywhere in one."""
    import terarec.train.carve as carve_module

    monkeypatch.setattr(carve_module, "_CHUNK", chunk)
    path = tmp_path / "clicks.csv.gz"
    rows = [f"{i % 2},{i},v{i}\n" for i in range(37)]
    path.write_bytes(gzip.compress(("y,x,c\n" + "".join(rows)).encode()))
    carved = carve([path], CSV, 0.25, tmp_path / "carved")
    assert carved is not None and (carved.fit_rows, carved.valid_rows) == (28, 9)
    assert carved.fit[0].path.read_text() == "y,x,c\n" + "".join(rows[:28])
    assert carved.valid[0].path.read_text() == "y,x,c\n" + "".join(rows[28:])


def test_a_resumed_run_whose_cut_would_move_is_refused(data, tmp_path, capsys):
    more = tmp_path / "more.tsv"
    generate(more, 400, model_seed=1, sample_seed=7)
    out = tmp_path / "m"
    _train(data, out, "--epochs", "1", "--no-refit")
    assert main(["train", "--train", str(data), str(more), "--out", str(out), "--resume",
                 *TRAIN]) == 2
    assert "the validation rows carved from --train moved" in capsys.readouterr().err
