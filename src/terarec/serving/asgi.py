"""HTTP plumbing in plain ASGI terms: reading a body within a byte cap (and inflating a
compressed one), answering with one JSON body, and per-route latency and status metrics.

Only the ASGI interface is relied on (the ``scope``, ``receive`` and ``send`` every
server gives), never a server's own objects, so the app runs the same under uvicorn, a
test client or any other ASGI server.
"""

from __future__ import annotations

import re
import time
import zlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from terarec.serving.errors import BadRequest
from terarec.serving.metrics import ServingMetrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON_TYPE = (b"content-type", b"application/json")

# Route label of each path, for the metrics (a bounded set: never the raw path).
ROUTES = [(re.compile(r"^/v2/models/[^/]+/infer$"), "infer"),
          (re.compile(r"^/v2/models/[^/]+(/ready)?$"), "model"),
          (re.compile(r"^/v2(/health/(live|ready))?$"), "health"),
          (re.compile(r"^/predict$"), "predict"), (re.compile(r"^/metrics$"), "metrics"),
          (re.compile(r"^/retrieve$"), "retrieve")]


def route_label(path: str) -> str:
    """The metrics label of ``path``: its route, or "other"."""
    return next((label for pattern, label in ROUTES if pattern.match(path)), "other")


class Disconnected(Exception):
    """The client went away before its body arrived: nothing to answer."""


def header(scope: Scope, name: bytes) -> str | None:
    """The value of request header ``name`` (lower case, as ASGI servers give them)."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def read_body(scope: Scope, receive: Receive, max_bytes: int) -> bytes:
    """The request body, at most ``max_bytes`` (413 past it, 400 when empty)."""
    declared = header(scope, b"content-length")
    if declared is not None:
        try:
            if int(declared) > max_bytes:
                raise BadRequest(f"request body of {declared} bytes exceeds the limit of "
                                 f"{max_bytes} bytes", 413)
        except ValueError:
            raise BadRequest(f"bad Content-Length header {declared!r}", 400) from None
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise BadRequest(f"request body exceeds the limit of {max_bytes} bytes", 413)
        if chunk:
            chunks.append(chunk)
        more = message.get("more_body", False)
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    encoding = (header(scope, b"content-encoding") or "identity").strip().lower()
    if encoding != "identity":
        body = _decompress(body, encoding, max_bytes)
    if not body:
        raise BadRequest("empty request body; expected a JSON object", 400)
    return body


# Content-Encoding -> zlib's wbits for it: gzip, and deflate as HTTP means it (zlib format).
_ENCODINGS = {"gzip": 31, "x-gzip": 31, "deflate": 15}


def _decompress(body: bytes, encoding: str, max_bytes: int) -> bytes:
    """A compressed body, inflated to at most ``max_bytes`` (the limit holds for what is
    parsed, so a small body cannot expand past it)."""
    wbits = _ENCODINGS.get(encoding)
    if wbits is None:
        raise BadRequest(f"Content-Encoding {encoding!r} is not supported; send gzip, "
                         "deflate or an uncompressed body", 415)
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise BadRequest(f"body is not valid {encoding} data ({exc})", 400) from None
    if len(out) > max_bytes:
        raise BadRequest(f"request body exceeds the limit of {max_bytes} bytes once "
                         f"decompressed", 413)
    if not inflater.eof:
        raise BadRequest(f"body is truncated {encoding} data", 400)
    return out


async def send_json(send: Send, status: int, body: bytes,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer with ``body`` (JSON text) and a Content-Length: one start and one body
    message, the body whole."""
    await send({"type": "http.response.start", "status": status,
                "headers": [JSON_TYPE, (b"content-length", str(len(body)).encode()),
                            *(headers or ())]})
    await send({"type": "http.response.body", "body": body})


class Timing:
    """ASGI middleware: latency histogram and status counts per route."""

    def __init__(self, app: ASGIApp, metrics: ServingMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = route_label(scope.get("path", ""))
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)
            self.metrics.requests.labels(route, str(status)).inc()
