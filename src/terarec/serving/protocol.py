"""uvicorn's httptools protocol with each answer sent in one socket write.

uvicorn writes an answer's status line and headers when the app sends its start message
and the body with the next one: two system calls, two TCP segments, the client woken
twice (a tenth of a worker's time in a profile at one request in flight). Here the
connection's transport holds what is written during one turn of the event loop and
hands it on, joined, at the end of the turn; an app sends both messages in one turn
when nothing blocks it. Only public interfaces are used: uvicorn takes the protocol
class as its ``http`` setting, and the protocol gets its transport from asyncio.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _TurnWrites:
    """An asyncio transport whose writes within one event-loop turn leave as one."""

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self.loop = loop
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self.parts:
            self.loop.call_soon(self.flush)
        self.parts.append(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        if not self.parts:
            return
        data = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
        self.parts.clear()
        if not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def write_eof(self) -> None:
        self.flush()
        self.transport.write_eof()

    def abort(self) -> None:
        self.parts.clear()
        self.transport.abort()

    def get_write_buffer_size(self) -> int:
        return int(self.transport.get_write_buffer_size()) + sum(map(len, self.parts))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class OneWriteHttp(HttpToolsProtocol):
    """uvicorn's ``http="httptools"`` protocol, sending each answer in one write."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # _TurnWrites hands every other call on, so it stands in for the transport
        turn = _TurnWrites(transport, asyncio.get_running_loop())
        super().connection_made(cast(asyncio.Transport, turn))
