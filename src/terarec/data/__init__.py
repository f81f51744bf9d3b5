"""terarec.data: raw logs -> ``Batch``. Streaming readers for Criteo TSV, CSV and Parquet,
stable feature hashing, and a synthetic click-log generator with a known ground truth.

Names are re-exported lazily: a server that only hashes need not load the generator.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "hash_column": "hashing", "hash_values": "hashing", "missing_key": "hashing",
    "DataError": "readers", "ReadStats": "readers", "batch_from_records": "readers",
    "csv_schema": "readers", "iter_batches": "readers", "parquet_schema": "readers",
    "SynthInfo": "synth", "generate": "synth", "generate_arrays": "synth",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"terarec.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'terarec.data' has no attribute {name!r}")
