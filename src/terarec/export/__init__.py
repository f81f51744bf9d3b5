"""Exporting models for serving: full versions and incremental deltas through fsspec.

Names are imported on first use: the command line's parsers read a constant without
loading the writer's stack."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ExportError": "format", "Manifest": "format", "latest_version": "format",
    "list_versions": "format", "read_manifest": "format", "Storage": "storage",
    "StorageError": "storage", "ExportedVersion": "writer", "IncrementalExporter": "writer",
    "ModelExporter": "writer", "export_model_dir": "writer",
}
__all__ = [
    "ExportError", "ExportedVersion", "IncrementalExporter", "Manifest", "ModelExporter",
    "Storage", "StorageError", "export_model_dir", "latest_version", "list_versions",
    "read_manifest",
]

if TYPE_CHECKING:
    from terarec.export.format import (
        ExportError,
        Manifest,
        latest_version,
        list_versions,
        read_manifest,
    )
    from terarec.export.storage import Storage, StorageError
    from terarec.export.writer import (
        ExportedVersion,
        IncrementalExporter,
        ModelExporter,
        export_model_dir,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'terarec.export' has no attribute {name!r}")
    return getattr(importlib.import_module(f"terarec.export.{module}"), name)
