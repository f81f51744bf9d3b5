"""The one mapping from what went wrong to the HTTP status and ``{"error": ...}`` answer,
shared by the raw scoring handlers (``serving/app.py``) and FastAPI's exception handlers,
so that a refusal reads the same on every route."""

from __future__ import annotations

from terarec.serving.cluster import SparseReadError
from terarec.serving.engine import NoVersionError


class BadRequest(Exception):
    """A request the server will not score; becomes ``{"error": message}``."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


ANSWERED: tuple[type[Exception], ...] = (BadRequest, NoVersionError, SparseReadError)
"""The errors answered with their message; any other is a 500 "internal server error"."""


def status_of(exc: Exception) -> int:
    """The HTTP status of an ``ANSWERED`` error: a bad request's own (4xx, or 503 when the
    server is overloaded), 503 while no version is loaded or sparse rows are unreadable."""
    if isinstance(exc, BadRequest):
        return exc.status
    if isinstance(exc, (NoVersionError, SparseReadError)):
        return 503
    return 500
