"""Where exported versions live: a local folder by default, any fsspec URL otherwise.

Writes are atomic per file. Locally each file goes to a temp name, is fsynced and renamed
into place; an object store's PUT is atomic by itself. Either way a version becomes
visible only when its manifest is written, and the manifest is always written last.
"""

from __future__ import annotations

import logging
import os
import posixpath
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from terarec.io import atomic_write_bytes, fsync_dir

log = logging.getLogger(__name__)


class StorageError(OSError):
    """A missing or unreadable object under an export URI."""


class Storage:
    """Files under one root URI (``/path``, ``file:///path``, ``s3://bucket/prefix`` ...).

    ``storage_options`` go to fsspec, e.g. ``{"endpoint_url": "http://127.0.0.1:9000"}``
    for an S3-compatible server.
    """

    def __init__(self, uri: str | Path, storage_options: dict[str, Any] | None = None) -> None:
        self.uri = str(uri)
        self.fs, self.root = fsspec.core.url_to_fs(self.uri, **(storage_options or {}))
        self.is_local = isinstance(self.fs, LocalFileSystem)
        if self.is_local:
            self.root = str(Path(self.root).resolve())
            if Path(self.root).is_file():
                raise ValueError(f"{self.uri} is a file, not an export folder")

    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def local_path(self, rel: str) -> Path | None:
        """The file's path on this machine when the storage is local (no copy needed)."""
        return Path(self.path(rel)) if self.is_local else None

    def write_bytes(self, rel: str, data: bytes) -> None:
        if self.is_local:
            atomic_write_bytes(self.path(rel), data)
        else:
            self.fs.pipe_file(self.path(rel), data)

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Write ``rel`` only if it does not exist yet, atomically against other writers;
        False when it already exists. Locally ``O_CREAT | O_EXCL``; on object stores a
        conditional put (``If-None-Match: *``, s3fs ``mode="create"``), else an exists
        check and a put (not atomic, logged)."""
        if self.is_local:
            path = Path(self.path(rel))
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(path.parent)
            return True
        try:
            self.fs.pipe_file(self.path(rel), data, mode="create")
            return True
        except FileExistsError:
            return False
        except (TypeError, NotImplementedError):
            log.warning("%s: this filesystem has no conditional put; claiming %s with an "
                        "exists check (concurrent writers may collide)", self.uri, rel)
        if self.exists(rel):
            return False
        self.fs.pipe_file(self.path(rel), data)
        return True

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self.fs.cat_file(self.path(rel))
        except FileNotFoundError as exc:
            raise StorageError(f"{self.uri}: {rel} not found") from exc

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self.path(rel)))

    def list_names(self, rel: str = "") -> list[str]:
        """Names directly under ``rel`` (empty when it does not exist)."""
        try:
            entries = self.fs.ls(self.path(rel), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(str(e).rstrip("/")) for e in entries)

    def download(self, rel: str, dest: Path) -> None:
        """Copy one file to ``dest`` on this machine (temp name, then rename)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part")
        try:
            self.fs.get_file(self.path(rel), str(tmp))
        except FileNotFoundError as exc:
            raise StorageError(f"{self.uri}: {rel} not found") from exc
        tmp.replace(dest)

    def remove_tree(self, rel: str) -> None:
        if self.exists(rel):
            self.fs.rm(self.path(rel), recursive=True)
