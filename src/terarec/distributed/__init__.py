"""Training over N torchrun ranks: hash-sharded store, all-to-all row exchange, DDP.

Launch the ordinary command under torchrun (gloo on CPU, NCCL on GPU)::

    torchrun --nproc_per_node 2 -m terarec train --train data.txt --out model/

See ``docs/distributed.md``.
"""

from terarec.config import DenseCommConfig
from terarec.distributed.context import DistContext, init_distributed, launched_by_torchrun
from terarec.distributed.sharding import iter_rank_passes
from terarec.kernels import shard_of

__all__ = ["DistContext", "DenseCommConfig", "init_distributed", "iter_rank_passes",
           "launched_by_torchrun", "shard_of"]
