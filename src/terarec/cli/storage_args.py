"""The ``--storage-options`` flag shared by the commands that read or write exports."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# What a model directory holds (terarec.modeldir), and an export folder never does.
MODEL_DIR_MARKERS = ("schema.json", "train_config.json", "checkpoints")


def add_storage_args(parser: argparse._ActionsContainer) -> None:
    """Add ``--storage-options`` to a parser or an argument group."""
    parser.add_argument(
        "--storage-options", default=None, metavar="JSON",
        help='fsspec options for the export URI, e.g. \'{"endpoint_url": '
             '"http://127.0.0.1:9000"}\' for an S3-compatible server')


def storage_options_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.storage_options:
        return None
    try:
        options = json.loads(args.storage_options)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--storage-options is not valid JSON: {exc}") from None
    if not isinstance(options, dict):
        raise ValueError("--storage-options must be a JSON object")
    return options


def local_options_error(what: str) -> str:
    """The refusal of ``--storage-options`` for ``what``, a local folder: fsspec's local
    filesystem ignores them, so they would be taken and do nothing."""
    return (f"--storage-options: {what} is a local folder; the options are for fsspec URLs "
            "such as s3://bucket/prefix")


def check_export_target(uri: str, options: dict[str, Any] | None, flag: str, *,
                        options_elsewhere: bool = False) -> None:
    """Reach the export URI ``uri`` (given by ``flag``) once before any work is done, so
    that an unknown protocol, a storage option the filesystem does not take, missing
    credentials or an unreachable endpoint is one line naming the flag: fsspec, s3fs and
    botocore raise them only at first use, each as its own exception type (a traceback).
    Options given for a local folder would be ignored, so they are refused unless they
    serve another URI of the command (``options_elsewhere``)."""
    from terarec.export.format import MANIFEST
    from terarec.export.storage import Storage

    try:
        storage = Storage(uri, options)
        names = storage.list_names()
    except Exception as exc:  # any filesystem's own error types
        given = " with --storage-options" if options else ""
        raise ValueError(f"{flag} {uri}: cannot be used{given} "
                         f"({type(exc).__name__}: {exc})") from None
    if storage.is_local and options and not options_elsewhere:
        raise ValueError(local_options_error(f"{flag} {uri}"))
    if MANIFEST in names:
        # The new version (and a LATEST) went inside that version, where no reader looks.
        parent = uri.rstrip("/").rsplit("/", 1)[0] if "/" in uri.rstrip("/") \
            else "its parent"
        raise ValueError(f"{flag} {uri} is one exported version (it holds {MANIFEST}); "
                         f"export to the export folder above it ({parent})")
    if storage.is_local and any((Path(storage.root) / name).exists()
                                for name in MODEL_DIR_MARKERS):
        # Both keep a LATEST file: the export's overwrote the model's, and back.
        raise ValueError(f"{flag} {uri} is a model directory; export to a folder of its "
                         "own (e.g. a subfolder)")
