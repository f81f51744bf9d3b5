"""Typed configuration: validated when read (``from_dict`` / ``load_train_config``), so a
typo, a wrong type or a value out of range is an error naming its JSON path, never a knob
that silently does nothing.

Fields that are also ``terarec train`` flags say so with ``knob(...)``: the flags are
generated from these fields (terarec.cli.common), so adding a knob is adding a field.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import re
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, Field

from terarec.validation import STRICT, InvalidInput, validate, validate_json

SparseOptimizerName = Literal["adagrad", "adam", "ftrl", "sgd"]
Precision = Literal["fp32", "fp16", "int8", "int4"]
# train.dense_step's switches (``TrainConfig.compile`` / ``.autocast``).
CompileMode = Literal["auto", "on", "off"]
AutocastMode = Literal["auto", "bf16", "off"]
T = TypeVar("T")

Positive = Annotated[int, Field(gt=0)]
NonNegative = Annotated[int, Field(ge=0)]
Rate = Annotated[float, Field(gt=0)]  # finite too: STRICT refuses NaN and infinity
# A step above 1000 is a typo, never a setting; beyond float32 (3.4e38) the optimizers
# fail mid-pass with an overflow traceback.
LearningRate = Annotated[float, Field(gt=0, le=1000)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, lt=1)]

TRAINING = "training"
COMPRESSION = "embedding compression"
INPUT_FORMAT = "input format"
REGULARISATION = "regularisation"


@dataclass(frozen=True)
class Flag:
    """How a config field appears on the command line (see ``knob``)."""

    name: str  # e.g. "--batch-size"
    help: str = ""
    dest: str | None = None  # argparse attribute, when not derived from ``name``
    group: str = TRAINING
    metavar: str | None = None

    @property
    def attr(self) -> str:
        return self.dest or self.name.lstrip("-").replace("-", "_")


def knob(default: Any, flag: str, help: str = "", *, dest: str | None = None,
         group: str = TRAINING, metavar: str | None = None) -> Any:
    """A config field with default ``default`` that is also the flag ``flag``."""
    return field(default=default,
                 metadata={"flag": Flag(flag, help, dest, group, metavar)})


def flag_fields(cls: type | None = None, prefix: tuple[str, ...] = ()
                ) -> Iterator[tuple[tuple[str, ...], Flag, Any, Any]]:
    """(path, flag, type, default) of every field of ``cls`` (TrainConfig and the configs
    nested in it) that is a flag, in declaration order."""
    cls = cls or TrainConfig
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            yield from flag_fields(hints[f.name], path)
        elif isinstance(flag := f.metadata.get("flag"), Flag):
            yield path, flag, hints[f.name], f.default


_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
               "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30,
               "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_bytes(size: int | str) -> int:
    """``2GB`` -> 2 * 2**30. Units B, KB, MB, GB, TB (and KiB ... TiB), powers of 1024:
    memory budgets are about RAM, which comes in binary sizes."""
    if isinstance(size, int) and not isinstance(size, bool):
        value, unit = float(size), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
        if m is None or m.group(2).upper() not in _SIZE_UNITS:
            raise ValueError(f"size {size!r}: expected a number with an optional unit "
                             f"(B, KB, MB, GB, TB), e.g. 512MB")
        value, unit = float(m.group(1)), m.group(2).upper()
    out = int(value * _SIZE_UNITS[unit])
    if out <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return out


def _check_size(size: int | str | None) -> int | str | None:
    if size is not None:
        parse_bytes(size)
    return size


MemorySize = Annotated[int | str, AfterValidator(_check_size)]


def _check_device(name: str) -> str:
    """Only names terarec trains on: whether this machine has the device is checked when
    the run starts (terarec.distributed.context.resolve_device)."""
    if re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", name) is None:
        raise ValueError(f"{name!r} is not a device terarec trains on: auto, cpu, cuda "
                         "or cuda:N")
    return name


Device = Annotated[str, AfterValidator(_check_device)]

# The models terarec.models.registry builds (its test keeps the two lists equal): checked
# where a config is read, so a misspelt name is named by its path before any work.
MODEL_NAMES = ("lr", "fm", "widedeep", "deepfm", "dcnv2", "dlrm", "dssm", "din", "seqpool",
               "sharedbottom", "mmoe", "esmm")


# A model of the user's own: ``package.module:ClassName``, a ``terarec.CTRModel``
# subclass imported by that path wherever the model is built (ranks, resume, serving).
_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def is_import_path(name: str) -> bool:
    """Whether ``name`` names a user's model class (``module:Class``), not a built-in."""
    return ":" in name


def _check_model_name(name: str) -> str:
    if is_import_path(name):
        if not _IMPORT_PATH.match(name):
            raise ValueError(f"model {name!r}: a model of your own is named "
                             "'package.module:ClassName'")
        return name
    if name.lower() not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}, "
                         "or a class of your own as 'package.module:ClassName'")
    return name


ModelName = Annotated[str, AfterValidator(_check_model_name)]


# How DDP exchanges the dense gradients under torchrun (distributed/dense_comm.py).
DenseCommMode = Literal["none", "fp16", "dgc"]
DENSE_COMMS: tuple[str, ...] = ("none", "fp16", "dgc")


@dataclass
class DenseCommConfig:
    """``mode`` and the DGC knobs (ignored by the other modes)."""

    mode: DenseCommMode = "none"
    dgc_ratio: float = 0.001
    # The paper's 0.9. It accumulates the optimizer's update (distributed/dense_comm.py):
    # a coordinate held back for many steps is sent up to 1 / (1 - m) times its summed
    # update, which makes up for the delay at 0.1 % density; on the benchmark's data
    # (docs/distributed.md) 0.9 lost 0.0015 validation AUC against all-reduce, 0.5 0.0034.
    dgc_momentum: float = 0.9
    dgc_warmup_steps: int = 100

    def __post_init__(self) -> None:
        if self.mode not in DENSE_COMMS:
            raise ValueError(f"unknown dense communication {self.mode!r}; known: {DENSE_COMMS}")
        if not 0.0 < self.dgc_ratio <= 1.0:
            raise ValueError(f"DGC ratio must be in (0, 1], got {self.dgc_ratio}")
        if not 0.0 <= self.dgc_momentum < 1.0:
            raise ValueError(f"DGC momentum must be in [0, 1), got {self.dgc_momentum}")
        if self.dgc_warmup_steps < 0:
            raise ValueError(f"DGC warm-up steps must be >= 0, got {self.dgc_warmup_steps}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class ModelConfig:
    """Network shape. ``embedding_dim`` is the width of one key's deep embedding."""

    __pydantic_config__ = STRICT

    name: ModelName = knob("deepfm", "--model", ", ".join(MODEL_NAMES) + ", or a CTRModel "
                           "subclass of your own as package.module:ClassName (not given: "
                           "deepfm, or lr where small data's validation rows prefer it)",
                           dest="model_name")
    embedding_dim: Positive = knob(16, "--embedding-dim")
    bottom_mlp: tuple[Positive, ...] = (64, 16)
    top_mlp: tuple[Positive, ...] = (512, 256)
    deep_mlp: tuple[Positive, ...] = (256, 128)
    cross_layers: NonNegative = 3
    cross_rank: NonNegative = 0  # DCN-v2: 0 = full-rank cross weights, r > 0 = low-rank U V^T
    dropout: Fraction = knob(0.0, "--dropout", "dropout after every hidden MLP layer",
                             group=REGULARISATION)
    batch_norm: bool = knob(False, "--batch-norm", "batch norm before every hidden MLP "
                            "activation", group=REGULARISATION)
    # Two-tower (DSSM) split: ``item_fields`` empty means every categorical field that is
    # not a user field. Both towers use ``deep_mlp``; its last width is the vector size.
    user_fields: tuple[str, ...] = ()
    item_fields: tuple[str, ...] = ()
    tower_similarity: Literal["cosine", "dot"] = "cosine"
    cosine_scale: Rate = 10.0
    # Multi-task models (sharedbottom, mmoe, esmm): each task's tower after the shared
    # part, and MMoE's expert count (each expert is a ``deep_mlp``).
    tower_mlp: tuple[Positive, ...] = (64,)
    num_experts: Positive = 4

    def with_embedding_dim(self, dim: int) -> ModelConfig:
        """This shape at width ``dim``. DLRM's bottom MLP must end at the width (its
        output is dotted with the rows), so where it did, it ends at the new one."""
        bottom = self.bottom_mlp
        if self.name == "dlrm" and bottom and bottom[-1] == self.embedding_dim:
            bottom = (*bottom[:-1], dim)
        return dataclasses.replace(self, embedding_dim=dim, bottom_mlp=bottom)


@dataclass
class SparseOptimizerConfig:
    """Per-key optimizer, applied to a pass's working set inside the backward pass."""

    __pydantic_config__ = STRICT

    name: SparseOptimizerName = knob("adagrad", "--sparse-optimizer")
    lr: LearningRate = knob(0.05, "--sparse-lr")
    eps: Rate = 1e-8
    # Adagrad's accumulator before a row's first step: at 0 that step moves every
    # coordinate by the full rate whatever the gradient's size, which at batch 4096
    # makes keys seen once jump as far as frequent ones (terarec.train.defaults).
    initial_accumulator: NonNegativeFloat = knob(
        0.001, "--sparse-initial-accumulator", "Adagrad's per-row accumulator before the "
        "first step; below 100,000 rows 0, or with --valid 0 or 0.001 by validation, "
        "unless the batch size or a rate is given",
        metavar="ACC")
    beta1: Fraction = 0.9
    beta2: Fraction = 0.999
    ftrl_alpha: Rate = 0.05
    ftrl_beta: NonNegativeFloat = 1.0
    ftrl_l1: NonNegativeFloat = 0.0
    ftrl_l2: NonNegativeFloat = 0.0
    weight_decay: NonNegativeFloat = knob(
        0.0, "--sparse-weight-decay", "L2 added to a touched row's gradient once per step",
        group=REGULARISATION, metavar="WD")
    # L2 on every row at every step (a full-batch penalty; scikit-learn's 1 / (C * N)),
    # applied lazily: see terarec.embedding.optimizers.
    l2: NonNegativeFloat = knob(
        0.0, "--sparse-l2", "L2 on every embedding row at every step, touched or not "
        "(adagrad, sgd): rare keys shrink more", group=REGULARISATION, metavar="L2")
    # L2 on the embeddings a batch looks up (BARS's embedding_regularizer), per use and
    # relative to the batch size: see terarec.embedding.optimizers.
    embedding_l2: NonNegativeFloat = knob(
        0.0, "--embedding-l2", "L2 on the embeddings each batch looks up, per use and "
        "independent of the batch size", group=REGULARISATION, metavar="LAMBDA")
    # The same per-use L2 on the rows of bucketed numeric fields only (their count-range
    # keys), which the truths' and real samples' numerics want much stronger than the
    # categorical values: see terarec.embedding.optimizers.
    bucket_l2: NonNegativeFloat = knob(
        0.0, "--bucket-l2", "per-use L2 on the rows of bucketed numeric fields' keys, "
        "independent of the batch size; below 100,000 rows with validation rows 0 or 1 "
        "by validation", group=REGULARISATION, metavar="LAMBDA")
    # Group lasso: after each update a row shrinks by ``step * group_lasso`` in L2 norm
    # (to exactly zero when shorter); zero rows are pruned from the store at pass end.
    group_lasso: NonNegativeFloat = knob(
        0.0, "--group-lasso", "group-lasso strength on embedding rows; zero rows are pruned",
        group=COMPRESSION, metavar="LAMBDA")


@dataclass
class DenseOptimizerConfig:
    __pydantic_config__ = STRICT

    name: Literal["adam", "adagrad", "sgd"] = "adam"
    lr: LearningRate = knob(1e-3, "--dense-lr")
    weight_decay: NonNegativeFloat = knob(0.0, "--dense-weight-decay",
                                          "weight decay of the dense optimizer",
                                          group=REGULARISATION, metavar="WD")


@dataclass
class StoreConfig:
    """Embedding store policies: admission, eviction, row initialisation.

    ``memory_budget`` (bytes, or a size such as "512MB" / "2GB", powers of 1024) or
    ``disk_path`` selects the tiered store: hot rows in RAM under the budget, every row
    in slab files under ``disk_path`` (a temporary folder when unset). ``cache_policy``
    picks which rows stay in RAM: "lfu" (highest show count) or "lru" (latest use).
    """

    __pydantic_config__ = STRICT

    admit_min_count: NonNegative = knob(1, "--admit-min-count",
                                        "a key gets a row once seen this often")
    # Admission and eviction policies: docs/admission.md (terarec.embedding.admission,
    # terarec.embedding.eviction).
    admit_min_clicks: NonNegative = knob(0, "--admit-min-clicks",
                                         "... and once it had this many clicks")
    admit_sketch_bytes: MemorySize | None = knob(
        None, "--admit-sketch-bytes", "count waiting keys in a count-min sketch of this "
        "fixed size (per store) instead of an exact table, e.g. 64MB")
    admit_probability: Annotated[float, Field(gt=0, le=1)] | None = knob(
        None, "--admit-probability", "admit a new key with probability P per show")
    evict_after_passes: Positive | None = knob(None, "--evict-after-passes",
                                               "drop keys unseen for N passes")
    evict_l2_below: NonNegativeFloat | None = knob(
        None, "--evict-l2-below", "drop rows whose L2 norm is below X at pass end")
    evict_show_below: NonNegativeFloat | None = knob(
        None, "--evict-show-below", "drop keys with fewer shows than X not seen this pass")
    max_keys: Positive | None = knob(None, "--max-keys", "evict at pass end down to N keys "
                                     "(per rank: N / ranks)")
    max_store_bytes: MemorySize | None = knob(
        None, "--max-store-bytes", "evict at pass end until the rows take at most this "
        "(values, optimizer state, counters, key)")
    evict_score: Literal["lfu", "lru", "l2"] = knob(
        "lfu", "--evict-score", "which keys --max-keys / --max-store-bytes evict first: "
        "fewest shows, longest unseen, smallest L2 norm")
    init_std: NonNegativeFloat = 0.01
    memory_budget: MemorySize | None = knob(
        None, "--memory-budget", "RAM for the embedding store, e.g. 512MB or 2GB: rows "
        "beyond it live on disk (tiered store)")
    disk_path: str | None = knob(None, "--store-dir", "folder for the tiered store's disk "
                                 "tier (default: OUT/store for train)")
    cache_policy: Literal["lfu", "lru"] = knob(
        "lfu", "--cache-policy", "which rows the tiered store keeps in RAM")
    key_index: Literal["ram", "disk"] = knob(
        "ram", "--key-index", "where the tiered store indexes its keys: ram (a hash table, "
        "36-68 B per key) or disk (sorted runs beside the slabs, about 1 B of RAM per key "
        "plus the keys in play): docs/tiered-store.md")
    # Compression (docs/compression.md). ``precision`` is how row values are kept (the
    # optimizer state stays fp32); ``variable_dims`` are the widths of the rarer frequency
    # classes below the full row, ``promote_at`` the show counts that move a key up a class,
    # ``class_precisions`` optionally one precision per class (rarest first, full row last).
    precision: Precision = knob(
        "fp32", "--precision", "how the store keeps row values (optimizer state stays fp32)",
        group=COMPRESSION)
    stochastic_rounding: bool = knob(
        False, "--stochastic-rounding", "round values stochastically when rows are written "
        "back", group=COMPRESSION)
    variable_dims: tuple[Positive, ...] = knob(
        (), "--variable-dims", "widths of the rarer frequency classes, e.g. 1,4 (full row "
        "above)", group=COMPRESSION)
    promote_at: tuple[NonNegativeFloat, ...] = knob(
        (), "--promote-at", "show counts that move a key to the next class, e.g. 10,100",
        group=COMPRESSION)
    class_precisions: tuple[Precision, ...] = ()

    def __post_init__(self) -> None:
        # Thresholds or precisions without the classes they belong to would be ignored.
        if self.promote_at and len(self.promote_at) != len(self.variable_dims):
            raise ValueError(
                f"promote_at {list(self.promote_at)} (--promote-at) needs one width per "
                f"threshold in variable_dims (--variable-dims), got "
                f"{list(self.variable_dims) or 'none'}")
        if self.variable_dims and not self.promote_at:
            raise ValueError(f"variable_dims {list(self.variable_dims)} (--variable-dims) "
                             "needs the show counts that move a key up a class: "
                             "promote_at (--promote-at)")
        if self.admit_probability is not None and (
                self.admit_min_count > 1 or self.admit_min_clicks
                or self.admit_sketch_bytes is not None):
            raise ValueError("admit_probability (--admit-probability) admits by a draw "
                             "per show: it does not combine with admit_min_count > 1, "
                             "admit_min_clicks or admit_sketch_bytes")
        if self.admit_sketch_bytes is not None and self.admit_min_count <= 1 \
                and not self.admit_min_clicks:
            raise ValueError("admit_sketch_bytes counts keys until they are admitted: give "
                             "admit_min_count >= 2 or admit_min_clicks >= 1 with it")
        if self.admit_sketch_bytes is not None and max(self.admit_min_count,
                                                       self.admit_min_clicks) > 255:
            raise ValueError("admit_sketch_bytes counts up to 255: admit_min_count and "
                             "admit_min_clicks must be <= 255 with it")

    @property
    def tiered(self) -> bool:
        return self.memory_budget is not None or self.disk_path is not None


@dataclass
class TrainConfig:
    """Everything ``terarec train`` needs besides the data: saved as train_config.json."""

    __pydantic_config__ = STRICT

    batch_size: Positive = knob(4096, "--batch-size")
    pass_rows: Positive = knob(200_000, "--pass-rows", "rows per pass (store write-back unit)")
    epochs: Positive = knob(
        1, "--epochs", "epochs at most: without --valid the run trains them all (sized "
        "below 131,072 rows); with --valid an upper bound under --patience, by default "
        "10 + patience, more on small data (metrics.json: epochs_trained, epochs_limit)")
    # train.passes.shuffled_steps: cyclic order (the same batches in the same order every
    # epoch) when off; docs/models.md "Shuffled step order" for what it changes.
    shuffle: bool = knob(True, "--shuffle", "train each pass's batches in a new order "
                         "every epoch (drawn from --seed; the same on every rank and "
                         "on resume); --no-shuffle: file order every epoch")
    # Trainer.recalibrate; docs/models.md "Recalibrated output bias".
    recalibrate: bool = knob(True, "--recalibrate", "after every pass, shift the model's "
                             "output bias so that its mean prediction on the pass's rows "
                             "(65,536 at most) equals their click rate")
    loss: Literal["bce", "sampled_softmax"] = knob(
        "bce", "--loss", "bce (pointwise click loss) or sampled_softmax (dssm only: "
        "in-batch negatives with logQ correction, for retrieval; docs/retrieval.md)")
    seed: Annotated[int, Field(ge=0, lt=1 << 32)] = knob(0, "--seed")
    threads: Positive | None = knob(None, "--threads")
    device: Device = knob("auto", "--device", "auto, cpu, cuda, cuda:1 ...")
    # train.dense_step: the dense forward/loss/backward of a one-process run.
    compile: CompileMode = knob(
        "auto", "--compile", "torch.compile the dense step: auto compiles on a CUDA device "
        "once a run has trained 2,000 steps (never on a CPU, where it measured no faster); "
        "on compiles from the first step; a failed compilation falls back to eager")
    autocast: AutocastMode = knob(
        "auto", "--autocast", "run the dense network in bf16: auto where the hardware has "
        "native bf16 (CUDA, AMX or AVX-512 BF16 CPUs), bf16 anywhere, off for fp32")
    # docs/device.md: rows kept on the training device across passes, at most this much.
    device_budget: MemorySize | None = knob(
        None, "--device-budget", "device memory for hot rows and their optimizer state "
        "kept on the device across passes, e.g. 40GB (under torchrun: per rank, for its key shard)")
    on_bad_row: Literal["error", "skip"] = knob(
        "error", "--on-bad-row", "stop at the first bad row or skip and count bad rows",
        group=INPUT_FORMAT)
    model: ModelConfig = field(default_factory=ModelConfig)
    sparse_optimizer: SparseOptimizerConfig = field(default_factory=SparseOptimizerConfig)
    dense_optimizer: DenseOptimizerConfig = field(default_factory=DenseOptimizerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)


def from_dict(cls: type[T], data: Any, where: str = "") -> T:
    """``data`` (parsed JSON) validated as config dataclass ``cls``; ``InvalidInput``
    (a ValueError) names every bad field's path otherwise."""
    return validate(cls, data, where, root="config")


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def load_train_config(path: str | Path) -> TrainConfig:
    """The TrainConfig in JSON file ``path``; errors start with the file name."""
    raw = _config_bytes(path)
    refuse_yaml(path, raw, "a config file", '{"batch_size": 2048}')
    repeated = repeated_key(raw)
    if repeated is not None:  # JSON parsers keep the last: the first would be ignored
        raise InvalidInput(f"{path}: {repeated}: key given twice in one object; keep one")
    return validate_json(TrainConfig, raw, str(path), root="config")


def config_file_keys(path: str | Path) -> set[str]:
    """The dotted keys config file ``path`` sets (read as ``load_train_config`` reads it,
    which has checked it)."""
    keys: set[str] = set()

    def walk(node: dict[str, Any], prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                keys.add(prefix + k)

    walk(json.loads(_config_bytes(path)), "")
    return keys


def _config_bytes(path: str | Path) -> bytes:
    """The file's JSON text; a UTF-8 byte order mark (Windows editors write one) is not
    part of it and was reported as invalid JSON at line 1 column 1."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot read config file: {exc.strerror}") from None
    return raw.removeprefix(codecs.BOM_UTF8)


def refuse_yaml(path: str | Path, raw: bytes | str, what: str, example: str) -> None:
    """Refuse a ``.yaml`` / ``.yml`` file that is not JSON (the config file and the
    search space are JSON, one parser and no YAML dependency), naming the file: parsed as
    JSON it failed as "expected value at line 1 column 1"."""
    if Path(path).suffix.lower() not in (".yaml", ".yml"):
        return
    try:
        json.loads(raw)
    except ValueError:
        raise InvalidInput(f"{path}: {what} is JSON, not YAML: write the same keys as a "
                           f"JSON object, e.g. {example}") from None


class _Pairs(list[tuple[str, Any]]):
    """A JSON object's (key, value) pairs in file order, repeats kept."""


def repeated_key(raw: bytes | str) -> str | None:
    """The JSON path of the first key an object of ``raw`` repeats, or None (also for
    text that is not JSON: the validation that follows says what is wrong)."""
    try:
        doc = json.loads(raw, object_pairs_hook=_Pairs)
    except ValueError:
        return None

    def walk(node: Any, path: str) -> str | None:
        items: list[tuple[str, Any]] = []
        if isinstance(node, _Pairs):
            seen: set[str] = set()
            for key, value in node:
                where = f"{path}.{key}" if path else key
                if key in seen:
                    return where
                seen.add(key)
                items.append((where, value))
        elif isinstance(node, list):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(node)]
        for where, value in items:
            if (found := walk(value, where)) is not None:
                return found
        return None

    return walk(doc, "")


# Keys only some models or sparse optimizers read (section, key -> the names that read
# it); given to any other, the value would be silently ignored.
SEQUENCE_MODELS = ("din", "seqpool")  # an MLP over the fields and a sequence
MULTI_TASK_MODELS = ("sharedbottom", "mmoe", "esmm")  # one logit per label
_READ_ONLY_BY: dict[tuple[str, str], tuple[str, ...]] = {
    **{("model", k): ("dcnv2",) for k in ("cross_layers", "cross_rank")},
    **{("model", k): ("dlrm",) for k in ("bottom_mlp", "top_mlp")},
    ("model", "deep_mlp"): ("widedeep", "deepfm", "dcnv2", "dssm", *SEQUENCE_MODELS,
                            *MULTI_TASK_MODELS),
    **{("model", k): ("widedeep", "deepfm", "dcnv2", "dlrm", "dssm", *SEQUENCE_MODELS,
                      *MULTI_TASK_MODELS)
       for k in ("dropout", "batch_norm")},  # the models with an MLP
    ("model", "tower_mlp"): MULTI_TASK_MODELS,
    ("model", "num_experts"): ("mmoe",),
    **{("model", k): ("dssm",) for k in ("user_fields", "item_fields", "tower_similarity",
                                           "cosine_scale")},
    **{("sparse_optimizer", k): ("adam",) for k in ("beta1", "beta2")},
    **{("sparse_optimizer", k): ("ftrl",) for k in ("ftrl_alpha", "ftrl_beta", "ftrl_l1",
                                                      "ftrl_l2")},
    ("sparse_optimizer", "initial_accumulator"): ("adagrad",),
    ("sparse_optimizer", "l2"): ("adagrad", "sgd"),
    ("sparse_optimizer", "eps"): ("adagrad", "adam"),
}


def read_only_by(key: str) -> tuple[str, ...] | None:
    """The models (``model.*``) or sparse optimizers (``sparse_optimizer.*``) that read
    dotted ``key``, or None when every one reads it."""
    section, _, name = key.partition(".")
    return _READ_ONLY_BY.get((section, name))


def unused_keys(config: TrainConfig, given: set[str]) -> dict[str, str]:
    """What is wrong with each dotted key in ``given`` (the keys the user set) that the
    chosen model or sparse optimizer does not read, e.g. ``model.cross_layers`` for
    deepfm. A key at its default is left alone: a saved train_config.json lists every
    key."""
    sections = {"model": config.model, "sparse_optimizer": config.sparse_optimizer}
    defaults = {"model": ModelConfig(), "sparse_optimizer": SparseOptimizerConfig()}
    chosen = {"model": config.model.name.lower(), "sparse_optimizer": config.sparse_optimizer.name}
    found = {}
    for (section, key), readers in _READ_ONLY_BY.items():
        if section == "model" and is_import_path(config.model.name):
            continue  # a model of the user's own may read any model key
        value = getattr(sections[section], key)
        if f"{section}.{key}" in given and chosen[section] not in readers \
                and value != getattr(defaults[section], key):
            found[f"{section}.{key}"] = (f"only {section.replace('_', ' ')} "
                                         f"{' / '.join(readers)} reads it, this run's is "
                                         f"{chosen[section]}")
    return found


# What a checkpoint fixes: the parameters' shapes and meaning (the model, the optimizers'
# state, how rows are stored) and the seed of the run's random streams. A resumed run
# keeps them; every other knob (learning rates, epochs, batch size ...) may change.
RESUME_FIXED = ("model", "seed", "sparse_optimizer.name", "dense_optimizer.name",
                "store.precision", "store.variable_dims", "store.promote_at",
                "store.class_precisions")
RESUME_FREE = ("model.dropout",)  # a model key that changes no parameter


def _flat(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in node.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def _fixed(key: str) -> bool:
    return key not in RESUME_FREE and any(
        key == f or key.startswith(f + ".") for f in RESUME_FIXED)


def resumed_config(saved: TrainConfig, new: TrainConfig, given: set[str],
                   where: str = "") -> TrainConfig:
    """The config a resumed run trains with: ``saved``, the run's own config, with the
    keys the user set this time (``given``: dotted keys from flags or ``--config``) taken
    from ``new``, except the keys a checkpoint fixes (``RESUME_FIXED``): one of those in
    ``given`` with another value is a ValueError naming each such key, its flag and both
    values. A key not given keeps the run's value (``--resume --epochs 20`` trains
    longer with the batch size and learning rates it had, not the defaults)."""
    old, now = _flat(to_dict(saved)), _flat(to_dict(new))
    flags = {".".join(path): flag.name for path, flag, _, _ in flag_fields()}

    def is_given(key: str) -> bool:
        return any(key == g or key.startswith(g + ".") for g in given)

    changed = [k for k in old if _fixed(k) and is_given(k) and now.get(k) != old[k]]
    if changed:
        shown = "; ".join(
            f"{k}{' (' + flags[k] + ')' if k in flags else ''}: was {_value(old[k])}, "
            f"now {_value(now.get(k))}" for k in changed)
        raise ValueError(f"--resume: {where + ' ' if where else ''}was trained with other "
                         f"settings that its checkpoints fix: {shown}; resume without "
                         "them or train into another --out")
    merged = to_dict(saved)
    for key in (k for k in now if is_given(k) and not _fixed(k)):
        *parents, last = key.split(".")
        node = merged
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = now[key]
    return from_dict(TrainConfig, merged)


def _value(v: Any) -> str:
    return repr(list(v) if isinstance(v, tuple) else v)
