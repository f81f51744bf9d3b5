"""Which rank owns a key, and which rows of the input each rank reads.

Keys: rank ``r`` owns the keys with ``shard_of(key, world) == r`` (``terarec.kernels``;
checkpoint shards are cut by the same hash). The shard hash is a salted splitmix64 whose
*high* 32 bits are taken mod the world size. Why not ``key % world``: hashed keys are
fine, but raw ids (user ids, item ids) are often sequential or share a stride, which
would load one rank more than another. Why a different salt and the high bits: the
store's ``KeyIndex`` picks buckets from the *low* bits of the unsalted splitmix64 of the
key; a shard hash built from those bits would leave every rank's index with only every
``world``-th bucket in use and long probe chains.

Rows: the input is cut in *local* batches of ``batch_size / world`` rows and dealt out
round-robin inside each file, so that the union of one step's local batches is exactly
the batch a single process would train on, and passes end on the same rows; each rank
parses and checks only its own local batches (``terarec.data.split``)::

    file rows:        | b0 | b1 | b2 | b3 | b4 |      local batches, batch_size / world rows
    world = 2, step:  |  step 0 |  step 1 | s2 |      one global batch each
    rank 0 trains:      b0        b2        b4
    rank 1 trains:      b1        b3        (empty batch: it still joins every collective)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from terarec.data.positions import (
    FileMark,
    Idle,
    InputFile,
    PassInput,
    Positions,
    iter_position_passes,
)
from terarec.data.readers import DataError, OnBadRow, ReadStats, no_data_rows, table_to_batch
from terarec.data.split import empty_table, iter_rank_tables
from terarec.distributed.context import DistContext
from terarec.types import Batch, FeatureSchema


def redeal(ctx: DistContext, batches: list[Batch], batch_size: int) -> list[Batch]:
    """This rank's local batches of a pass cut for another global ``batch_size``: the
    pass's rows in order (step by step, rank by rank: the batches one process trains),
    re-cut into global batches of ``batch_size`` and dealt as the reader deals them, so
    that a search trial with its own batch size trains on N ranks what it trains in one
    process (``train.loop.rebatch`` there). Collective: every rank receives the whole
    pass once."""
    local = local_batch_size(batch_size, ctx.world)
    parts = ctx.all_gather_object(batches)
    steps = max(len(p) for p in parts)
    whole = Batch.concat([p[s] for s in range(steps) for p in parts if s < len(p)])
    out = []
    for start in range(0, len(whole), batch_size):
        end = min(start + batch_size, len(whole))
        lo = min(start + ctx.rank * local, end)
        out.append(whole.slice(lo, min(lo + local, end)))
    return out


def local_batch_size(batch_size: int, world: int) -> int:
    if batch_size % world:
        raise ValueError(f"batch size {batch_size} is not a multiple of the {world} ranks: "
                         "each rank trains batch_size / world rows per step")
    return batch_size // world


def iter_rank_passes(paths: Iterable[str | Path], schema: FeatureSchema, batch_size: int,
                     pass_rows: int, rank: int, world: int, *, on_bad_row: OnBadRow = "error",
                     stats: ReadStats | None = None,
                     ctx: DistContext | None = None) -> Iterator[list[Batch]]:
    """This rank's share of every pass: one local batch per global step (empty where the
    step has fewer local batches than ranks). Every rank yields the same number of passes
    with the same number of steps, so their collectives line up.

    Each rank parses and checks only its own local batches (``terarec.data.split``).
    ``ctx``: the ranks agree after every pass, in ``ctx.plan_group`` (the read-ahead
    thread's group: call this from that thread): the rows read and skipped are summed
    into every rank's ``stats``, and a bad row found by any rank (``on_bad_row="error"``)
    is raised as the same DataError on every rank, none left waiting in a collective.
    Without ``ctx``, ``stats`` counts this rank's rows and only the rank that found a
    bad row raises.
    """
    for item in iter_rank_pass_inputs(paths, schema, batch_size, pass_rows, rank, world,
                                      Positions(), on_bad_row=on_bad_row, stats=stats,
                                      ctx=ctx):
        if not isinstance(item, Idle):
            yield item[0]


def iter_rank_pass_inputs(items: Iterable[Any], schema: FeatureSchema, batch_size: int,
                          pass_rows: int, rank: int, world: int, positions: Positions, *,
                          per_file: bool = False, on_bad_row: OnBadRow = "error",
                          stats: ReadStats | None = None, ctx: DistContext | None = None
                          ) -> Iterator[tuple[list[Batch], PassInput] | Idle]:
    """``iter_rank_passes`` of the rows ``positions`` does not mark consumed, each pass
    with its ``PassInput`` (every file's position after it, in lines; the same on every
    rank; ``data.positions.iter_position_passes``), ``per_file``: passes also end at
    every file's end. IDLE in ``items`` (the same on every rank) is passed through
    between passes.

    Each step is this rank's local batch (empty where it has none) and the global step's
    rows; steps never cross a file end, as a single process's batches never do. Ranks
    count a file's rows in lines; a position a single process left after skipping bad
    rows counts kept rows, so that file is read from its start."""
    local_size = local_batch_size(batch_size, world)
    stats = stats if stats is not None else ReadStats()
    read = ReadStats(max_examples=stats.max_examples)  # one pass's, until the ranks agree

    def steps(item: InputFile, mark: FileMark | None) -> Iterator[tuple[Batch, int, int]]:
        start, skipped = (mark.rows, mark.skipped) if mark is not None else (0, 0)
        if item.empty_ok and no_data_rows(item.path, schema):
            return
        for table, step_rows in iter_rank_tables(item.path, schema, local_size, rank, world,
                                                 on_bad_row=on_bad_row, stats=read,
                                                 start=start, seek=skipped == 0):
            batch = table_to_batch(empty_table(schema) if table is None else table, schema)
            yield batch, step_rows, skipped

    def agree(error: DataError | None) -> None:
        try:
            _agree(read, error, stats, ctx)
        finally:
            read.rows, read.skipped, read.examples = 0, 0, []  # the reader keeps this object

    return iter_position_passes(items, pass_rows, positions, steps, per_file=per_file,
                                agree=agree)


def _agree(read: ReadStats, error: DataError | None, stats: ReadStats,
           ctx: DistContext | None) -> None:
    """Add one pass's reading to ``stats`` (every rank's, with ``ctx``) and raise the
    first error any rank met."""
    report = (str(error) if error else None, read.rows, read.skipped, read.examples)
    if ctx is None or ctx.world == 1:
        reports: list[Any] = [report]
    else:
        reports = [None] * ctx.world
        # NCCL's object collectives use the thread's current CUDA device: set it for
        # this (read-ahead) thread too.
        with torch.cuda.device(ctx.device) if ctx.backend == "nccl" else nullcontext():
            dist.all_gather_object(reports, report, group=ctx.plan_group)
    for _, rows, skipped, examples in reports:
        stats.rows += rows
        stats.skipped += skipped
        stats.examples.extend(examples[:max(stats.max_examples - len(stats.examples), 0)])
    if error is not None:
        raise error
    failed = next(((r, m) for r, (m, *_) in enumerate(reports) if m), None)
    if failed is not None:
        raise DataError(f"{failed[1]} (found by rank {failed[0]}; every rank stops)")


def deal_batches(batches: list[Batch], rank: int, world: int) -> list[Batch]:
    """This rank's round-robin share of a list of global batches, padded with empty
    batches so that every rank gets ``ceil(len / world)`` of them."""
    steps = -(-len(batches) // world)
    mine = batches[rank::world]
    if batches and len(mine) < steps:
        mine = mine + [batches[0].slice(0, 0)] * (steps - len(mine))
    return mine
