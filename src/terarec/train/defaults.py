"""Training defaults sized to the data: batch size, learning rates, epochs, admission,
the embedding width and Adagrad's starting accumulator, from a quick estimate of the
number of training rows.

The fixed defaults (batch 4096, one epoch) suit endless streams; on 10^4 rows they make
two optimizer steps. So when the row count is known, the settings a user did not give
follow it::

    batch_size          rows / 32, a power of two in [256, 4096]  (>= 32 steps an epoch)
    learning rates      scaled by sqrt(batch_size / 4096)          (the adaptive-optimizer
                                                                    rule for batch size)
    epochs              2 below 100,000 rows, else 1
    admit_min_count     2 below 100,000 rows, else 1
    initial_accumulator 0 below 100,000 rows, else 0.001; with a validation set, small
                        data tries both and keeps the better
    bucket_l2           0; with a validation set, small data with bucketed numeric
                        fields then tries 1 with the chosen start and keeps the better
    model               the given one; with a validation set, the default model races
                        its first-order part (small data: at the chosen start; up to
                        10^7 rows: at two starts) and keeps the better
    SMALL_DATA_SHAPE    per model below 100,000 rows: embedding width, dense-rate factor
    DENSE_RATE_FACTOR   per model at every size: the dense-rate factor

At 131,072 rows and above every other value is the fixed default. With a validation set
the epoch count is an upper bound under patience; ``max_epochs`` leaves room for at
least ``MIN_SELECTED_STEPS`` optimizer steps. A run that gives any of ``SIZED_KEYS``
keeps the fixed defaults for the rest (they are tuned together); admission and the
width are sized unless given themselves. Below 100,000 rows a run with a validation set
is refit on train + valid (``refit_by_default``). Why each value, and what it was
measured against: docs/models.md, "Data-sized defaults". With a validation set these
values are the default a small portfolio races (``train.portfolio``): the data replaces
them where an alternative beats them beyond the validation noise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from terarec.config import TrainConfig
from terarec.train.selection import DEFAULT_MAX_EPOCHS
from terarec.types import FeatureSchema

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
BUCKET_L2_KEY = "sparse_optimizer.bucket_l2"
# With a validation set, small data with bucketed numeric fields also trains the bucket
# rows' prior beside its absence and keeps it where the validation value is better
# (``bucket_l2_choices``): the planted truths want it, the Criteo sample does not.
SMALL_DATA_BUCKET_L2_CHOICES = (0.0, 1.0)
MODEL_KEY = "model.name"
DENSE_LR_KEY = "dense_optimizer.lr"
# With a validation set, small data trained with the default model (nothing of the model
# given) also trains the default's first-order part alone and keeps the one with the
# better validation value (``model_choices``): below 100,000 rows the factors and the
# deep part often fit noise sooner than the first-order weights converge.
SMALL_DATA_MODEL_CHOICES = ("deepfm", "lr")
# With a validation set, from SMALL_DATA_ROWS to FIRST_ORDER_MAX_ROWS training rows the
# default model (nothing of it or of Adagrad's start given) races its first-order part
# at each of these starts and keeps the best by validation (``first_order_choices``):
# there the factors and the deep part can stop early on what they overfit while one-hot
# weights still gain, and at batch 4096 a value's batch-mean gradient is near 1e-4, so
# the start decides how far a rare weight moves. Above the bound the race's cost (one
# more run of the default model) is not spent.
FIRST_ORDER_MODEL = SMALL_DATA_MODEL_CHOICES[1]
FIRST_ORDER_STARTS = (0.001, 1e-5)
FIRST_ORDER_MAX_ROWS = 10_000_000
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


def evaluations_per_epoch(rows: int | None, batch_size: int, pass_rows: int) -> int:
    """How many passes (each evaluated) an epoch of ``rows`` rows is cut into: a pass is
    a whole number of batches of at least ``pass_rows`` rows. 1 when ``rows`` is
    unknown."""
    if rows is None or rows <= 0:
        return 1
    per_pass = math.ceil(pass_rows / batch_size) * batch_size
    return max(1, math.ceil(rows / per_pass))


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


def bucket_l2_choices(accumulators: tuple[float, ...] | None, given: set[str],
                      schema: FeatureSchema) -> tuple[float, ...] | None:
    """The bucket prior's strengths a run chooses between by validation: when it chooses
    its start (``accumulators``, from ``accumulator_choices``), the strength is not
    given and the schema has bucketed numeric fields; otherwise None."""
    if accumulators is None or BUCKET_L2_KEY in given \
            or not any(f.kind == "numeric" for f in schema.sparse_fields):
        return None
    return SMALL_DATA_BUCKET_L2_CHOICES


def model_choices(accumulators: tuple[float, ...] | None, given: set[str], model: str,
                  rows: int) -> dict[str, dict[str, float]] | None:
    """The models a run chooses between by validation, each with the sized dense rate it
    trains with (``rows`` training rows): when the run chooses its start
    (``accumulators``), trains the default model and was given nothing of the model (its
    name, width or layers); otherwise None."""
    if accumulators is None or model != SMALL_DATA_MODEL_CHOICES[0] \
            or any(k == "model" or k.startswith("model.") for k in given):
        return None
    return {m: {DENSE_LR_KEY: float(sized_defaults(rows, m)[DENSE_LR_KEY])}
            for m in SMALL_DATA_MODEL_CHOICES}


def first_order_choices(sized: dict, given: set[str], config: TrainConfig
                        ) -> dict[str, dict[str, float | str]] | None:
    """The members a run with a validation set races from ``SMALL_DATA_ROWS`` to
    ``FIRST_ORDER_MAX_ROWS`` estimated rows (``sized``: ``apply_sized_defaults``'s
    report, which sized the schedule): the default model as sized, and its first-order
    part at each of ``FIRST_ORDER_STARTS`` with its own sized dense rate, by member name
    (dotted values). None where the run trains a model, a start or a schedule that was
    given, or optimizers that read no start."""
    rows = sized.get("estimated_rows")
    if rows is None or not SMALL_DATA_ROWS <= rows <= FIRST_ORDER_MAX_ROWS \
            or DENSE_LR_KEY not in sized or ACCUMULATOR_KEY in given \
            or config.model.name != SMALL_DATA_MODEL_CHOICES[0] \
            or config.sparse_optimizer.name != "adagrad" \
            or any(k == "model" or k.startswith("model.") for k in given):
        return None
    rate = float(sized_defaults(int(rows), FIRST_ORDER_MODEL)[DENSE_LR_KEY])
    members: dict[str, dict[str, float | str]] = {config.model.name: {}}
    for start in FIRST_ORDER_STARTS:
        members[f"{FIRST_ORDER_MODEL} (start {start:g})"] = {
            MODEL_KEY: FIRST_ORDER_MODEL, DENSE_LR_KEY: rate, ACCUMULATOR_KEY: start}
    return members


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
