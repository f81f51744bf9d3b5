"""How DDP exchanges the dense network's gradients: plain, fp16, or Deep Gradient Compression.

``none`` keeps DDP's own all-reduce; ``fp16`` is torch's ``fp16_compress_hook``; ``dgc``
is Deep Gradient Compression (Lin et al., ICLR 2018) applied to the optimizer's update.

Why the update and not the gradient: the paper compresses gradients for momentum SGD,
whose step is linear in the gradient, so a coordinate's residual sent once every T steps
moves it as far as T small steps would. The dense optimizer here is Adam: fed a gradient
that is zero on most steps and an accumulated spike on one, its per-coordinate
normalisation turns every spike into about one step's length (and its bias correction
and second moment into the wrong ones), so compressed weights learn far more slowly
than all-reduced ones (0.007 validation AUC lost on the benchmark). So with ``dgc`` DDP
exchanges nothing; each rank steps its own optimizer on its local gradient and the
update is what is compressed, per dense parameter (the paper's per-layer threshold)::

    d = p_after_local_step - p_before      the local optimizer's update (any optimizer)
    u = m * u + d                          momentum correction (``dgc_momentum``)...
    v = v + u                              ...and error feedback: nothing is lost
    per parameter: top-k of |v|, k = ceil(density * numel)  (density decays from 25 %
                                           to ``ratio`` over warm-up)
    send (value, index) pairs;  v[sent] = 0, u[sent] = 0   (momentum factor masking)
    p = p_before + sum over ranks of the sent pairs / world

Parameters under 1 / ratio entries (biases, a narrow output layer), where top-k would
send at least one entry anyway, are sent whole every step, as the paper leaves biases
uncompressed. Every rank applies the same sum to the same weights, so the weights stay
identical; each rank's optimizer state follows its own gradients (it is saved with the
rank). The pairs travel as one int32 tensor (float32 bits + int32 index: 8 bytes per
entry; the small parameters' values without indices, 4 bytes) through one all-gather
per step; every rank sends the same k, so no sizes are exchanged. At ``ratio=0.001``
a rank sends about 8 * numel / 1000 bytes of the large parameters instead of 4 * numel.

Under an emulated link (``distributed.link``) every exchange first waits what this
rank's share of it would take on that link.
"""

# No ``from __future__ import annotations``: DDP checks the hooks' annotations at runtime.
import math

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from terarec.config import DenseCommConfig
from terarec.distributed.link import (
    LinkEmulation,
    all_gather_bytes,
    all_reduce_bytes,
    link_from_env,
)

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

    Both are flat over the parameters in the order given (``model.parameters()``);
    ``spans`` holds each parameter's (offset, size) in them: top-k is taken per
    parameter, so a layer whose updates are small is not starved by a larger one.
    """

    def __init__(self, config: DenseCommConfig, world: int, meter: CommMeter,
                 params: list[torch.Tensor], process_group: dist.ProcessGroup | None = None
                 ) -> None:
        self.config = config
        self.world = world
        self.meter = meter
        self.process_group = process_group
        self.step = 0
        self.spans: list[tuple[int, int]] = []
        total = 0
        for p in params:
            self.spans.append((total, p.numel()))
            total += p.numel()
        device = params[0].device if params else torch.device("cpu")
        self.u = torch.zeros(total, device=device)
        self.v = torch.zeros(total, device=device)
        # Parameters under 1 / ratio entries, where top-k would send at least one entry
        # anyway (biases, a zero-started output layer that gates every deeper gradient):
        # sent whole every step, 4 bytes an entry, as the paper leaves biases uncompressed.
        # The others, top-k'd per parameter: ``large``.
        self.large = [(o, n) for o, n in self.spans if n * config.dgc_ratio >= 1]
        small = [torch.arange(o, o + n) for o, n in self.spans if n * config.dgc_ratio < 1]
        self.whole = (torch.cat(small) if small else torch.zeros(0, dtype=torch.int64)
                      ).to(device)

    def density(self) -> float:
        """Share of entries sent: exponential decay from 25 % to ``ratio`` over warm-up,
        as the paper's 75 %, 93.75 %, ... 99.9 % sparsity schedule."""
        c = self.config
        start = max(c.dgc_ratio, _WARMUP_START_DENSITY)
        if self.step >= c.dgc_warmup_steps:
            return c.dgc_ratio
        return start * (c.dgc_ratio / start) ** (self.step / c.dgc_warmup_steps)


def dgc_sparsify(state: DGCState, update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's DGC step on the flat update of all parameters: returns the (values,
    flat indices) to send, the top ``density`` of each large parameter's accumulated
    entries and every entry of the small ones (``DGCState.whole``), and keeps the rest
    in the residual."""
    u, v = state.u, state.v
    if state.config.dgc_momentum:
        u.mul_(state.config.dgc_momentum).add_(update)
        v.add_(u)
    else:
        v.add_(update)
    density = state.density()
    picked = [state.whole]
    for offset, n in state.large:
        k = min(n, math.ceil(n * density))
        picked.append(torch.topk(v[offset:offset + n].abs(), k, sorted=False).indices
                      + offset)
    idx = torch.cat(picked)
    values = v[idx]
    v[idx] = 0.0
    u[idx] = 0.0
    return values, idx


def dgc_exchange(state: DGCState, update: torch.Tensor) -> torch.Tensor:
    """Collective: the mean over ranks of every rank's sparsified ``update`` (flat).
    The small parameters' values travel without indices (every rank sends them all,
    in the same order)."""
    values, idx = dgc_sparsify(state, update)
    w = state.whole.numel()
    k = values.numel() - w
    payload = torch.cat([values.view(torch.int32), idx[w:].to(torch.int32)])
    gathered = torch.empty(state.world * payload.numel(), dtype=torch.int32,
                           device=update.device)
    state.meter.add(payload.numel() * payload.element_size())
    state.step += 1
    link = link_from_env()
    if link is not None:
        link.pay(all_gather_bytes(payload.numel() * payload.element_size(), state.world))
    _all_gather(gathered, payload, group=state.process_group)
    parts = gathered.view(state.world, -1)
    vals = parts[:, :w + k].reshape(-1).view(torch.float32)
    where = torch.cat([idx[:w].expand(state.world, w), parts[:, w + k:].to(torch.int64)],
                      dim=1).reshape(-1)
    dense = torch.zeros(update.numel(), dtype=torch.float32, device=update.device)
    dense.index_add_(0, where, vals)
    return dense.div_(state.world)


def _local_hook(_: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP exchanges nothing: with ``dgc`` each rank steps on its own gradient."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class _HookState:
    """What the all-reduce hooks need: the byte meter and, on an emulated link, the link
    and the world size."""

    def __init__(self, meter: CommMeter, link: LinkEmulation | None, world: int) -> None:
        self.meter = meter
        self.link = link
        self.world = world


def _fp16_hook(state: _HookState, bucket: dist.GradBucket
               ) -> torch.futures.Future[torch.Tensor]:
    nbytes = bucket.buffer().numel() * 2
    state.meter.add(nbytes)
    if state.link is not None:
        state.link.pay(all_reduce_bytes(nbytes, state.world))
    # None: the hook's own default, the DDP model's process group.
    return default_hooks.fp16_compress_hook(None, bucket)  # type: ignore[arg-type]


def _emulated_allreduce_hook(state: _HookState, bucket: dist.GradBucket
                             ) -> torch.futures.Future[torch.Tensor]:
    """DDP's own all-reduce, after what it would take on the emulated link."""
    assert state.link is not None
    buffer = bucket.buffer()
    state.link.pay(all_reduce_bytes(buffer.numel() * buffer.element_size(), state.world))
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


def dense_grad_bytes(model: torch.nn.Module) -> int:
    """What an uncompressed all-reduce hands over per step: every trainable gradient."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class DenseComm:
    """Registers the chosen hook on ``ddp``, steps ``optimizer`` (``step``) and reports
    bytes per step."""

    def __init__(self, ddp: DistributedDataParallel, config: DenseCommConfig, world: int,
                 optimizer: torch.optim.Optimizer,
                 process_group: dist.ProcessGroup | None = None) -> None:
        self.config = config
        self.optimizer = optimizer
        self.meter = CommMeter()
        self.full_bytes = dense_grad_bytes(ddp.module)
        self.steps = 0
        self.dgc: DGCState | None = None
        self._params: list[torch.Tensor] = []
        hooks = _HookState(self.meter, link_from_env(), world)
        if config.mode == "fp16":
            ddp.register_comm_hook(hooks, _fp16_hook)
        elif config.mode == "none" and hooks.link is not None:
            ddp.register_comm_hook(hooks, _emulated_allreduce_hook)
        elif config.mode == "dgc":
            self._params = [p for p in ddp.module.parameters() if p.requires_grad]
            self.dgc = DGCState(config, world, self.meter, self._params, process_group)
            ddp.register_comm_hook(None, _local_hook)

    def step(self) -> None:
        """Collective with ``dgc``: the optimizer's step. Otherwise it steps on the
        all-reduced gradient; with ``dgc`` on this rank's gradient, and the weights then
        move by the ranks' mean compressed update (the module docstring)."""
        if self.dgc is None:
            self.optimizer.step()
            return
        with torch.no_grad():
            before = torch.cat([p.detach().reshape(-1) for p in self._params])
            self.optimizer.step()
            after = torch.cat([p.detach().reshape(-1) for p in self._params])
            moved = before.add_(dgc_exchange(self.dgc, after.sub_(before)))
            for p, (offset, n) in zip(self._params, self.dgc.spans, strict=True):
                p.copy_(moved[offset:offset + n].view_as(p))

    def count_step(self) -> None:
        self.steps += 1
        if self.config.mode == "none":
            self.meter.add(self.full_bytes)

    @property
    def bytes_per_step(self) -> float:
        return self.meter.bytes / self.steps if self.steps else 0.0

    def state_dict(self) -> dict:
        """This rank's DGC clock, unsent residuals and its own optimizer state (it
        followed this rank's gradients): restored with the rank, so a resumed run loses
        none of the update it had accumulated but not yet sent."""
        if self.dgc is None:
            return {}
        return {"step": self.dgc.step, "u": self.dgc.u.cpu(), "v": self.dgc.v.cpu(),
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.dgc is None or not state:
            return
        if state["u"].shape != self.dgc.u.shape:
            raise ValueError(f"DGC state for {state['u'].numel()} dense weights, the model "
                             f"has {self.dgc.u.numel()}")
        self.dgc.step = int(state["step"])
        self.dgc.u.copy_(state["u"])
        self.dgc.v.copy_(state["v"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
