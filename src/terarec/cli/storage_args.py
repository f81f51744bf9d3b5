"""The ``--storage-options`` flag shared by the commands that read or write exports."""

from __future__ import annotations

import argparse
import json
from typing import Any


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
