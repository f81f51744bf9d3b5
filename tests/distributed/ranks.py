"""Multi-rank tests without torchrun: N gloo ranks in processes spawned by
``torch.multiprocessing``, as TorchRec tests its sharding on one machine.

``run_ranks(fn, world, *args)`` calls ``fn(ctx, *args)`` on every rank, ``ctx`` being the
rank's ``DistContext`` (the one ``init_distributed`` builds under torchrun), and returns
the ranks' results in rank order. ``fn`` must be a module-level function (the spawned
processes import it); a rank's exception fails the call with that rank's traceback.
"""

from __future__ import annotations

import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from terarec.distributed.context import DistContext


def _rank_main(rank: int, world: int, out: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    # A file store, not a TCP port: a port picked free here can be taken by another
    # test process before rank 0 binds it.
    dist.init_process_group("gloo", init_method=f"file://{Path(out) / 'store'}", rank=rank,
                            world_size=world)
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


# Ranks fork from a server that has imported torch and terarec once per test process:
# spawned ranks spent 3-4 s each importing them again, most of a small test's time.
mp.set_forkserver_preload(["torch", "torch.distributed", "terarec.train.trainer",
                           "terarec.distributed.context", __name__])


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``fn(ctx, *args)`` on ``world`` gloo ranks; their results in rank order."""
    with tempfile.TemporaryDirectory(prefix="terarec-ranks-") as out:
        mp.start_processes(_rank_main, args=(world, out, fn, args), nprocs=world,
                           join=True, start_method="forkserver")
        results = []
        for rank in range(world):
            with open(Path(out) / f"rank-{rank}.pkl", "rb") as fh:
                results.append(pickle.load(fh))
        return results
