"""Atomic file writes: a reader sees the old file or the new one, never half of one; and
the JSON of run records, written with non-finite numbers as null."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import socket
import tempfile
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

# Why a folder cannot be written to: the user's to fix (another --out), not a bug.
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def finite_json(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` with every non-finite float written as null: NaN and Infinity are
    not JSON (strict readers refuse the file), and an AUC over rows of one class is
    undefined, not a number."""
    return json.dumps(_finite(value), allow_nan=False, **kwargs)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class NotWritableError(PermissionError):
    """A file that cannot be written where it was asked for (permissions, a read-only
    filesystem); the command line reports it as one line."""


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temp file in ``path``'s folder for the caller to write by any means (a Python
    handle, a database's COPY); on success it is fsynced and renamed over ``path``, on
    error removed."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        if exc.errno not in NOT_WRITABLE:
            raise
        # The temp file's name said nothing to the user: name the file asked for.
        raise NotWritableError(exc.errno, f"cannot write {path}: {exc.strerror}") from None
    os.close(fd)
    tmp = Path(name)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; published files are meant to be read
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """Write to a temp file in the same folder, fsync, then rename over ``path``."""
    with atomic_path(path) as tmp, open(tmp, mode) as fh:
        yield fh


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as fh:
        fh.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_text_if_changed(path: str | Path, text: str) -> None:
    """``atomic_write_text`` unless ``path`` holds ``text`` already: for files written
    again with every checkpoint (a model's schema and configuration), whose fsyncs cost
    more than reading them back."""
    data = text.encode()
    with contextlib.suppress(OSError):
        if Path(path).read_bytes() == data:
            return
    atomic_write_bytes(path, data)


def file_above(path: str | Path) -> Path | None:
    """The nearest existing folder above ``path`` when it is a file, else None: anything
    written at ``path`` would fail there, as a traceback, so callers name it first."""
    above = next((p for p in Path(path).parents if p.exists()), None)
    return above if above is not None and not above.is_dir() else None


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MB chunks: the checksum every manifest records."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# -- locks and private scratch folders ------------------------------------------------------

class LockedError(RuntimeError):
    """Another process holds a lock this one needs (e.g. a second run on one model)."""


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def try_lock_file(path: str | Path) -> int | None:
    """An open descriptor holding an exclusive ``fcntl`` lock on ``path`` (created if
    needed), or None when another process holds it. Closing the descriptor, or the
    holder's death, releases it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if _try_flock(fd):
        return fd
    os.close(fd)
    return None


@contextlib.contextmanager
def waiting_lock(path: str | Path) -> Iterator[None]:
    """Hold an ``fcntl`` lock on ``path`` (created if needed) for the ``with`` block,
    waiting while another process holds it (e.g. servers sharing one download folder
    take turns copying a file, so the second finds it there)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive_lock(path: str | Path, what: str) -> Iterator[Path]:
    """Hold an ``fcntl`` lock on ``path`` (created if needed) for the ``with`` block, or
    fail at once with :class:`LockedError` naming the lock file and its holder. The
    kernel drops the lock when its holder dies, even by kill -9, so a stale file never
    blocks."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = try_lock_file(path)
    if fd is None:
        holder = path.read_text(errors="replace").strip() or "unknown"
        raise LockedError(f"{what} is in use by another process (lock file {path}, held "
                          f"by {holder})")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def shared_lock(path: str | Path, what: str) -> Iterator[Path]:
    """Hold a shared ``fcntl`` lock on ``path`` for the ``with`` block (others may share
    it; ``try_lock_file`` fails while any holder lives), or fail at once with
    :class:`LockedError`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LockedError(f"{what} is locked by another process (lock file {path})") from None
    try:
        yield path
    finally:
        os.close(fd)


class ScratchDir:
    """A private folder ``parent/PREFIX-XXXX`` for one process, removed by :meth:`close`.

    Its owner holds an ``fcntl`` lock on a file inside it; a folder whose lock is free
    was left by a process that died (kill -9 skips every ``finally``) and is removed the
    next time a ``ScratchDir`` is made under the same parent.
    """

    OWNER = ".owner"

    def __init__(self, parent: str | Path, prefix: str) -> None:
        parent = Path(parent)
        parent.mkdir(parents=True, exist_ok=True)
        self.removed_stale = self._remove_stale(parent, prefix)
        # Locked under a hidden name first, so no cleaner ever sees it unlocked.
        hidden = Path(tempfile.mkdtemp(prefix=f".{prefix}-", dir=parent))
        fd = try_lock_file(hidden / self.OWNER)
        self.path = parent / hidden.name[1:]
        hidden.rename(self.path)
        # Removed by close(), when the object is collected, or at interpreter exit.
        self._remove = weakref.finalize(self, ScratchDir._cleanup, self.path, fd)

    @staticmethod
    def _cleanup(path: Path, fd: int | None) -> None:
        shutil.rmtree(path, ignore_errors=True)
        if fd is not None:
            os.close(fd)

    @classmethod
    def _remove_stale(cls, parent: Path, prefix: str) -> int:
        removed = 0
        for folder in parent.glob(f"{prefix}-*"):
            owner = folder / cls.OWNER
            try:
                fd = os.open(owner, os.O_RDWR)
            except OSError:
                continue  # not ours, or being created right now
            try:
                stale = _try_flock(fd)
            finally:
                os.close(fd)
            if stale:
                shutil.rmtree(folder, ignore_errors=True)
                removed += 1
        return removed

    def close(self) -> None:
        """Remove the folder (idempotent)."""
        self._remove()

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_atomic_leftovers(folder: str | Path) -> list[Path]:
    """Remove the temp files :func:`atomic_path` leaves in ``folder`` when its process is
    killed mid-write. Only for a folder no one else is writing (its lock held)."""
    removed = []
    for tmp in Path(folder).glob(".*.tmp"):
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed
