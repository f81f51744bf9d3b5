"""A rank's passes over its share of the input, with the ranks agreeing after every pass
(in-process gloo ranks): a bad row found by one rank stops every rank, skipped rows are
counted over all ranks, positions are the same on every rank and are those one process
records, and a resumed run reads on from them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from ranks import run_ranks

from terarec.data.positions import IDLE, Idle, Positions
from terarec.data.readers import DataError, ReadStats, csv_schema
from terarec.distributed.context import DistContext
from terarec.distributed.sharding import iter_rank_pass_inputs
from terarec.train.passes import iter_input_passes
from terarec.types import FeatureSchema

BATCH, PASS_ROWS = 50, 100  # local batches of 25 rows on 2 ranks, 2 steps a pass


def _schema() -> FeatureSchema:
    return csv_schema("label", ["x"], ["a", "b"])


def _csv(path: Path, rows: int, bad: tuple[int, ...] = ()) -> Path:
    lines = ["label,x,a,b"] + [f"{i % 2},{i}.5,a{i % 9},b{i % 4}" for i in range(rows)]
    for i in bad:
        lines[i + 1] = "1,bad,a1,b1"
    path.write_text("\n".join(lines) + "\n")
    return path


def _walk(ctx: DistContext, items: list, positions: dict | None, on_bad_row: str,
          per_file: bool = False, batch: int = BATCH) -> dict:
    """What this rank's walk yields: per pass the dense values of each local batch and
    the positions after it (IDLE as the string "IDLE"), the error that stopped it, and
    the rows read and skipped."""
    stats = ReadStats()
    items = [IDLE if item == "IDLE" else item for item in items]
    out: list = []
    error = None
    try:
        for entry in iter_rank_pass_inputs(items, _schema(), batch, PASS_ROWS, ctx.rank,
                                           ctx.world, Positions.from_dict(positions),
                                           per_file=per_file, on_bad_row=on_bad_row,
                                           stats=stats, ctx=ctx):
            if isinstance(entry, Idle):
                out.append("IDLE")
                continue
            batches, info = entry
            out.append(([b.dense[:, 0].tolist() for b in batches], info.positions.to_dict(),
                        info.files, info.finished))
    except DataError as exc:
        error = str(exc)
    return {"passes": out, "error": error, "rows": stats.rows, "skipped": stats.skipped}


def test_a_bad_row_on_one_rank_stops_every_rank_after_the_same_passes(tmp_path):
    # Row 230 is in local batch 9 (rows 225-249): rank 1's, in step 4, which the reader
    # reads (one step ahead, to know whether step 3 ends the file) while finishing pass 1.
    path = _csv(tmp_path / "bad.csv", 400, bad=(230,))
    got = run_ranks(_walk, 2, [str(path)], None, "error")
    assert [len(r["passes"]) for r in got] == [1, 1]  # pass 0 was yielded, then both stop
    own, other = got[1]["error"], got[0]["error"]
    assert "bad.csv" in own and "line 232" in own and "'x'" in own, own
    assert own in other and "found by rank 1; every rank stops" in other, other


def test_skipped_rows_are_summed_and_positions_agree_and_resume(tmp_path):
    path = _csv(tmp_path / "skip.csv", 400, bad=(5, 130, 390))
    full = run_ranks(_walk, 2, [str(path)], None, "skip")
    for r in full:  # every rank holds every rank's counts
        assert (r["rows"], r["skipped"]) == (397, 3)
    assert [p[1:] for p in full[0]["passes"]] == [p[1:] for p in full[1]["passes"]]
    assert len(full[0]["passes"]) == 4
    assert full[0]["passes"][-1][1]["files"][str(path)]["done"]
    # Resumed after pass 1 (in lines, as ranks count): the same last two passes.
    resumed = run_ranks(_walk, 2, [str(path)], full[0]["passes"][1][1], "skip")
    for r in range(2):
        assert resumed[r]["passes"] == full[r]["passes"][2:]
        assert (resumed[r]["rows"], resumed[r]["skipped"]) == (199, 1)


def test_ranks_record_the_positions_one_process_records(tmp_path):
    a, b = _csv(tmp_path / "a.csv", 230), _csv(tmp_path / "b.csv", 120)
    items = [str(a), "IDLE", str(b)]
    got = run_ranks(_walk, 2, items, None, "error", True)
    single = []
    for entry in iter_input_passes([a, IDLE, b], _schema(), BATCH, PASS_ROWS, Positions(),
                                   per_file=True):
        if isinstance(entry, Idle):
            single.append("IDLE")
            continue
        batches, info = entry
        single.append(([float(v) for batch in batches for v in batch.dense[:, 0].tolist()],
                       info.positions.to_dict(), info.files, info.finished))
    assert [p if p == "IDLE" else p[1:] for p in got[0]["passes"]] == \
        [p if p == "IDLE" else p[1:] for p in single]
    # The step's local batches, rank 0's then rank 1's, are the single process's rows.
    for step_got, step_single in zip(zip(got[0]["passes"], got[1]["passes"], strict=True),
                                     single, strict=True):
        if step_single == "IDLE":
            assert step_got == ("IDLE", "IDLE")
            continue
        (mine, *_), (theirs, *_) = step_got
        rows = [v for m, t in zip(mine, theirs, strict=True) for v in m + t]
        np.testing.assert_allclose(rows, step_single[0])


def test_a_file_resumed_at_its_end_is_marked_done_on_every_rank(tmp_path):
    # 3 ranks of 20 rows; passes also end at file ends.
    a, b = _csv(tmp_path / "a.csv", 150), _csv(tmp_path / "b.csv", 150)
    first = run_ranks(_walk, 3, [str(a), str(b)], None, "error", True, 60)
    after_a = next(p[1] for p in first[0]["passes"] if str(a) in p[3])
    marks = {**after_a, "files": {str(a): {**after_a["files"][str(a)], "done": False}}}
    resumed = run_ranks(_walk, 3, [str(a), str(b)], marks, "error", True, 60)
    for r in resumed:
        files = r["passes"][-1][1]["files"]
        assert files[str(a)]["done"] and files[str(b)]["done"]
        assert r["rows"] == 150  # nothing of a read again
