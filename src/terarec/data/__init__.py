"""terarec.data: raw logs -> ``Batch``. Streaming readers for Criteo TSV, CSV and Parquet,
stable feature hashing, and a synthetic click-log generator with a known ground truth."""

from terarec.data.hashing import hash_column, hash_values, missing_key
from terarec.data.readers import (
    DataError,
    ReadStats,
    batch_from_records,
    csv_schema,
    iter_batches,
    parquet_schema,
)

__all__ = [
    "DataError", "ReadStats", "batch_from_records", "csv_schema", "hash_column",
    "hash_values", "iter_batches", "missing_key", "parquet_schema",
]
