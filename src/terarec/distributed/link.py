"""A slower network emulated in-process: every exchange of rows, row gradients and dense
gradients waits ``latency + bytes / bandwidth`` before it starts.

On one machine the ranks talk over loopback, which is faster than any real network;
to see what a given link would cost without root (no ``tc netem``), set
``TERAREC_LINK_GBPS`` (and optionally ``TERAREC_LINK_LATENCY_US``) in every rank's
environment. The exchange layer (``distributed.lookup.exchange``, the dense exchange
hooks of ``distributed.dense_comm``) then sleeps for what this rank's share of each
collective would take on that link before issuing it. Loopback's own time comes on
top, so the figure is a slight overestimate of the emulated link. Unset, nothing
changes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

GBPS_ENV = "TERAREC_LINK_GBPS"
LATENCY_ENV = "TERAREC_LINK_LATENCY_US"
DEFAULT_LATENCY_US = 50.0


@dataclass
class LinkTally:
    """What this process paid the emulated link: bytes and collectives (the benchmark's
    projection to more ranks reads them per step)."""

    bytes: float = 0.0
    calls: int = 0


TALLY = LinkTally()


@dataclass(frozen=True)
class LinkEmulation:
    """A link of ``gbps`` gigabits per second and ``latency_s`` per message."""

    gbps: float
    latency_s: float = DEFAULT_LATENCY_US * 1e-6

    def __post_init__(self) -> None:
        if not self.gbps > 0:
            raise ValueError(f"{GBPS_ENV} must be > 0 Gb/s, got {self.gbps}")
        if self.latency_s < 0:
            raise ValueError(f"{LATENCY_ENV} must be >= 0 us, got {self.latency_s * 1e6}")

    def delay(self, nbytes: float, messages: int = 1) -> float:
        """Seconds ``nbytes`` sent as ``messages`` consecutive messages take on the link."""
        return messages * self.latency_s + nbytes * 8 / (self.gbps * 1e9)

    def pay(self, nbytes: float, messages: int = 1) -> None:
        """Wait as long as sending ``nbytes`` in ``messages`` messages would take."""
        TALLY.bytes += nbytes
        TALLY.calls += messages
        time.sleep(self.delay(nbytes, messages))


def _number(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None


def link_from_env() -> LinkEmulation | None:
    """The emulated link the environment asks for (``TERAREC_LINK_GBPS``), else None."""
    gbps = os.environ.get(GBPS_ENV)
    if not gbps:
        return None
    latency = os.environ.get(LATENCY_ENV)
    latency_us = _number(LATENCY_ENV, latency) if latency else DEFAULT_LATENCY_US
    return LinkEmulation(_number(GBPS_ENV, gbps), latency_us * 1e-6)


def all_reduce_bytes(nbytes: float, world: int) -> float:
    """What one rank sends in a ring all-reduce of ``nbytes``: 2 (N - 1) / N of it."""
    return 2 * (world - 1) / world * nbytes


def all_gather_bytes(nbytes: float, world: int) -> float:
    """What one rank sends in a ring all-gather of its ``nbytes``: N - 1 copies' worth."""
    return (world - 1) * nbytes
