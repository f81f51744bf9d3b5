"""Dynamic batching: requests in flight together are scored in one forward pass.

A request's rows are hashed and assembled on its own (``ServedVersion.batch``), then
handed to the batcher, which concatenates whatever is waiting (as Triton's dynamic
batcher does), scores it with one lookup and one network call and gives every request
its own slice back::

    request A ──> Batch A ─┐                               ┌──> scores A
    request B ──> Batch B ─┼─> queue ──> one score_batch ──┼──> scores B
    request C ──> Batch C ─┘   (bounded)                   └──> scores C

The batcher never waits for company: after the first request it lets the event loop
run once more and takes what arrived meanwhile, and keeps doing so while more arrive,
up to ``max_rows`` rows or ``max_delay_s``. With one request in flight that costs one
loop turn; under load the queue fills while the previous pass runs.

Each request is scored entirely by the version it resolved on arrival: requests of
different versions (a swap between them) go into separate passes, so a version swap
stays atomic per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from terarec.serving.engine import ServedVersion
from terarec.types import Batch


class QueueFull(RuntimeError):
    """More requests are waiting than the batcher holds: the server is overloaded."""


@dataclass
class _Pending:
    version: ServedVersion
    batch: Batch
    future: asyncio.Future


class DynamicBatcher:
    """Merges concurrent ``score`` calls of one event loop into ``score_batch`` calls.

    ``score_batch(batch, version)`` returns one score per row (the engine's). Waiting
    requests past ``max_queue`` are refused with ``QueueFull``.
    """

    def __init__(self, score_batch: Callable[[Batch, ServedVersion], np.ndarray], *,
                 max_rows: int = 4096, max_delay_s: float = 0.001,
                 max_queue: int = 1024) -> None:
        if max_rows < 1 or max_queue < 1 or max_delay_s < 0:
            raise ValueError("max_rows and max_queue must be >= 1 and max_delay_s >= 0")
        self.score_batch = score_batch
        self.max_rows = max_rows
        self.max_delay_s = max_delay_s
        self.max_queue = max_queue
        self._queue: list[_Pending] = []
        self._running = False
        self._deadline = 0.0
        self._seen = 0
        # Sizes of the passes run (requests per pass), for metrics and tests.
        self.passes = 0
        self.requests = 0

    async def score(self, version: ServedVersion, batch: Batch) -> np.ndarray:
        """Scores of ``batch`` by ``version``, computed together with whatever other
        requests are waiting."""
        if len(self._queue) >= self.max_queue:
            raise QueueFull(f"{len(self._queue)} requests already waiting to be scored")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append(_Pending(version, batch, future))
        if not self._running:
            self._running = True
            self._gather(loop)
        return await future

    def _gather(self, loop: asyncio.AbstractEventLoop) -> None:
        """Look at the queue again after one loop turn (``_tick``). Plain callbacks, not
        a task that sleeps: a task and its wake-ups cost a request at one in flight
        about as much as its JSON encoding."""
        self._deadline = time.perf_counter() + self.max_delay_s
        self._seen = len(self._queue)
        loop.call_soon(self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """One loop turn later: wait one more turn while requests keep arriving, within
        the limits; else score a pass, and gather again for whatever is left."""
        try:
            waiting = len(self._queue)
            if (waiting > self._seen and time.perf_counter() < self._deadline
                    and sum(len(p.batch) for p in self._queue) < self.max_rows):
                self._seen = waiting
                loop.call_soon(self._tick, loop)
                return
            self._run(self._take())
        except BaseException:
            self._running = False
            raise
        if self._queue:
            self._gather(loop)
        else:
            self._running = False

    def _take(self) -> list[_Pending]:
        """The next pass: waiting requests of the first one's version, up to max_rows
        (always at least one)."""
        first = self._queue[0]
        group: list[_Pending] = []
        rest: list[_Pending] = []
        rows = 0
        for p in self._queue:
            if p.version is first.version and (not group or rows + len(p.batch)
                                               <= self.max_rows):
                group.append(p)
                rows += len(p.batch)
            else:
                rest.append(p)
        self._queue = rest
        return group

    def _run(self, group: list[_Pending]) -> None:
        live = [p for p in group if not p.future.done()]  # a client may have gone
        if not live:
            return
        self.passes += 1
        self.requests += len(live)
        try:
            batch = live[0].batch if len(live) == 1 else Batch.concat([p.batch for p in live])
            scores = self.score_batch(batch, live[0].version)
        except Exception as exc:  # every request of the pass gets the error
            for p in live:
                p.future.set_exception(exc)
            return
        start = 0
        for p in live:
            stop = start + len(p.batch)
            p.future.set_result(scores[start:stop])
            start = stop
