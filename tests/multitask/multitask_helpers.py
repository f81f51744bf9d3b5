"""Small two-label data and the settings the multi-task tests train with."""

from __future__ import annotations

from pathlib import Path

from terarec.data.synth_conversion import CATEGORICAL, NUMERIC, generate_conversion

FIELDS = dict(format="csv", numeric=",".join(NUMERIC), categorical=",".join(CATEGORICAL))
QUICK = dict(batch_size=256, epochs=3, progress=False, refit=False,
             sparse_optimizer={"lr": 0.1, "initial_accumulator": 0.1},
             dense_optimizer={"lr": 3e-3},
             model={"embedding_dim": 8, "deep_mlp": (32,), "tower_mlp": (16,)})


def write_pair(folder: Path, rows: int = 3000, valid_rows: int = 2000) -> tuple[Path, Path]:
    """A train and a validation file of the same planted click-and-conversion truth."""
    train, valid = folder / "train.csv", folder / "valid.csv"
    generate_conversion(train, rows, sample_seed=0, vocab_scale=0.0005)
    generate_conversion(valid, valid_rows, sample_seed=1, vocab_scale=0.0005)
    return train, valid
