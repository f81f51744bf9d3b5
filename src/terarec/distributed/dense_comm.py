"""How DDP exchanges the dense network's gradients: plain, fp16, or Deep Gradient Compression.

``none`` keeps DDP's own all-reduce; ``fp16`` is torch's ``fp16_compress_hook``; ``dgc``
is Deep Gradient Compression (Lin et al., ICLR 2018) as a DDP communication hook. Per
DDP bucket (a flat view of many parameters' gradients), on every rank::

    u = m * u + g                 momentum correction: momentum is accumulated locally...
    v = v + u                     ...and so is everything not sent yet (nothing is lost)
    top-k of |v|, k = density * numel   (density decays from 25 % to `ratio` in warm-up)
    send (value, index) pairs;  v[sent] = 0, u[sent] = 0   (momentum factor masking)
    gradient = sum over ranks of the sent pairs / world

The pairs travel as one int32 tensor (float32 bits + int32 index: 8 bytes per entry)
through one all-gather into a tensor; every rank sends the same k, so no sizes are
exchanged. At ``ratio=0.001`` a rank sends 8 * numel / 1000 bytes instead of 4 * numel:
500x less. The optimizer then applies the returned gradient as usual.
"""

# No ``from __future__ import annotations``: DDP checks the hooks' annotations at runtime.
import math

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from terarec.config import DenseCommConfig

_WARMUP_START_DENSITY = 0.25
# torch 2.13 renamed all_gather_into_tensor (same semantics); older releases lack the new name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommMeter:
    """Bytes this rank hands to the dense gradient exchange, per optimizer step."""

    def __init__(self) -> None:
        self.bytes = 0
        self.buckets = 0

    def add(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.buckets += 1


class DGCState:
    """Momentum ``u`` and residual ``v`` of every dense parameter, plus the warm-up clock.

    Both are flat over the model's parameters in ``model.parameters()`` order, not per
    DDP bucket: DDP re-forms its buckets after the first step (and again after a
    restart), and a residual must stay with its parameter through that.
    """

    def __init__(self, config: DenseCommConfig, world: int, meter: CommMeter,
                 params: list[torch.Tensor], process_group: dist.ProcessGroup | None = None
                 ) -> None:
        self.config = config
        self.world = world
        self.meter = meter
        self.process_group = process_group
        self.step = 0
        self._span: dict[int, tuple[int, int]] = {}
        total = 0
        for p in params:
            self._span[p.data_ptr()] = (total, p.numel())
            total += p.numel()
        device = params[0].device if params else torch.device("cpu")
        self.u = torch.zeros(total, device=device)
        self.v = torch.zeros(total, device=device)
        self._positions: dict[tuple[int, ...], torch.Tensor] = {}

    def density(self) -> float:
        """Share of entries sent: exponential decay from 25 % to ``ratio`` over warm-up,
        as the paper's 75 %, 93.75 %, ... 99.9 % sparsity schedule."""
        c = self.config
        start = max(c.dgc_ratio, _WARMUP_START_DENSITY)
        if self.step >= c.dgc_warmup_steps:
            return c.dgc_ratio
        return start * (c.dgc_ratio / start) ** (self.step / c.dgc_warmup_steps)

    def positions(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Indices into ``u`` / ``v`` of a bucket's flat gradient (its parameters in order)."""
        key = tuple(p.data_ptr() for p in params)
        got = self._positions.get(key)
        if got is None:
            spans = [self._span[k] for k in key]
            got = torch.cat([torch.arange(s, s + n) for s, n in spans]).to(self.u.device)
            self._positions[key] = got
        return got


def dgc_sparsify(state: DGCState, grad: torch.Tensor,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's DGC step on a flat gradient whose entries sit at ``positions`` of the
    state (all of it by default): returns the (values, indices into ``grad``) to send and
    keeps the rest in the residual."""
    n = grad.numel()
    whole = positions is None
    u = state.u if whole else state.u[positions]
    v = state.v if whole else state.v[positions]
    g = grad.to(torch.float32)
    if state.config.dgc_momentum:
        u.mul_(state.config.dgc_momentum).add_(g)
        v.add_(u)
    else:
        v.add_(g)
    k = max(1, min(n, math.ceil(n * state.density())))
    idx = torch.topk(v.abs(), k, sorted=False).indices
    values = v[idx]
    v[idx] = 0.0
    u[idx] = 0.0
    if not whole:
        state.u[positions] = u
        state.v[positions] = v
    return values, idx


def dgc_hook(state: DGCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    grad = bucket.buffer()
    n = grad.numel()
    values, idx = dgc_sparsify(state, grad, state.positions(bucket.parameters()))
    k = values.numel()
    payload = torch.cat([values.view(torch.int32), idx.to(torch.int32)])
    gathered = torch.empty(state.world * 2 * k, dtype=torch.int32, device=grad.device)
    state.meter.add(payload.numel() * payload.element_size())
    if bucket.is_last():
        state.step += 1
    work = _all_gather(gathered, payload, group=state.process_group, async_op=True)

    def decode(fut: torch.futures.Future) -> torch.Tensor:
        parts = gathered.view(state.world, 2, k)  # the future carries the input
        vals = parts[:, 0].reshape(-1).view(torch.float32)
        where = parts[:, 1].reshape(-1).to(torch.int64)
        dense = torch.zeros(n, dtype=torch.float32, device=grad.device)
        dense.index_add_(0, where, vals)
        return dense.div_(state.world).to(grad.dtype)

    return work.get_future().then(decode)


def _fp16_hook(meter: CommMeter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    meter.add(bucket.buffer().numel() * 2)
    # None: the hook's own default, the DDP model's process group.
    return default_hooks.fp16_compress_hook(None, bucket)  # type: ignore[arg-type]


def dense_grad_bytes(model: torch.nn.Module) -> int:
    """What an uncompressed all-reduce hands over per step: every trainable gradient."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class DenseComm:
    """Registers the chosen hook on ``ddp`` and reports bytes per step."""

    def __init__(self, ddp: DistributedDataParallel, config: DenseCommConfig, world: int,
                 process_group: dist.ProcessGroup | None = None) -> None:
        self.config = config
        self.meter = CommMeter()
        self.full_bytes = dense_grad_bytes(ddp.module)
        self.steps = 0
        self.dgc: DGCState | None = None
        if config.mode == "fp16":
            ddp.register_comm_hook(self.meter, _fp16_hook)
        elif config.mode == "dgc":
            params = [p for p in ddp.module.parameters() if p.requires_grad]
            self.dgc = DGCState(config, world, self.meter, params, process_group)
            ddp.register_comm_hook(self.dgc, dgc_hook)

    def count_step(self) -> None:
        self.steps += 1
        if self.config.mode == "none":
            self.meter.add(self.full_bytes)

    @property
    def bytes_per_step(self) -> float:
        return self.meter.bytes / self.steps if self.steps else 0.0

    def state_dict(self) -> dict:
        """This rank's DGC clock and unsent residuals: restored with the rank, so a resumed
        run loses none of the gradient it had accumulated but not yet sent."""
        if self.dgc is None:
            return {}
        return {"step": self.dgc.step, "u": self.dgc.u.cpu(), "v": self.dgc.v.cpu()}

    def load_state_dict(self, state: dict) -> None:
        if self.dgc is None or not state:
            return
        if state["u"].shape != self.dgc.u.shape:
            raise ValueError(f"DGC state for {state['u'].numel()} dense weights, the model "
                             f"has {self.dgc.u.numel()}")
        self.dgc.step = int(state["step"])
        self.dgc.u.copy_(state["u"])
        self.dgc.v.copy_(state["v"])
