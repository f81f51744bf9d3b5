"""``terarec predict``: one click probability per input row."""

from __future__ import annotations

import argparse
import contextlib
import heapq
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

import numpy as np

from terarec.cli.common import add_model_data_args, model_files, report_skipped
from terarec.cli.main import UserError

if TYPE_CHECKING:
    from terarec.data.readers import ReadStats


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="score rows with a model", description=__doc__)
    add_model_data_args(p, "input file(s)")
    p.add_argument("--out", type=Path, help="output file, one score per line (default "
                   "stdout); with --on-bad-row skip a skipped row's line is left empty")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.out is not None:  # scores are written in its place once read: it is lost
        for path in args.data:
            if os.path.realpath(path) == os.path.realpath(args.out):
                raise UserError(f"--out {args.out} is the input file {path}: its scores "
                                "would replace it; write them to another file")
    from terarec.api.model import check_rows_scored, first_data_row
    from terarec.data.readers import ReadStats, iter_batches

    skip = args.on_bad_row == "skip"
    total = ReadStats()
    with model_files(args) as (trainer, schema, data), _output(args.out) as fh:
        for path in data:  # file by file: a skipped row's place is its line in its file
            stats = ReadStats(skipped_at=[] if skip else None)
            batches = iter_batches(path, schema, trainer.config.batch_size,
                                   on_bad_row=args.on_bad_row or "error", stats=stats,
                                   with_label=False)
            scores = _checked(trainer.predict_stream(batches), str(args.model))
            if skip:
                _write_in_place(fh, scores, stats, first_data_row(path, schema))
            else:
                for probs in scores:
                    np.savetxt(fh, probs, fmt="%.8f")
            total.rows += stats.rows
            total.skipped += stats.skipped
            total.examples += stats.examples[:total.max_examples - len(total.examples)]
        check_rows_scored(args.data, total)
    report_skipped(total)
    return 0


@contextlib.contextmanager
def _output(out: Path | None) -> Iterator[IO[str]]:
    from terarec.io import atomic_open

    if out is None:
        yield sys.stdout
        return
    with atomic_open(out, "w") as fh:
        yield fh


def _checked(scored: Iterable[tuple[np.ndarray, np.ndarray]], where: str
             ) -> Iterator[np.ndarray]:
    from terarec.finite import check_model_scores

    for probs, _ in scored:
        check_model_scores(probs, where)
        yield probs


def _write_in_place(fh: IO[str], scores: Iterable[np.ndarray], stats: ReadStats,
                    first: int) -> None:
    """Write each score on its row's line, leaving the lines of skipped rows empty, so
    line N of the output still answers data row N. The reader reports a skipped row
    before it delivers any row after it, so every gap is known when it is reached; the
    scores between two gaps go out in one ``savetxt``."""
    assert stats.skipped_at is not None
    pending: list[int] = []  # data-row indices of skipped rows not written yet (a heap)
    seen = 0  # of stats.skipped_at
    row = 0  # data rows written (scores and empty lines)

    def gaps_before(end: int | None) -> list[int]:
        """The pending gaps among the next ``end`` scores' lines (the window grows by
        one line per gap taken); ``None``: every one left."""
        nonlocal seen
        for at in stats.skipped_at[seen:]:  # type: ignore[index]
            heapq.heappush(pending, at - first)
        seen = len(stats.skipped_at)  # type: ignore[arg-type]
        gaps: list[int] = []
        while pending and (end is None or pending[0] < row + end + len(gaps)):
            gaps.append(heapq.heappop(pending))
        if gaps and gaps[0] < row:
            raise RuntimeError("predict: a skipped row was reported after rows that "
                               "follow it were written")
        return gaps

    for probs in scores:
        start = 0
        for gap in gaps_before(len(probs)):
            take = gap - row  # scores before this gap
            np.savetxt(fh, probs[start:start + take], fmt="%.8f")
            fh.write("\n")
            start, row = start + take, gap + 1
        np.savetxt(fh, probs[start:], fmt="%.8f")
        row += len(probs) - start
    for gap in gaps_before(None):  # skipped rows after the last scored one
        if gap != row:
            raise RuntimeError("predict: a skipped row was reported after rows that "
                               "follow it were written")
        fh.write("\n")
        row += 1
