"""Cutting the input stream into passes, read ahead in a background thread.

A pass is ``pass_rows`` rows (a whole number of batches); its boundary is where rows are
written back to the store, checkpoints are committed and deltas exported. Reading and
hashing the next pass (pyarrow and numba release the GIL) overlaps training this one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from terarec.data.readers import OnBadRow, ReadStats, iter_batches
from terarec.types import Batch, FeatureSchema


def iter_file_batches(paths: Iterable[str | Path], schema: FeatureSchema, batch_size: int,
                      on_bad_row: OnBadRow = "error",
                      stats: ReadStats | None = None) -> Iterator[Batch]:
    for path in paths:
        yield from iter_batches(path, schema, batch_size, on_bad_row=on_bad_row, stats=stats)


def group_passes(batches: Iterable[Batch], pass_rows: int) -> Iterator[list[Batch]]:
    """Group consecutive batches into passes of at least ``pass_rows`` rows (last may be short)."""
    current: list[Batch] = []
    rows = 0
    for batch in batches:
        current.append(batch)
        rows += len(batch)
        if rows >= pass_rows:
            yield current
            current, rows = [], 0
    if current:
        yield current


def prefetch(items: Iterator, depth: int = 1) -> Iterator:
    """Run ``items`` in a background thread, ``depth`` items ahead; re-raise its errors."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def worker() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put(("item", item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(("done", done))
        except BaseException as exc:  # handed to the consumer, raised there
            q.put(("error", exc))

    thread = threading.Thread(target=worker, name="terarec-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            kind, item = q.get()
            if kind == "done":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()
