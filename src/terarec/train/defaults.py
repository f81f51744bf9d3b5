"""Training defaults sized to the data: batch size, learning rates and epochs from a quick
estimate of the number of training rows.

The fixed defaults (batch 4096, one epoch) suit endless streams; on 10^4 rows they make
two optimizer steps. So when the row count is known, the settings a user did not give
follow it::

    batch_size     rows / 32, as a power of two in [256, 4096]  (>= 32 steps an epoch)
    learning rates scaled by sqrt(batch_size / 4096)            (the adaptive-optimizer
                                                                 rule for batch size)
    epochs         2 below 100,000 rows, else 1

At 131,072 rows and above every value is the fixed default, so large runs are unchanged.
A run that gives any of these four (flag or config file) gets the fixed defaults for the
rest: they are tuned together.
Measured on the Criteo and Avazu samples (docs/models.md); without a validation set more
epochs overfit those 8,000 rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from terarec.config import TrainConfig

MIN_BATCH, MAX_BATCH = 256, 4096
STEPS_PER_EPOCH = 32
SMALL_DATA_ROWS = 100_000
SMALL_DATA_EPOCHS = 2
_SAMPLE_BYTES = 1 << 20

# Config keys (dotted) this module may set when the user did not.
SIZED_KEYS = ("batch_size", "epochs", "sparse_optimizer.lr", "dense_optimizer.lr")


def estimate_rows(paths: Iterable[str | Path]) -> int | None:
    """Rows in ``paths`` from their sizes and the line length of their first MB (text
    files) or their metadata (Parquet); None when a file cannot be sized."""
    total = 0
    for path in paths:
        path = Path(path)
        try:
            size = path.stat().st_size
            if path.suffix == ".parquet":
                import pyarrow.parquet as pq

                total += pq.ParquetFile(path).metadata.num_rows
                continue
            with open(path, "rb") as fh:
                head = fh.read(_SAMPLE_BYTES)
        except (OSError, ValueError):
            return None
        lines = head.count(b"\n")
        if lines == 0:
            total += 1 if size else 0
        elif len(head) >= size:
            total += lines + (0 if head.endswith(b"\n") else 1)
        else:
            total += int(size * lines / len(head))
    return total


def sized_defaults(rows: int) -> dict[str, float | int]:
    """The data-sized values of ``SIZED_KEYS`` for ``rows`` training rows."""
    batch = 2 ** round(math.log2(max(rows, 1) / STEPS_PER_EPOCH))
    batch = int(min(MAX_BATCH, max(MIN_BATCH, batch)))
    scale = math.sqrt(batch / MAX_BATCH)
    base = TrainConfig()
    return {"batch_size": batch,
            "epochs": SMALL_DATA_EPOCHS if rows < SMALL_DATA_ROWS else base.epochs,
            "sparse_optimizer.lr": base.sparse_optimizer.lr * scale,
            "dense_optimizer.lr": base.dense_optimizer.lr * scale}


def apply_sized_defaults(config: TrainConfig, paths: Sequence[str | Path],
                         explicit: set[str]) -> tuple[TrainConfig, dict]:
    """``config`` with the data-sized values, unless ``explicit`` (the keys given by a flag
    or a config file) holds any of ``SIZED_KEYS``: batch size, learning rates and epochs
    belong together, so a run that sets one of them keeps the fixed defaults for the
    others. Returns the config and what was set (empty when nothing was)."""
    if explicit & set(SIZED_KEYS):
        return config, {}
    rows = estimate_rows(paths)
    if rows is None:
        return config, {}
    chosen = sized_defaults(rows)
    sparse, dense = config.sparse_optimizer, config.dense_optimizer
    if "sparse_optimizer.lr" in chosen:
        sparse = replace(sparse, lr=chosen["sparse_optimizer.lr"])
    if "dense_optimizer.lr" in chosen:
        dense = replace(dense, lr=chosen["dense_optimizer.lr"])
    config = replace(config, sparse_optimizer=sparse, dense_optimizer=dense,
                     batch_size=int(chosen.get("batch_size", config.batch_size)),
                     epochs=int(chosen.get("epochs", config.epochs)))
    return config, {"estimated_rows": rows, **chosen}
