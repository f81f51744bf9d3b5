"""Training defaults sized to the data: batch size, learning rates and epochs from a quick
estimate of the number of training rows.

The fixed defaults (batch 4096, one epoch) suit endless streams; on 10^4 rows they make
two optimizer steps. So when the row count is known, the settings a user did not give
follow it::

    batch_size     rows / 32, as a power of two in [256, 4096]  (>= 32 steps an epoch)
    learning rates scaled by sqrt(batch_size / 4096)            (the adaptive-optimizer
                                                                 rule for batch size)
    epochs         2 below 100,000 rows, else 1

    admit_min_count 2 below 100,000 rows, else 1               (a key seen once gets no
                                                                 row of its own)
    initial_accumulator 0 below 100,000 rows, else 0.001        (sparse Adagrad; with a
                                                                 validation set, small data
                                                                 tries 0 and 0.001 and
                                                                 keeps the better)

    Wide&Deep and DLRM below 100,000 rows: embedding_dim 8 instead of 16 and half the
    dense learning rate (``SMALL_DATA_SHAPE``; DLRM's bottom MLP ends at the width):
    keys seen a few times each fit fewer factors, and the deep part, which overfits
    the first, learns more slowly

    DeepFM at every size: an eighth of the dense learning rate (``DENSE_RATE_FACTOR``).
    Its deep part starts at zero (an untrained DeepFM is an FM); learning slowly, it
    adds to the FM what the rows support instead of memorising them within a few passes

At 131,072 rows and above every other value is the fixed default.

With a validation set the epoch count is only an upper bound (patience stops training);
``max_epochs`` sizes that bound so that it allows at least ``MIN_SELECTED_STEPS``
optimizer steps: on small data a linear model still improving after ten short epochs
was cut off by the bound, not by its validation loss.
A run that gives any of the first four (flag or config file) gets the fixed defaults for
the rest: they are tuned together. Admission is separate: it is sized unless
``store.admit_min_count`` itself is given; so is the embedding width, unless
``model.embedding_dim`` is given (a checkpoint fixes the width: a resumed run keeps its
own, ``config.resumed_config``). On few rows a key seen once has one label to
fit, so its own row learns noise; unadmitted keys share the store's zero row.
Row-wise Adagrad's first step moves a row by the full rate whatever its gradient; the
accumulator it starts from (0.001, in squared-gradient units of the batch-mean loss)
makes a row's first steps proportional to its gradient instead. At batch 4096 that stops
keys seen once or twice in a batch from jumping as far as frequent ones: on synthetic
data with a planted model it raised DeepFM from 0.7179 to 0.7430 AUC on 300,000 rows and
from 0.7407 to 0.7528 in ``quickstart`` (1,000,000 rows; ceiling 0.775), LR on 300,000
rows from 0.7316 to 0.7432. On the small samples (batch 256) the same start gained on
Criteo and cost Avazu 0.008 AUC (DeepFM and LR alike), so with the sized small-data
schedule the start is 0, unless ``sparse_optimizer.initial_accumulator`` is given. A
given batch size or rate gets the fixed start with the fixed rates: with batch 1024 and
rate 0.05 on 10,000 rows, always-present bucket keys made FM diverge from a start of 0
(AUC 0.44 against 0.70).
With a validation set on small data the run is refit (``refit_by_default``): once
validation has picked the best epoch count, a fresh model trains that many epochs on
the training and validation rows together, and that is the model the run writes.
Measured on the Criteo and Avazu samples (docs/models.md); without a validation set more
epochs overfit those 8,000 rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from terarec.config import TrainConfig
from terarec.train.selection import DEFAULT_MAX_EPOCHS

MIN_BATCH, MAX_BATCH = 256, 4096
STEPS_PER_EPOCH = 32
SMALL_DATA_ROWS = 100_000
SMALL_DATA_EPOCHS = 2
_SAMPLE_BYTES = 1 << 20

# Config keys (dotted) this module may set when the user did not.
SIZED_KEYS = ("batch_size", "epochs", "sparse_optimizer.lr", "dense_optimizer.lr")
ADMIT_KEY = "store.admit_min_count"
SMALL_DATA_ADMIT = 2
ACCUMULATOR_KEY = "sparse_optimizer.initial_accumulator"
SMALL_DATA_ACCUMULATOR = 0.0
# With a validation set, small data trains both starts side by side and keeps the one
# with the better validation value (``accumulator_choices``).
SMALL_DATA_ACCUMULATOR_CHOICES = (0.0, 0.001)
# The epoch upper bound with a validation set: room for this many steps, within limits.
MIN_SELECTED_STEPS = 3000
MAX_SELECTED_EPOCHS = 100
DIM_KEY = "model.embedding_dim"
BOTTOM_KEY = "model.bottom_mlp"  # dlrm: it ends at the width
# Per model, below SMALL_DATA_ROWS: the embedding width and the dense learning rate's
# factor (docs/models.md: measured on the three real samples and the synthetic data).
SMALL_DATA_SHAPE = {"widedeep": (8, 0.5), "dlrm": (8, 0.5)}
# Per model, at every size the schedule is sized: the dense learning rate's factor.
DENSE_RATE_FACTOR = {"deepfm": 0.125}


def estimate_rows(paths: Iterable[str | Path]) -> int | None:
    """Rows in ``paths`` from their sizes and the line length of their first MB (text
    files, compressed ones by their decompressed lines) or their metadata (Parquet);
    None when a file cannot be sized."""
    total = 0
    for path in paths:
        path = Path(path)
        try:
            size = path.stat().st_size
            if path.suffix == ".parquet":
                import pyarrow.parquet as pq

                total += pq.ParquetFile(path).metadata.num_rows
                continue
            codec = _CODECS.get(path.suffix.lower())
            if codec is not None:
                total += _compressed_rows(path, size, codec)
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


# What the readers decompress by extension (pyarrow's codec names).
_CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}


def _compressed_rows(path: Path, size: int, codec: str) -> int:
    """Rows of a compressed text file: the lines that its first MB of compressed bytes
    hold once decompressed, scaled by its compressed size (the compressed bytes' own
    newlines made a 10,000-row .gz file about 1,200 rows)."""
    import pyarrow as pa

    lines, last = 0, b"\n"
    marks: list[tuple[int, int]] = []  # (compressed bytes read, lines out) as reads go on
    with pa.OSFile(str(path)) as raw, pa.CompressedInputStream(raw, codec) as stream:
        while raw.tell() < _SAMPLE_BYTES:
            chunk = stream.read(1 << 16)
            if not chunk:  # all of it read: the count is exact
                return lines + (0 if last.endswith(b"\n") else 1)
            lines, last = lines + chunk.count(b"\n"), chunk
            if not marks or marks[-1][0] != raw.tell():
                marks.append((raw.tell(), lines))
    # The decompressor reads ahead (a bz2 block: hundreds of KB), so the lines per byte
    # are taken between two reads, where that lead cancels out.
    (read0, lines0), (read1, lines1) = marks[len(marks) // 4], marks[-1]
    if read1 > read0 and lines1 > lines0:
        return int(size * (lines1 - lines0) / (read1 - read0))
    return int(size * lines / read1)


def sized_defaults(rows: int, model: str = "") -> dict[str, float | int]:
    """The data-sized values of ``SIZED_KEYS`` for ``rows`` training rows of ``model``."""
    batch = 2 ** round(math.log2(max(rows, 1) / STEPS_PER_EPOCH))
    batch = int(min(MAX_BATCH, max(MIN_BATCH, batch)))
    scale = math.sqrt(batch / MAX_BATCH)
    small = rows < SMALL_DATA_ROWS
    dense_factor = DENSE_RATE_FACTOR.get(model, 1.0) * (
        SMALL_DATA_SHAPE[model][1] if small and model in SMALL_DATA_SHAPE else 1.0)
    base = TrainConfig()
    return {"batch_size": batch,
            "epochs": SMALL_DATA_EPOCHS if small else base.epochs,
            "sparse_optimizer.lr": base.sparse_optimizer.lr * scale,
            "dense_optimizer.lr": base.dense_optimizer.lr * scale * dense_factor}


def sized_embedding_dim(rows: int, model: str) -> int:
    """The data-sized ``model.embedding_dim`` of ``model`` for ``rows`` training rows."""
    if rows < SMALL_DATA_ROWS and model in SMALL_DATA_SHAPE:
        return SMALL_DATA_SHAPE[model][0]
    return TrainConfig().model.embedding_dim


def max_epochs(rows: int | None, batch_size: int) -> int:
    """The epoch upper bound of a run with a validation set (before its patience is
    added): ``DEFAULT_MAX_EPOCHS``, raised on small data to allow ``MIN_SELECTED_STEPS``
    steps, at most ``MAX_SELECTED_EPOCHS``; ``DEFAULT_MAX_EPOCHS`` when ``rows`` is
    unknown."""
    if rows is None:
        return DEFAULT_MAX_EPOCHS
    steps = max(1, math.ceil(rows / batch_size))
    wanted = math.ceil(MIN_SELECTED_STEPS / steps)
    return int(min(MAX_SELECTED_EPOCHS, max(DEFAULT_MAX_EPOCHS, wanted)))


def sized_admission(rows: int) -> int:
    """The data-sized ``store.admit_min_count`` for ``rows`` training rows."""
    return SMALL_DATA_ADMIT if rows < SMALL_DATA_ROWS else TrainConfig().store.admit_min_count


def accumulator_choices(sized: dict) -> tuple[float, ...] | None:
    """The starts a run with a validation set chooses between by validation
    (``SMALL_DATA_ACCUMULATOR_CHOICES``) when ``sized`` (``apply_sized_defaults``'s
    report) gave it the small-data start; None when the start is not the data's to pick."""
    if sized.get(ACCUMULATOR_KEY) != SMALL_DATA_ACCUMULATOR:
        return None
    return SMALL_DATA_ACCUMULATOR_CHOICES


def sized_initial_accumulator(rows: int) -> float:
    """The data-sized ``sparse_optimizer.initial_accumulator`` for ``rows`` training rows
    (read by Adagrad only)."""
    if rows < SMALL_DATA_ROWS:
        return SMALL_DATA_ACCUMULATOR
    return TrainConfig().sparse_optimizer.initial_accumulator


def refit_by_default(rows: int | None) -> bool:
    """Whether a run with a validation set refits on its training plus validation rows
    unless told otherwise (``--refit`` / ``--no-refit``): on small data, where the
    validation rows are a real share of what there is to learn from."""
    return rows is not None and rows < SMALL_DATA_ROWS


def apply_sized_defaults(config: TrainConfig, paths: Sequence[str | Path],
                         explicit: set[str]) -> tuple[TrainConfig, dict]:
    """``config`` with the data-sized values, unless ``explicit`` (the keys given by a flag
    or a config file) holds any of ``SIZED_KEYS``: batch size, learning rates and epochs
    belong together, so a run that sets one of them keeps the fixed defaults for the
    others. The admission count is sized unless ``ADMIT_KEY`` is explicit, the embedding
    width unless ``DIM_KEY`` is. Returns the config and what was set (empty when nothing
    was)."""
    sized_schedule = not explicit & set(SIZED_KEYS)
    # A probability admits by draws, not counts: no count to size next to it.
    sized_admit = ADMIT_KEY not in explicit and config.store.admit_probability is None
    sized_dim = DIM_KEY not in explicit
    if not (sized_schedule or sized_admit or sized_dim):
        return config, {}
    rows = estimate_rows(paths)
    if rows is None:
        return config, {}
    set_: dict = {"estimated_rows": rows}
    if sized_admit:
        admit = sized_admission(rows)
        if admit != config.store.admit_min_count:
            config = replace(config, store=replace(config.store, admit_min_count=admit))
            set_[ADMIT_KEY] = admit
    if sized_dim:
        dim = sized_embedding_dim(rows, config.model.name)
        model = config.model.with_embedding_dim(dim)
        if BOTTOM_KEY in explicit and model.bottom_mlp != config.model.bottom_mlp:
            model = config.model  # a bottom MLP the user gave ends at the width it fixes
        if model != config.model:
            config = replace(config, model=model)
            set_[DIM_KEY] = dim
    if not sized_schedule:
        return config, set_ if len(set_) > 1 else {}
    chosen = sized_defaults(rows, config.model.name)
    sparse, dense = config.sparse_optimizer, config.dense_optimizer
    if "sparse_optimizer.lr" in chosen:
        sparse = replace(sparse, lr=chosen["sparse_optimizer.lr"])
    # The small-data start goes with the small-data rates: with the fixed ones (a given
    # batch size or rate) always-present keys need the damped start at any size.
    if ACCUMULATOR_KEY not in explicit and sparse.name == "adagrad":
        acc = sized_initial_accumulator(rows)
        if acc != sparse.initial_accumulator:
            sparse = replace(sparse, initial_accumulator=acc)
            set_[ACCUMULATOR_KEY] = acc
    if "dense_optimizer.lr" in chosen:
        dense = replace(dense, lr=chosen["dense_optimizer.lr"])
    config = replace(config, sparse_optimizer=sparse, dense_optimizer=dense,
                     batch_size=int(chosen.get("batch_size", config.batch_size)),
                     epochs=int(chosen.get("epochs", config.epochs)))
    return config, {**set_, **chosen}
