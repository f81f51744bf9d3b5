"""faiss, imported quietly: its loader tries the AVX-512 and AVX2 builds first and logs
at INFO, with a ``ModuleNotFoundError`` line, each build a wheel does not ship, so a
working setup printed errors under ``--log-level info``. Those lines are debug events
here; faiss missing altogether is one clear error, raised only where faiss is asked for
(``terarec index``, ``serve --index``)."""

from __future__ import annotations

import logging
from types import ModuleType

_LOADER = "faiss.loader"


class FaissMissingError(ImportError):
    """faiss is not installed, and the caller asked for an item index."""


def _as_debug(record: logging.LogRecord) -> bool:
    """The loader's records as DEBUG, shown only where its logger enables DEBUG."""
    if record.levelno > logging.INFO:
        return True
    record.levelno, record.levelname = logging.DEBUG, "DEBUG"
    return logging.getLogger(_LOADER).isEnabledFor(logging.DEBUG)


def import_faiss() -> ModuleType:
    """The faiss module (see the module docstring)."""
    loader = logging.getLogger(_LOADER)
    if _as_debug not in loader.filters:
        loader.addFilter(_as_debug)
    try:
        import faiss
    except ImportError as exc:
        logging.getLogger(__name__).debug("faiss cannot be imported: %s", exc)
        raise FaissMissingError(f"an item index needs faiss, which cannot be imported "
                                f"({exc}); install it with `pip install faiss-cpu`") from None
    return faiss
