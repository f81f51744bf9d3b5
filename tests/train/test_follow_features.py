"""``terarec train --follow SOURCE --features``: every landed file is joined with the
AutoFeature tables into a copy under the follow cache and trained from it, as
``--train FILES --features`` trains joined copies; a file with no data rows trains as
zero rows; checkpoints name and fingerprint the landed file, so a resumed run continues
inside a file whose copy is made again."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from terarec.autofeature import Candidate, compute_tables
from terarec.autofeature.features import FeatureConfig
from terarec.cli import train as train_cli
from terarec.cli.main import build_parser, main
from terarec.data.positions import fingerprint
from terarec.data.synth_features import generate_planted
from terarec.export.storage import Storage
from terarec.modeldir import load_checkpoint, read_model_meta
from terarec.train.follow import (
    PREPARED_DIR,
    FollowOptions,
    FollowSource,
    Prepare,
    first_landed,
)

FEATURES = [Candidate("count", ("C3",)), Candidate("cross_count", ("C5", "C7")),
            Candidate("groupby", ("I1", "C3"), "avg")]
FILE_ROWS = 2000
# Every data-sized default fixed (batch size, width, admission), statistics from the first
# file's rows: a --follow run and a --train run of the same files then train alike.
ARGS = ["--threads", "1", "--no-progress", "--model", "deepfm", "--embedding-dim", "4",
        "--seed", "3", "--batch-size", "250", "--epochs", "1", "--admit-min-count", "1",
        "--stats-rows", str(FILE_ROWS), "--sparse-initial-accumulator", "0.001"]
FOLLOW = ["--poll-seconds", "0.2"]


@pytest.fixture(scope="module")
def landed(tmp_path_factory):
    """A feature config and three data files of 2,000 rows each, landed in name order
    between a zero-byte file and a header-only one."""
    root = tmp_path_factory.mktemp("follow-features")
    data = generate_planted(root / "all.csv", root / "valid.csv", 3 * FILE_ROWS, 1500,
                            seed=2)
    tables = compute_tables(FEATURES, data.train, data.schema, root / "tables")
    FeatureConfig(data.schema, tables).save(root / "features.json")
    head, *rows = data.train.read_text().splitlines(keepends=True)
    folder = root / "logs"
    folder.mkdir()
    files = []
    for i in range(3):
        path = folder / f"h{2 * i:02d}.csv"
        path.write_text(head + "".join(rows[i * FILE_ROWS:(i + 1) * FILE_ROWS]))
        files.append(path)
    (folder / "h01.csv").write_bytes(b"")
    (folder / "h03.csv").write_text(head)
    return root, folder, files, data


def _summary(capsys) -> dict:
    return json.loads(capsys.readouterr().out.splitlines()[1])  # after "features: ..."


def test_follow_with_features_trains_every_row_like_train_with_features(landed, tmp_path,
                                                                        capsys):
    root, folder, files, data = landed
    features = str(root / "features.json")
    out = tmp_path / "followed"
    assert main(["train", "--follow", str(folder), "--features", features, "--out",
                 str(out), "--stop-after", "5", "--pass-rows", "100000", *FOLLOW,
                 *ARGS]) == 0
    summary = _summary(capsys)
    assert summary["rows"] == 3 * FILE_ROWS and summary["files_trained"] == 5
    meta = load_checkpoint(out).meta
    assert [(h["files"], h["rows"]) for h in meta["history"]] == [
        ([p.name], FILE_ROWS) for p in files]
    marks = meta["inputs"]["files"]
    # named and fingerprinted by the landed files, the two without rows done at 0
    assert sorted(marks) == sorted(str(p) for p in folder.iterdir())
    assert all(m["done"] for m in marks.values())
    for path in files:
        assert (marks[str(path)]["size"], marks[str(path)]["sha256"]) == fingerprint(path)
    assert not [p for p in (out / "follow-cache").rglob("*") if p.is_file()]
    # The model carries its tables; statistics were taken on the joined first file.
    assert (out / "features" / "features.json").exists()
    schema = read_model_meta(out)[0]
    assert [f.name for f in schema.fields][-3:] == [t.name for t in FEATURES]
    avg = schema.fields[-1]
    assert avg.kind == "numeric" and avg.mean is not None and avg.std

    # eval and predict join raw rows with the model's own tables
    assert main(["eval", "--model", str(out), "--data", str(data.valid)]) == 0
    followed_auc = json.loads((out / "eval_metrics.json").read_text())["auc"]
    assert 0.5 < followed_auc < 1
    assert main(["predict", "--model", str(out), "--data", str(data.valid), "--out",
                 str(tmp_path / "followed.txt")]) == 0

    # The same files as --train, a pass per file: the same model.
    trained = tmp_path / "trained"
    assert main(["train", "--train", *map(str, files), "--features", features, "--out",
                 str(trained), "--pass-rows", str(FILE_ROWS), "--valid-split", "0", *ARGS]) == 0
    assert main(["predict", "--model", str(trained), "--data", str(data.valid), "--out",
                 str(tmp_path / "trained.txt")]) == 0
    np.testing.assert_allclose(np.loadtxt(tmp_path / "followed.txt"),
                               np.loadtxt(tmp_path / "trained.txt"), rtol=0, atol=1e-6)
    assert main(["eval", "--model", str(trained), "--data", str(data.valid)]) == 0
    trained_auc = json.loads((trained / "eval_metrics.json").read_text())["auc"]
    assert trained_auc == pytest.approx(followed_auc, abs=1e-9)


class _Crash(Exception):
    pass


def test_follow_with_features_resumes_inside_a_file(landed, tmp_path, capsys):
    """Stopped after the first half of the first file, the run is resumed from the
    model's own tables (no --features): the file's joined copy is made again and
    training continues at its 1,001st row; the landed file changed is refused."""
    root, folder, files, _ = landed
    out = tmp_path / "model"
    argv = ["train", "--follow", str(folder), "--out", str(out), "--pass-rows",
            str(FILE_ROWS // 2), *FOLLOW, *ARGS]

    def crash(trainer) -> None:
        raise _Crash  # as if killed right after the first checkpoint

    with pytest.raises(_Crash):
        train_cli.run(build_parser("train").parse_args(
            [*argv, "--features", str(root / "features.json")]), on_commit=crash)
    first = load_checkpoint(out).meta["inputs"]["files"]
    assert first == {str(files[0]): {**first[str(files[0])], "rows": FILE_ROWS // 2,
                                     "done": False}}

    changed = tmp_path / "changed"  # the landed file rewritten: refused by name
    shutil.copytree(out, changed)
    original = files[0].read_bytes()
    try:
        head, first_row = original.split(b"\n", 1)  # the first row's label flipped
        files[0].write_bytes(head + b"\n" + (b"1" if first_row[:1] == b"0" else b"0")
                             + first_row[1:])
        assert main([*argv[:4], str(changed), *argv[5:], "--resume", "--stop-after",
                     "1"]) == 2
        assert f"{files[0]}: input file changed since {FILE_ROWS // 2} of its rows were " \
               "trained" in capsys.readouterr().err
    finally:
        files[0].write_bytes(original)

    assert main([*argv, "--resume", "--stop-after", "5"]) == 0
    meta = load_checkpoint(out).meta
    assert [(h["files"], h["rows"]) for h in meta["history"]] == [
        ([p.name], FILE_ROWS // 2) for p in files for _ in range(2)]
    assert {k: m["rows"] for k, m in meta["inputs"]["files"].items() if m["rows"]} == {
        str(p): FILE_ROWS for p in files}


def test_follow_with_features_refuses_on_bad_row_skip(landed, tmp_path, capsys):
    root, folder, _, _ = landed
    out = tmp_path / "m"
    assert main(["train", "--follow", str(folder), "--features",
                 str(root / "features.json"), "--out", str(out), "--on-bad-row", "skip",
                 *FOLLOW, *ARGS]) == 2
    assert "--on-bad-row skip (on_bad_row in --config) does not work with AutoFeature " \
           "tables" in capsys.readouterr().err
    assert not out.exists()


def test_an_s3_file_is_joined_into_the_cache(landed, tmp_path, s3_server):
    """An object store's file is downloaded, joined and its download removed; the copy
    keeps the rows in order; a file with no rows gets a zero-byte copy, not a join;
    first_landed's copy is its own and removed on exit."""
    root, _, files, data = landed
    config = FeatureConfig.load(root / "features.json")
    storage = Storage("s3://joined/hourly", s3_server)
    storage.fs.mkdir("joined")
    storage.write_bytes("a.csv", files[0].read_bytes())
    storage.write_bytes("b.csv", b"")
    prepare = Prepare(data.schema, config.augment_file)
    options = FollowOptions("s3://joined/hourly", s3_server, prepare=prepare)
    cache = tmp_path / "cache"
    source = FollowSource(options, cache)

    item = source.fetch("a.csv")
    assert item.key == "s3://joined/hourly/a.csv" and item.path == cache / PREPARED_DIR / "a.csv"
    assert item.fingerprint == fingerprint(files[0]) and not (cache / "a.csv").exists()
    joined = pq.read_table(item.path)
    assert joined.column_names[-3:] == [t.name for t in FEATURES]
    raw = pa_csv.read_csv(files[0], convert_options=pa_csv.ConvertOptions(
        column_types={n: pa.string() for n in ("label", "C3")}))
    assert joined.num_rows == FILE_ROWS
    for name in ("label", "C3"):  # the file's rows, in its order
        assert joined.column(name).cast(pa.string()).to_pylist() == \
            raw.column(name).to_pylist()

    empty = source.fetch("b.csv")
    assert empty.path.stat().st_size == 0 and empty.empty_ok

    with first_landed(options, cache, data.schema) as first:
        own = first.path
        assert own.parents[1].parent == cache and own.parents[1].name.startswith("_first-")
        assert pq.read_table(own).equals(joined)
    assert not own.parents[1].exists()
