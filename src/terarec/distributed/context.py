"""The process group a rank trains in, set up from torchrun's environment.

``torchrun`` (``python -m torch.distributed.run``) exports ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` to every worker; the default
``env://`` rendezvous reads them. gloo carries CPU tensors, NCCL CUDA tensors: the backend
follows the training device, and each rank on a GPU node takes GPU ``LOCAL_RANK``.

The same class is the topology of a single process (``DistContext.single``): world 1,
no process group, and every collective returns its input at once, so one trainer and one
driver serve a laptop run and a torchrun rank alike (as in nanoGPT and TorchRec).

Three groups over the same ranks: DDP's gradient all-reduce runs in the default group,
the embedding row exchanges in their own, and the next pass's key exchange, made in the
read-ahead thread, in a third: no group is used by two threads, so the collectives of
each stay in the same order on every rank, and none queues behind another.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """True inside a worker started by torchrun (or any launcher exporting its variables)."""
    return all(v in os.environ for v in _TORCHRUN_VARS)


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (``--max-restarts``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _attempt_store(world: int, timeout: timedelta) -> dist.Store | None:
    """The launcher's store, with keys scoped to this restart attempt.

    With torchrun's static rendezvous (``--master_port`` without ``--rdzv-backend``), a
    worker group restarted by ``--max-restarts`` reuses the agent's store, where the
    previous attempt's rank addresses are still published: the new ranks would try to
    connect to dead peers. A per-attempt prefix gives every attempt fresh keys. Other
    launches (elastic rendezvous, or no agent store) keep the default ``env://`` set-up.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size=world, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"terarec/attempt_{restart_count()}", store)


@dataclass
class DistContext:
    """Where this process stands among the ranks; ``world == 1``: alone, collectives free."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    sparse_group: dist.ProcessGroup | None
    plan_group: dist.ProcessGroup | None = None

    @classmethod
    def single(cls, device: torch.device) -> DistContext:
        """The topology of one process: no process group, no-op collectives."""
        return cls(rank=0, world=1, local_rank=0, device=device, backend="none",
                   sparse_group=None)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def comm_device(self) -> torch.device:
        """Where tensors handed to collectives must live for this backend."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    # -- small collectives on host values ------------------------------------------------
    def barrier(self) -> None:
        if self.world == 1:
            return
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index or 0])
        else:
            dist.barrier()

    def all_gather_object(self, obj):
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def gather_object(self, obj, dst: int = 0) -> list | None:
        """Every rank's ``obj`` on rank ``dst`` (None elsewhere), in the row exchange
        group: larger payloads (export rows) than the default group's small objects."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst, group=self.sparse_group)
        return out

    def broadcast_object(self, obj, src: int = 0):
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_sum(self, values: list[float]) -> np.ndarray:
        """Element-wise sum over ranks (float64 on the wire: exact for counts < 2^53)."""
        if self.world == 1:
            return np.asarray(values, dtype=np.float64)
        t = torch.tensor(values, dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t)
        return t.cpu().numpy()

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> DistContext:
    """Join the process group torchrun set up; pick the backend from the device."""
    if not launched_by_torchrun():
        raise RuntimeError("not started by torchrun: RANK / WORLD_SIZE / MASTER_ADDR unset")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = resolve_device(device).type == "cuda"
    if use_cuda:
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"device_id": dev} if backend == "nccl" else {}
        timeout = timedelta(seconds=timeout_s)
        store = _attempt_store(world, timeout)
        if store is not None:
            kwargs.update(store=store, rank=rank, world_size=world)
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    sparse_group = dist.new_group(backend=backend) if world > 1 else None
    plan_group = dist.new_group(backend=backend) if world > 1 else None
    return DistContext(rank=rank, world=world, local_rank=local_rank, device=dev,
                       backend=backend, sparse_group=sparse_group, plan_group=plan_group)


def topology(device: str = "auto") -> DistContext:
    """This process's topology: a rank of the torchrun job that started it, or alone."""
    if launched_by_torchrun():
        return init_distributed(device)
    return DistContext.single(resolve_device(device))


def resolve_device(name: str) -> torch.device:
    """The torch device ``--device name`` asks for ("auto": CUDA when there is a GPU);
    a ValueError saying why when this machine has no such device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N"
                         ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch was built without CUDA" if torch.version.cuda is None
                   else "no GPU is visible")
            raise ValueError(f"--device {name}: CUDA is not available ({why}); use "
                             "--device cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has "
                             f"{torch.cuda.device_count()} GPU(s), cuda:0 to "
                             f"cuda:{torch.cuda.device_count() - 1}")
    return dev
