"""The collectives a checkpoint commit and restore take part in.

A ``DistContext`` has them (alone, each is free). A protocol, so that the model
directory format needs nothing from ``terarec.distributed``, which sits above it.
"""

from __future__ import annotations

from typing import Any, Protocol


class Ranks(Protocol):
    """This process's place among the ranks writing or reading one model directory."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    @property
    def is_main(self) -> bool: ...

    def barrier(self) -> None: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather_object(self, obj: Any) -> list: ...

