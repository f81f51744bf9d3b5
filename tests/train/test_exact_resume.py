"""Exact resume: a checkpoint records each input file's row position, so a resumed run
trains every row exactly once whatever its files, pass size or batch size, also after
SIGKILL; a file that changed since it was consumed is refused by name."""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from terarec.cli.main import main
from terarec.data.positions import Positions
from terarec.data.readers import DataError, csv_schema, iter_tables
from terarec.data.split import iter_tables_from, line_index
from terarec.data.synth import generate
from terarec.modeldir import load_checkpoint

SRC = Path(__file__).resolve().parents[2] / "src"
# every row trained every epoch (no validation rows carved): the positions are the point
COMMON = ["--threads", "1", "--no-progress", "--embedding-dim", "4", "--seed", "3",
          "--valid-split", "0"]


def _history_rows(out: Path) -> list[int]:
    return [h["rows"] for h in json.loads((out / "history.json").read_text())]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("inputs")
    paths = [folder / "f1.tsv", folder / "f2.tsv"]
    for i, p in enumerate(paths):
        generate(p, 5000, model_seed=1, sample_seed=10 + i)
    return paths


def _last_pass(out: Path) -> int:
    """The newest committed checkpoint (older ones are pruned as the run goes on)."""
    names = [p.name for p in (out / "checkpoints").glob("pass-*")]
    return max((int(n[5:]) for n in names if n[5:].isdigit()), default=0)


def test_resume_with_more_files_trains_every_row_once(files, tmp_path):
    """Issue scenario 1: f1's short last pass is not cut again with the start of f2."""
    out = tmp_path / "m"
    args = ["--pass-rows", "2048", "--batch-size", "256", *COMMON]
    assert main(["train", "--train", str(files[0]), "--out", str(out), *args]) == 0
    assert _history_rows(out) == [2048, 2048, 904]
    assert main(["train", "--resume", "--train", *map(str, files), "--out", str(out),
                 *args]) == 0
    assert _history_rows(out) == [2048, 2048, 904, 2048, 2048, 904]
    inputs = load_checkpoint(out).meta["inputs"]["files"]
    assert {Path(k).name: (m["rows"], m["done"]) for k, m in inputs.items()} == {
        "f1.tsv": (5000, True), "f2.tsv": (5000, True)}


def test_sigkill_then_resume_with_other_pass_and_batch_size(files, tmp_path):
    """Issue scenario 2: killed at a random moment after pass 4, resumed with twice the
    pass size and another batch size: every row trained exactly once. Twenty short passes
    and a short random wait keep the kill inside the run on a fast machine too."""
    out = tmp_path / "m"
    train = ["--train", *map(str, files), "--out", str(out), *COMMON]
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "terarec", "train", *train,
                             "--pass-rows", "500", "--batch-size", "250"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while _last_pass(out) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, "run ended early"
            time.sleep(0.01)
        time.sleep(random.uniform(0.0, 0.03))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    committed = load_checkpoint(out).meta["pass_id"]
    assert 4 <= committed < 20
    assert main(["train", "--resume", *train, "--pass-rows", "1000",
                 "--batch-size", "400"]) == 0
    rows = _history_rows(out)
    assert rows[:committed] == [500] * committed
    # a pass is at least --pass-rows rows in whole batches
    assert sum(rows) == 10_000 and all(r < 1000 + 400 for r in rows[committed:])


def test_changed_input_is_refused_by_name(files, tmp_path, capsys):
    out = tmp_path / "m"
    data = tmp_path / "part.tsv"
    shutil.copy(files[0], data)
    args = ["--train", str(data), "--out", str(out), "--pass-rows", "2048", *COMMON]
    assert main(["train", *args]) == 0
    with open(data, "ab") as fh:  # more rows appended to a consumed file
        fh.write(files[1].read_bytes()[:2000].rsplit(b"\n", 1)[0] + b"\n")
    assert main(["train", "--resume", *args]) == 2
    assert f"{data}: input file changed since 5000 of its rows" in capsys.readouterr().err


def _all_rows(tables) -> pa.Table:
    return pa.concat_tables(list(tables))


@pytest.mark.parametrize("kind", ["tsv", "header-csv", "gz", "parquet", "bad-rows"])
def test_reading_from_a_row_equals_dropping_the_rows_before(tmp_path, kind):
    rng = random.Random(1)
    rows = [(rng.randint(0, 1), rng.random(), f"k{rng.randint(0, 50)}") for _ in range(997)]
    if kind == "parquet":
        path = tmp_path / "d.parquet"
        pq.write_table(pa.table({"label": [r[0] for r in rows], "x": [r[1] for r in rows],
                                 "c": [r[2] for r in rows]}), path, row_group_size=100)
        schema = csv_schema("label", ["x"], ["c"], format="parquet")
    else:
        lines = [f"{a},{b},{c}" for a, b, c in rows]
        if kind == "bad-rows":
            lines[10] = "1,notanumber,k1"
        text = "label,x,c\n" + "\n".join(lines) + "\n"
        path = tmp_path / ("d.csv.gz" if kind == "gz" else "d.csv")
        path.write_bytes(gzip.compress(text.encode()) if kind == "gz" else text.encode())
        schema = csv_schema("label", ["x"], ["c"])
    skip = "skip" if kind == "bad-rows" else "error"
    whole = _all_rows(iter_tables(path, schema, 64, on_bad_row=skip))
    for start in (0, 1, 99, 100, 640, len(whole) - 1, len(whole)):
        got = list(iter_tables_from(path, schema, 64, start, seek=kind != "bad-rows",
                                    on_bad_row=skip))
        assert all(t.num_rows == 64 for t in got[:-1])
        if start == len(whole):
            assert got == []
            continue
        assert _all_rows(got).equals(whole.slice(start)), start


def test_line_index_from_a_line(tmp_path):
    path = tmp_path / "d.tsv"
    path.write_text("".join(f"{i}\n" for i in range(10)))
    index = line_index(path, 3, first_line=4)
    assert index is not None and index.lines == 6
    offsets = [int(o) for o in index.starts]
    assert [path.read_bytes()[o:o + 1] for o in offsets[:-1]] == [b"4", b"7"]
    assert offsets[-1] == path.stat().st_size


def test_positions_round_trip_and_refuse_a_changed_file(tmp_path):
    from terarec.data.positions import as_input

    path = tmp_path / "a.tsv"
    path.write_text("1\n2\n")
    positions = Positions(epoch=1)
    positions.advance(as_input(path), 2, True)
    again = Positions.from_dict(json.loads(json.dumps(positions.to_dict())))
    assert again.start(as_input(path)).rows == 2
    path.write_text("1\n3\n")  # same size, other bytes
    with pytest.raises(DataError, match="a.tsv: input file changed .*checksum"):
        Positions.from_dict(positions.to_dict()).start(as_input(path))


def test_bad_input_positions_in_meta_are_refused(files, tmp_path):
    from terarec.modeldir import CheckpointError, list_checkpoints, verify_checkpoint

    out = tmp_path / "m"
    assert main(["train", "--train", str(files[0]), "--out", str(out), "--pass-rows",
                 "4096", *COMMON]) == 0
    newest = list_checkpoints(out)[0]
    meta = json.loads((newest / "meta.json").read_text())
    assert meta["inputs"]["files"][str(files[0])]["rows"] == 5000
    meta["inputs"]["files"][str(files[0])]["rows"] = -1
    (newest / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"inputs.*rows"):
        verify_checkpoint(newest)


def test_rank_share_after_skipped_rows_reads_on_from_the_kept_row(tmp_path):
    """A single process's position after skipped bad rows counts kept rows: ranks find it
    by reading the file from its start (``seek=False``)."""
    from terarec.data.split import iter_rank_tables

    lines = [f"{i % 2},{i}.5,k{i}" for i in range(300)]
    lines[7] = "1,bad,k7"
    path = tmp_path / "d.csv"
    path.write_text("label,x,c\n" + "\n".join(lines) + "\n")
    schema = csv_schema("label", ["x"], ["c"])
    kept = _all_rows(iter_tables(path, schema, 50, on_bad_row="skip"))
    assert kept.num_rows == 299
    for world in (1, 2):
        steps = [list(iter_rank_tables(path, schema, 25, r, world, on_bad_row="skip",
                                       start=100, seek=False)) for r in range(world)]
        assert sum(n for _, n in steps[0]) == 199
        tables = [t for s in range(len(steps[0])) for r in range(world)
                  if (t := steps[r][s][0]) is not None]
        assert _all_rows(tables).equals(kept.slice(100))
