"""Multi-rank tests without torchrun: N gloo ranks in processes spawned by
``torch.multiprocessing``, as TorchRec tests its sharding on one machine.

``run_ranks(fn, world, *args)`` calls ``fn(ctx, *args)`` on every rank, ``ctx`` being the
rank's ``DistContext`` (the one ``init_distributed`` builds under torchrun), and returns
the ranks' results in rank order. ``fn`` must be a module-level function (the spawned
processes import it); a rank's exception fails the call with that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from terarec.distributed.context import DistContext


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ctx = DistContext(rank=rank, world=world, local_rank=rank,
                          device=torch.device("cpu"), backend="gloo",
                          sparse_group=dist.new_group(backend="gloo"),
                          plan_group=dist.new_group(backend="gloo"))
        result = fn(ctx, *args)
        with open(Path(out) / f"rank-{rank}.pkl", "wb") as fh:
            pickle.dump(result, fh)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``fn(ctx, *args)`` on ``world`` gloo ranks; their results in rank order."""
    with tempfile.TemporaryDirectory(prefix="terarec-ranks-") as out:
        mp.spawn(_rank_main, args=(world, _free_port(), out, fn, args), nprocs=world,
                 join=True)
        results = []
        for rank in range(world):
            with open(Path(out) / f"rank-{rank}.pkl", "rb") as fh:
                results.append(pickle.load(fh))
        return results
