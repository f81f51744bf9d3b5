"""Cutting the input stream into passes, read ahead in a background thread.

A pass is ``pass_rows`` rows (a whole number of batches); its boundary is where rows are
written back to the store, checkpoints are committed and deltas exported. Reading and
hashing the next pass (pyarrow and numba release the GIL) overlaps training this one.

Each training pass comes with a ``PassInput``: the row position in every input file after
it (``data.positions``), which the pass's checkpoint records, so that a resumed run reads
on from exactly there whatever its files, pass size or batch size.

A pass reaches the trainer as one ``Pass`` alone and on N ranks (``plan_for``: the
topology adds the key exchange with the owners), so nothing above asks how it is held.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed as dist

from terarec.data.positions import (
    FileMark,
    Idle,
    InputFile,
    PassInput,
    Positions,
    iter_position_passes,
)
from terarec.data.readers import (
    OnBadRow,
    ReadStats,
    iter_batches,
    no_data_rows,
    table_to_batch,
)
from terarec.data.split import iter_tables_from
from terarec.distributed.context import DistContext
from terarec.distributed.lookup import (
    ShardedPassPlan,
    ShardedWorkingSet,
    exchange_plan,
    plan_rank_pass,
)
from terarec.distributed.sharding import deal_batches
from terarec.embedding.device import DeviceRowCache
from terarec.embedding.protocol import EmbeddingStore
from terarec.embedding.working_set import PassPlan, WorkingSet, plan_pass
from terarec.types import Batch, FeatureSchema

Inputs = Iterable[str | Path | InputFile | Idle]  # files, or IDLE while none is new


def iter_file_batches(paths: Iterable[str | Path | InputFile], schema: FeatureSchema,
                      batch_size: int, on_bad_row: OnBadRow = "error",
                      stats: ReadStats | None = None,
                      with_label: bool = True) -> Iterator[Batch]:
    for item in paths:
        path = item.path if isinstance(item, InputFile) else item
        yield from iter_batches(path, schema, batch_size, on_bad_row=on_bad_row, stats=stats,
                                with_label=with_label)


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


def iter_input_passes(items: Inputs, schema: FeatureSchema, batch_size: int,
                      pass_rows: int, positions: Positions, *, per_file: bool = False,
                      on_bad_row: OnBadRow = "error", stats: ReadStats | None = None
                      ) -> Iterator[tuple[list[Batch], PassInput] | Idle]:
    """Passes of at least ``pass_rows`` rows (``per_file``: also ending at every file's
    end) of the rows ``positions`` does not mark consumed, each with its ``PassInput``
    (``data.positions.iter_position_passes``). Batches never span two files; a position
    counts the rows kept, and its mark the bad rows skipped before it."""
    read = stats if stats is not None else ReadStats()

    def steps(item: InputFile, mark: FileMark | None) -> Iterator[tuple[Batch, int, int]]:
        start, skipped = (mark.rows, mark.skipped) if mark is not None else (0, 0)
        if item.empty_ok and no_data_rows(item.path, schema):
            return
        skipped_at_start = read.skipped
        for table in iter_tables_from(item.path, schema, batch_size, start,
                                      seek=skipped == 0, on_bad_row=on_bad_row, stats=read,
                                      skipped_before=skipped):
            yield (table_to_batch(table, schema), table.num_rows,
                   skipped + read.skipped - skipped_at_start)

    return iter_position_passes(items, pass_rows, positions, steps, per_file=per_file)


@dataclass
class Pass:
    """One pass as the trainer takes it, alone or as one of N ranks: this process's
    batches (global keys, one per step) planned once, and what the topology adds.

    ``plan``      the pass's unique keys, each occurrence's position among them and
                  (training) each key's shows and clicks: local work, done ahead
    ``exchange``  N ranks: ``plan``'s requests exchanged with the keys' owners, and the
                  keys this rank serves (``distributed.lookup``); None alone, where
                  there is nothing to exchange

    ``plan_for`` fills both as the topology needs, so nothing above it asks which."""

    plan: PassPlan
    exchange: ShardedPassPlan | None = None

    @property
    def batches(self) -> list[Batch]:
        return self.plan.batches

    @property
    def steps(self) -> int:
        """Optimizer steps: one per batch, since on N ranks each has one per global step."""
        return len(self.plan.batches)

    @property
    def staged_keys(self) -> np.ndarray:
        """The keys whose rows this process stages: the pass's own alone, those this rank
        owns and any rank asked for on N ranks (what a disk tier reads ahead)."""
        return self.plan.keys if self.exchange is None else self.exchange.owned


def plan_for(ctx: DistContext, batches: list[Batch], counts: bool = True,
             group: dist.ProcessGroup | None = None) -> Pass:
    """Plan this process's ``batches`` (``counts``: with shows and clicks, for training);
    on N ranks also exchange their requests with the owners, collectively in ``group``
    (default: the row exchange group; the read-ahead thread uses its own)."""
    local = plan_pass(batches, counts=counts)
    if ctx.world == 1:
        return Pass(local)
    return Pass(local, exchange_plan(ctx, plan_rank_pass(local, ctx.world), group=group))


def stage_pass(ctx: DistContext, store: EmbeddingStore, p: Pass, pass_id: int,
               train: bool = True, cache: DeviceRowCache | None = None
               ) -> WorkingSet | ShardedWorkingSet:
    """Stage ``p``'s rows: alone, into one table on ``ctx.device``; on N ranks (collective)
    the owner's rows every rank asked for. Both write back alike (``StagedRows``) and
    give their steps' rows by ``step_table``."""
    if p.exchange is None:
        return WorkingSet.stage(store, p.plan, pass_id, ctx.device, train=train, cache=cache)
    return ShardedWorkingSet.stage(ctx, store, p.exchange, pass_id, train=train, cache=cache)


def iter_scoring_passes(ctx: DistContext, batches: Iterable[Batch], pass_rows: int
                        ) -> Iterator[Pass]:
    """``batches`` (the same on every rank) as passes to score, planned without counts;
    on N ranks (collective) each rank plans its round-robin share of every pass."""
    for group in group_passes(batches, pass_rows):
        if ctx.world > 1:
            group = deal_batches(group, ctx.rank, ctx.world)
        yield plan_for(ctx, group, counts=False)


def step_order(seed: int, info: PassInput, steps: int) -> np.ndarray:
    """The order ``--shuffle`` trains a pass's ``steps`` batches in: drawn from ``seed``,
    the pass's epoch and the rows the epoch has consumed after it. It depends on nothing
    a resumed run or a rank could see differently: a resumed run trains a pass in the
    order the uninterrupted run did, and every torchrun rank permutes its local batches
    (one per global step) the same way, so N ranks still train what one process does."""
    rng = np.random.default_rng([seed, info.positions.epoch, info.positions.rows])
    return rng.permutation(steps)


def shuffled(batches: list[Batch], seed: int, info: PassInput) -> list[Batch]:
    """``batches`` (one pass, in file order) in their ``step_order``."""
    return [batches[i] for i in step_order(seed, info, len(batches))]


def in_file_order(batches: list[Batch], seed: int, info: PassInput) -> list[Batch]:
    """The file order of a pass's ``shuffled`` batches (a search re-cuts it for a trial
    with another batch size, then shuffles that trial's batches as its own run would)."""
    out: list[Batch] = list(batches)
    for position, index in enumerate(step_order(seed, info, len(batches))):
        out[index] = batches[position]
    return out


def shuffled_steps(passes: Iterator[tuple[list[Batch], PassInput] | Idle], seed: int
                   ) -> Iterator[tuple[list[Batch], PassInput] | Idle]:
    """Each pass's batches in their ``step_order`` (``--shuffle``). Batches keep their
    rows; only the order of the steps changes."""
    for item in passes:
        if isinstance(item, Idle):
            yield item
            continue
        group, info = item
        yield shuffled(group, seed, info), info


READ_AHEAD_NICE = 5  # how much lower than the training thread the read-ahead runs


def _yield_to_training() -> None:
    """Lower the calling thread's scheduling priority by ``READ_AHEAD_NICE`` (Linux
    schedules threads on their own). The read-ahead is a pass ahead, so it can wait;
    the training step cannot: on N ranks a step preempted on one rank stalls every
    rank at the step's next exchange, and on a machine with a core per rank the
    read-ahead then runs in the time the ranks wait in exchanges anyway."""
    if sys.platform != "linux":  # elsewhere the call would lower the whole process
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # not permitted here: the priority stays
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid)
                       + READ_AHEAD_NICE)


def prefetch(items: Iterator, depth: int = 1) -> Iterator:
    """Run ``items`` in a background thread, ``depth`` items ahead; re-raise its errors.

    The thread computes item k + depth only once item k is taken, and when the consumer
    stops early it still computes the items it was allowed to, then ends, before the
    consumer goes on. So the items computed are the same on every torchrun rank however
    the threads are scheduled: items whose making is collective (a rank's pass plan,
    exchanged with the others) never leave one rank in an exchange the others skipped.
    The thread runs at a lower priority than its consumer (``_yield_to_training``).
    """
    q: queue.Queue = queue.Queue()
    done = object()
    stop = threading.Event()
    allowed = threading.Semaphore(depth)  # one more each time the consumer takes one

    def worker() -> None:
        try:
            _yield_to_training()
            while True:
                while not allowed.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                item = next(items, done)
                if item is done:
                    q.put(("done", done))
                    return
                q.put(("item", item))
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
            allowed.release()
            yield item
    finally:
        stop.set()
        thread.join()
