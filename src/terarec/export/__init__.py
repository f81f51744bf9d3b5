"""Exporting models for serving: full versions and incremental deltas through fsspec."""

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

__all__ = [
    "ExportError", "ExportedVersion", "IncrementalExporter", "Manifest", "ModelExporter",
    "Storage", "StorageError", "export_model_dir", "latest_version", "list_versions",
    "read_manifest",
]
