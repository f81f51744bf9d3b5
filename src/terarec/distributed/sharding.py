"""Which rank owns a key, and which rows of the input each rank reads.

Keys: rank ``r`` owns the keys with ``shard_of(key, world) == r``. The shard hash is a
salted splitmix64 whose *high* 32 bits are taken mod the world size. Why not ``key %
world``: hashed keys are fine, but raw ids (user ids, item ids) are often sequential or
share a stride, which would load one rank more than another. Why a different salt and the
high bits: the store's ``KeyIndex`` picks buckets from the *low* bits of the unsalted
splitmix64 of the key; a shard hash built from those bits would leave every rank's index
with only every ``world``-th bucket in use and long probe chains.

Rows: the input is read in *local* batches of ``batch_size / world`` rows and dealt out
round-robin inside each file, so that the union of one step's local batches is exactly
the batch a single process would train on, and passes end on the same rows::

    file rows:        | b0 | b1 | b2 | b3 | b4 |      local batches, batch_size / world rows
    world = 2, step:  |  step 0 |  step 1 | s2 |      one global batch each
    rank 0 trains:      b0        b2        b4
    rank 1 trains:      b1        b3        (empty batch: it still joins every collective)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from terarec.data.readers import ReadStats, iter_tables, table_to_batch
from terarec.kernels import splitmix64_array
from terarec.types import Batch, FeatureSchema

_SHARD_SALT = np.uint64(0x5BD1E9955BD1E995)


def shard_of(keys: np.ndarray, world: int) -> np.ndarray:
    """The owning rank (int64) of each int64 key."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    z = splitmix64_array(np.asarray(keys, dtype=np.int64).view(np.uint64) ^ _SHARD_SALT)
    return ((z >> np.uint64(32)) % np.uint64(world)).astype(np.int64)


def local_batch_size(batch_size: int, world: int) -> int:
    if batch_size % world:
        raise ValueError(f"batch size {batch_size} is not a multiple of the {world} ranks: "
                         "each rank trains batch_size / world rows per step")
    return batch_size // world


def _global_steps(paths: Iterable[str | Path], schema: FeatureSchema, local_size: int,
                  world: int, on_bad_row: str,
                  stats: ReadStats | None) -> Iterator[list[pa.Table]]:
    """Groups of up to ``world`` consecutive local batches, as tables not yet hashed;
    never across a file end, as a single process's batches never are."""
    for path in paths:
        step: list[pa.Table] = []
        for table in iter_tables(path, schema, local_size, on_bad_row=on_bad_row,
                                 stats=stats):
            step.append(table)
            if len(step) == world:
                yield step
                step = []
        if step:
            yield step


def iter_rank_passes(paths: Iterable[str | Path], schema: FeatureSchema, batch_size: int,
                     pass_rows: int, rank: int, world: int, *, on_bad_row: str = "error",
                     stats: ReadStats | None = None) -> Iterator[list[Batch]]:
    """This rank's share of every pass: one local batch per global step (empty where the
    step has fewer local batches than ranks). Every rank yields the same number of passes
    with the same number of steps, so their collectives line up.

    Every rank parses and checks every row (so that all cut the same batches, and a bad
    row stops all of them), but hashes only its own batches: most of the reading work."""
    local_size = local_batch_size(batch_size, world)
    current: list[Batch] = []
    rows = 0
    for step in _global_steps(paths, schema, local_size, world, on_bad_row, stats):
        mine = step[rank] if rank < len(step) else step[0].slice(0, 0)
        current.append(table_to_batch(mine, schema))
        rows += sum(t.num_rows for t in step)
        if rows >= pass_rows:
            yield current
            current, rows = [], 0
    if current:
        yield current


def deal_batches(batches: list[Batch], rank: int, world: int) -> list[Batch]:
    """This rank's round-robin share of a list of global batches, padded with empty
    batches so that every rank gets ``ceil(len / world)`` of them."""
    steps = -(-len(batches) // world)
    mine = batches[rank::world]
    if batches and len(mine) < steps:
        mine = mine + [batches[0].slice(0, 0)] * (steps - len(mine))
    return mine
