"""The dense half of a training step: the model's forward and the loss (and, through
autograd, their backward), run eagerly in fp32, under bf16 autocast, and/or compiled.

The sparse half (the working set's lookup, whose backward runs the sparse optimizer) and
the store stay eager: the compiled region starts at the pooled rows ``[B, F, D]`` and
ends at the loss, so the row gradient still reaches the lookup's backward::

    emb = ws.lookup(...)                 eager; its backward updates rows in place
    loss = DenseStep(dense, emb, labels) [autocast bf16] model -> logits; fp32 loss
    loss.backward()                      compiled backward when the forward was

Two switches (``TrainConfig.compile`` / ``--compile``, ``TrainConfig.autocast`` /
``--autocast``), each ``auto`` by default:

- autocast ``auto`` runs the MLPs and the interaction in bf16 only where the hardware
  does bf16 arithmetic natively (a CUDA device that supports it; a CPU with AMX tiles or
  AVX-512 BF16). Elsewhere (an AVX2 CPU) bf16 is emulated and slower, so fp32 it is.
  ``bf16`` forces it anywhere (it trains on any CPU, slowly where emulated).
- compile ``auto`` compiles (``torch.compile``, inductor, static shapes) only on a CUDA
  device and only once the run has trained ``COMPILE_AFTER_STEPS`` steps eagerly, so
  short runs and tests never pay the tens of seconds compilation costs; on an AVX2 CPU
  the compiled DLRM step measured slower than eager (docs/training.md), so ``auto``
  stays eager on CPUs. ``on`` compiles from the first step. A batch of another size
  than the configured one (a pass's last, partial step) runs eagerly, never recompiles.
  A compilation that fails logs one line and the run goes on eagerly.

The compiled function wraps the model, it does not replace it: the model's parameter
names, its ``state_dict`` and so its checkpoints are the same with either switch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import get_args

import torch

from terarec.config import AutocastMode, CompileMode

log = logging.getLogger(__name__)

COMPILE_MODES: tuple[str, ...] = get_args(CompileMode)
AUTOCAST_MODES: tuple[str, ...] = get_args(AutocastMode)

# Eager steps a run trains before ``--compile auto`` compiles (where it compiles at
# all): compilation took 16-80 s for the DLRM step here, so a run must have that many
# steps behind it (and, likely, ahead) before saving a fraction of each step repays it.
COMPILE_AFTER_STEPS = 2_000

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cpu_bf16_native() -> bool:
    """Whether this CPU does bf16 arithmetic in hardware (AMX tiles or AVX-512 BF16)."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def bf16_native(device: torch.device) -> bool:
    """Whether bf16 matrix products run natively (faster than fp32) on ``device``."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return cpu_bf16_native()
    return False


def _check(mode: str, known: tuple[str, ...], name: str) -> None:
    if mode not in known:
        raise ValueError(f"{name} must be one of {', '.join(known)}; got {mode!r}")


def autocast_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    """The dtype the dense forward runs in under autocast, None for plain fp32."""
    _check(mode, AUTOCAST_MODES, "autocast")
    if mode == "bf16" or (mode == "auto" and bf16_native(device)):
        return torch.bfloat16
    return None


def compile_wanted(mode: str, device: torch.device, steps_done: int) -> bool:
    """Whether the dense step should be compiled now, ``steps_done`` steps into a run."""
    _check(mode, COMPILE_MODES, "compile")
    if mode == "auto":
        return device.type == "cuda" and steps_done >= COMPILE_AFTER_STEPS
    return mode == "on"


class DenseStep:
    """``loss(forward(dense, emb), labels)``, under the autocast and compile switches.

    ``batch_size``: the one batch size the compiled graph is made for; other sizes run
    eagerly. ``steps`` counts the calls, which ``compile auto`` waits on."""

    def __init__(self, forward: Forward, loss: Loss, device: torch.device, *,
                 compile: str = "auto", autocast: str = "auto",
                 batch_size: int | None = None) -> None:
        self.forward, self.loss, self.device = forward, loss, torch.device(device)
        self.dtype = autocast_dtype(autocast, self.device)
        _check(compile, COMPILE_MODES, "compile")
        self.mode = compile
        self.batch_size = batch_size
        self.steps = 0
        self._compiled: Callable[..., torch.Tensor] | None = None
        self._proven = False  # the compiled function has run once
        self._gave_up = compile == "off"

    @property
    def compiled(self) -> bool:
        """Whether full batches now run through the compiled function."""
        return self._compiled is not None

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """The forward's autocast context (none for fp32): the ranked step, which runs
        its model through DDP, uses it too, so N ranks compute what one process does."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def eager(self, dense: torch.Tensor, emb: torch.Tensor,
              labels: torch.Tensor) -> torch.Tensor:
        """The step's loss without compilation (autocast as configured)."""
        if self.dtype is None:
            return self.loss(self.forward(dense, emb), labels)
        with self.autocast():
            logits = self.forward(dense, emb)
        return self.loss(logits.float(), labels)  # the loss in fp32 (its log and mean)

    def __call__(self, dense: torch.Tensor, emb: torch.Tensor,
                 labels: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        if not self._gave_up and self._compiled is None \
                and compile_wanted(self.mode, self.device, self.steps - 1):
            self._compiled = torch.compile(self.eager, dynamic=False)
        if self._compiled is None or (self.batch_size is not None
                                      and dense.shape[0] != self.batch_size):
            return self.eager(dense, emb, labels)
        if self._proven:
            return self._compiled(dense, emb, labels)
        try:
            loss = self._compiled(dense, emb, labels)
        except Exception as exc:  # compilers fail in many ways; the eager step is exact
            log.warning("torch.compile of the dense step failed (%s: %s); training eagerly",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self._compiled, self._gave_up = None, True
            return self.eager(dense, emb, labels)
        self._proven = True
        return loss

