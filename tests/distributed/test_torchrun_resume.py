"""Exact resume under torchrun: ranks read on from each file's recorded row position,
with more files, another pass size or batch size, after a rank died, and at another
world size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_torchrun import HERE, single, torchrun

from terarec.autofeature import Candidate, compute_tables
from terarec.autofeature.features import FeatureConfig
from terarec.data.synth import generate
from terarec.data.synth_features import generate_planted
from terarec.modeldir import load_checkpoint

pytestmark = [pytest.mark.dist, pytest.mark.slow]
ARGS = ["--threads", "1", "--no-progress", "--embedding-dim", "4", "--seed", "3",
        "--epochs", "1"]


def _rows(out: Path) -> list[int]:
    return [h["rows"] for h in json.loads((out / "history.json").read_text())]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("inputs")
    paths = [folder / "f1.tsv", folder / "f2.tsv"]
    for i, p in enumerate(paths):
        generate(p, 5000, model_seed=1, sample_seed=20 + i)
    return paths


def test_ranks_resume_with_more_files_then_alone(files, tmp_path):
    out = tmp_path / "m"
    args = ["--out", str(out), "--pass-rows", "2048", "--batch-size", "256", *ARGS,
            "--valid-split", "0"]
    torchrun(["--train", str(files[0]), *args])
    assert _rows(out) == [2048, 2048, 904]
    torchrun(["--resume", "--train", *map(str, files), *args])
    assert _rows(out) == [2048, 2048, 904, 2048, 2048, 904]
    meta = load_checkpoint(out).meta
    assert meta["world_size"] == 2
    assert [m["rows"] for m in meta["inputs"]["files"].values()] == [5000, 5000]
    # one more file, resumed by a single process from the 2-rank checkpoint
    extra = tmp_path / "f3.tsv"
    generate(extra, 3000, model_seed=1, sample_seed=30)
    single(["--resume", "--train", *map(str, files), str(extra), *args])
    assert sum(_rows(out)) == 13_000


def test_rank_dies_then_resume_with_other_pass_and_batch_size(files, tmp_path):
    out = tmp_path / "m"
    train = ["--train", *map(str, files), "--out", str(out), *ARGS, "--valid-split", "0"]
    died = torchrun([*train, "--pass-rows", "1000", "--batch-size", "250"],
                    script=HERE / "kill_and_resume.py", launcher=("--max-restarts", "0"),
                    env={"KILL_RANK": "1", "KILL_AFTER_PASS": "4"}, check=False)
    assert died.returncode != 0
    assert load_checkpoint(out).meta["pass_id"] == 4
    torchrun(["--resume", *train, "--pass-rows", "2000", "--batch-size", "400"])
    rows = _rows(out)
    assert rows[:4] == [1000] * 4 and sum(rows) == 10_000


def test_ranks_follow_a_folder(files, tmp_path):
    """``train --follow`` on 2 ranks: each landed file split between them, trained once;
    the same folder followed by one process after the ranks stopped."""
    folder, out = tmp_path / "logs", tmp_path / "m"
    folder.mkdir()
    for p in files:
        (folder / p.name).write_bytes(p.read_bytes())
    (folder / "f1a.tsv").write_bytes(b"")  # an hour without events: zero rows, done
    follow = ["--follow", str(folder), "--out", str(out), "--resume", "--batch-size", "256",
              "--pass-rows", "4096", "--poll-seconds", "0.2", *ARGS]
    torchrun([*follow, "--stop-after", "3"])
    history = json.loads((out / "history.json").read_text())
    assert [h["rows"] for h in history] == [4096, 904, 4096, 904]
    assert [h["files"] for h in history] == [["f1.tsv"]] * 2 + [["f2.tsv"]] * 2
    assert history[1]["file_done"] == "f1.tsv" and history[1]["file_rows"] == 5000
    assert all(h["world_size"] == 2 for h in history)
    generate(folder / "f3.tsv", 1000, model_seed=1, sample_seed=40)
    single([*follow, "--stop-after", "4"])
    meta = load_checkpoint(out).meta
    assert sum(h["rows"] for h in meta["history"]) == 11_000
    assert [m["done"] for k, m in meta["inputs"]["files"].items() if k.endswith("f1a.tsv")] \
        == [True]


def test_ranks_follow_a_folder_with_feature_tables(tmp_path):
    """``train --follow --features`` on 2 ranks: rank 0 joins each landed file into the
    follow cache, both ranks read their share of the copy, and a zero-byte file trains
    as zero rows; the copies are gone once read."""
    data = generate_planted(tmp_path / "all.csv", tmp_path / "valid.csv", 4000, 500, seed=2)
    features = [Candidate("count", ("C3",)), Candidate("groupby", ("I1", "C3"), "avg")]
    tables = compute_tables(features, data.train, data.schema, tmp_path / "tables")
    FeatureConfig(data.schema, tables).save(tmp_path / "features.json")
    head, *rows = data.train.read_text().splitlines(keepends=True)
    folder, out = tmp_path / "logs", tmp_path / "m"
    folder.mkdir()
    (folder / "h0.csv").write_text(head + "".join(rows[:2000]))
    (folder / "h1.csv").write_bytes(b"")
    (folder / "h2.csv").write_text(head + "".join(rows[2000:]))
    torchrun(["--follow", str(folder), "--features", str(tmp_path / "features.json"),
              "--out", str(out), "--batch-size", "250", "--pass-rows", "1000",
              "--poll-seconds", "0.2", "--stop-after", "3", *ARGS])
    meta = load_checkpoint(out).meta
    assert [(h["files"], h["rows"], h["world_size"]) for h in meta["history"]] == [
        (["h0.csv"], 1000, 2)] * 2 + [(["h2.csv"], 1000, 2)] * 2
    assert {Path(k).name: (m["rows"], m["done"]) for k, m in meta["inputs"]["files"].items()
            } == {"h0.csv": (2000, True), "h1.csv": (0, True), "h2.csv": (2000, True)}
    assert not [p for p in (out / "follow-cache").rglob("*") if p.is_file()]
