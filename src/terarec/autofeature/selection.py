"""Keep the candidates that measurably help: greedy forward selection by validation AUC.

Every candidate is scored by training a small, fast terarec model (LR or FM through the
ordinary ``Trainer``) on a sample of the training rows and measuring AUC on a sample of
the validation rows::

    round 1     base + c            for every candidate c   -> each candidate's own gain
    round k>1   base + chosen + c   for the best few left   -> the gain over the chosen
    stop        at the budget, or when the best gain left is below min_gain

The samples are augmented with every candidate once and converted to keys once; each
evaluation then only selects columns, so a round costs model fits, not SQL or hashing.
Later rounds consider the ``shortlist`` best candidates of round 1: a candidate that
does nothing alone rarely helps in company, and this keeps the cost linear in the number
of candidates rather than quadratic.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from terarec.autofeature.candidates import AutoFeatureError
from terarec.autofeature.engine import AutoFeatureEngine, copy_to_parquet, default_engine
from terarec.autofeature.source import PathSpec, display, expand_paths, source_sql
from terarec.autofeature.tables import FeatureTables, extend_schema
from terarec.autofeature.transform import apply_file
from terarec.config import DenseOptimizerConfig, ModelConfig, SparseOptimizerConfig, TrainConfig
from terarec.data.readers import iter_batches
from terarec.train.metrics import evaluate_scores
from terarec.types import Batch, FeatureSchema


@dataclass
class SelectionConfig:
    """How candidates are measured and when selection stops."""

    budget: int = 8            # most features kept
    min_gain: float = 0.001    # stop when the best remaining AUC gain is below this
    shortlist: int = 16        # candidates considered after round 1 (best single gains)
    model: str = "lr"          # lr or fm: fast, and a gain there is a gain in the data
    embedding_dim: int = 4     # fm only
    train_rows: int = 100_000  # sampled training rows the selection model fits on
    valid_rows: int = 50_000   # sampled validation rows its AUC is measured on
    epochs: int = 1
    batch_size: int = 512
    sparse_lr: float = 0.1
    dense_lr: float = 0.05
    seed: int = 0
    threads: int = 1           # small steps: thread hand-offs cost more than they save

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise AutoFeatureError(f"budget must be >= 0, got {self.budget}")
        if self.shortlist < 1 or self.train_rows < 1 or self.valid_rows < 1:
            raise AutoFeatureError("shortlist, train_rows and valid_rows must be >= 1")
        if self.model not in ("lr", "fm"):
            raise AutoFeatureError(f"selection model must be lr or fm, got {self.model!r}")


@dataclass
class CandidateGain:
    """One candidate's measurements: ``gain`` is its round-1 gain (base + it vs base)."""

    name: str
    kind: str
    auc: float
    gain: float
    selected: bool = False
    round: int | None = None           # the round that chose it
    gain_when_chosen: float | None = None


@dataclass
class SelectionResult:
    auc_raw: float
    auc_selected: float
    selected: list[str]
    gains: list[CandidateGain]
    rounds: list[dict] = field(default_factory=list)
    evaluations: int = 0

    @property
    def gain(self) -> float:
        return self.auc_selected - self.auc_raw

    def to_dict(self) -> dict:
        return {"auc_raw": self.auc_raw, "auc_with_features": self.auc_selected,
                "gain": self.gain, "selected": list(self.selected),
                "evaluations": self.evaluations, "rounds": self.rounds,
                "gains": [asdict(g) for g in self.gains]}


def sample_rows(paths: PathSpec, schema: FeatureSchema, rows: int, out: str | os.PathLike, *,
                seed: int = 0, engine: AutoFeatureEngine | None = None) -> Path:
    """A reproducible uniform sample of at most ``rows`` rows of ``paths``, as Parquet with
    the raw columns (read with ``parquet_view(schema)``). DuckDB's reservoir sample streams
    the files, so they may be larger than memory."""
    engine = engine or default_engine()
    files = expand_paths(paths, what="input")
    con = engine.cursor()
    try:
        copy_to_parquet(engine, con, f"SELECT * FROM {source_sql(files, schema)} "
                        f"USING SAMPLE reservoir({int(rows)} ROWS) REPEATABLE ({int(seed)})",
                        Path(out), f"sampling {rows} rows of {display(files)}", (files, schema))
    finally:
        con.close()
    return Path(out)


def parquet_view(schema: FeatureSchema) -> FeatureSchema:
    """``schema`` reading a Parquet copy of its files (as ``sample_rows`` writes them)."""
    return replace(schema, format="parquet", has_header=True, column_names=())


class _Columns:
    """Rows converted once with every candidate; Batches for any subset of fields."""

    def __init__(self, path: Path, schema: FeatureSchema) -> None:
        self.schema = schema
        parts = list(iter_batches(path, schema, 1 << 16))
        if not parts:
            raise AutoFeatureError(f"{path}: no rows to select features on")
        self.batch = Batch.concat(parts) if len(parts) > 1 else parts[0]
        self.numeric = [f.name for f in schema.numeric]

    def subset(self, schema: FeatureSchema) -> Batch:
        idx = [self.numeric.index(f.name) for f in schema.numeric]
        if schema.missing_flags:
            idx += [len(self.numeric) + i for i in idx]
        dense = self.batch.dense[:, idx]
        return Batch(dense, self.batch.sparse.select_fields(schema.sparse_names),
                     self.batch.labels)


def _fit_auc(schema: FeatureSchema, train: Batch, valid: Batch, config: SelectionConfig) -> float:
    from terarec.train.trainer import Trainer

    train_config = TrainConfig(
        batch_size=config.batch_size, pass_rows=len(train) + 1, epochs=1, seed=config.seed,
        threads=config.threads, device="cpu",
        model=ModelConfig(name=config.model, embedding_dim=config.embedding_dim),
        sparse_optimizer=SparseOptimizerConfig(lr=config.sparse_lr),
        dense_optimizer=DenseOptimizerConfig(lr=config.dense_lr))
    trainer = Trainer(schema, train_config)
    batches = [train.slice(i, i + config.batch_size)
               for i in range(0, len(train), config.batch_size)]
    planned = trainer.plan(batches)
    for _ in range(config.epochs):
        trainer.train_pass(planned)
    probs = trainer.predict_batches([valid])
    return float(evaluate_scores(valid.labels.numpy(), probs)["auc"])


def select_features(tables: FeatureTables, schema: FeatureSchema, train_sample: Path,
                    valid_sample: Path, config: SelectionConfig | None = None, *,
                    engine: AutoFeatureEngine | None = None,
                    log: Callable[[str], None] | None = None) -> SelectionResult:
    """Greedy forward selection of ``tables`` by validation AUC gain.

    ``train_sample`` and ``valid_sample`` are raw rows read with ``schema`` (typically
    ``sample_rows`` output with ``parquet_view(schema)``); ``tables`` were computed from
    the training range.
    """
    config = config or SelectionConfig()
    engine = engine or default_engine()
    log = log or (lambda _msg: None)
    if not tables.tables:
        raise AutoFeatureError("no candidates to select from")
    full = extend_schema(schema, tables)
    work = Path(engine.scratch_dir())
    augmented = []
    try:
        for name, sample in (("train", train_sample), ("valid", valid_sample)):
            out = work / f"select-{name}-{os.getpid()}-{id(config)}.parquet"
            augmented.append(apply_file(tables, sample, schema, out, engine=engine))
        train, valid = (_Columns(p, full) for p in augmented)
    finally:
        for p in augmented:
            p.unlink(missing_ok=True)

    evaluations = 0

    def auc_of(names: Sequence[str]) -> float:
        nonlocal evaluations
        evaluations += 1
        sub = extend_schema(schema, tables.select(names)) if names else \
            replace(full, fields=schema.fields)
        return _fit_auc(sub, train.subset(sub), valid.subset(sub), config)

    threads = torch.get_num_threads()  # the selection model sets its own; restored below
    try:
        return _greedy(tables, auc_of, config, log, lambda: evaluations, len(train.batch),
                       len(valid.batch))
    finally:
        torch.set_num_threads(threads)


def _greedy(tables: FeatureTables, auc_of: Callable[[Sequence[str]], float],
            config: SelectionConfig, log: Callable[[str], None],
            evaluations: Callable[[], int], train_rows: int,
            valid_rows: int) -> SelectionResult:
    auc_raw = auc_of([])
    log(f"raw features: AUC {auc_raw:.4f} ({train_rows} training rows sampled, "
        f"{valid_rows} validation rows)")
    gains = []
    for t in tables.tables:
        auc = auc_of([t.name])
        gains.append(CandidateGain(t.name, t.candidate.kind, auc, auc - auc_raw))
        log(f"  {t.name:<40} AUC {auc:.4f}  gain {auc - auc_raw:+.4f}")
    by_name = {g.name: g for g in gains}
    ranked = sorted(gains, key=lambda g: -g.gain)
    selected: list[str] = []
    current = auc_raw
    rounds: list[dict] = []
    pool = [g.name for g in ranked[:config.shortlist]]
    round_gains = {g.name: g.gain for g in gains}
    while len(selected) < config.budget:
        rnd = len(selected) + 1
        if rnd > 1:
            round_gains = {n: auc_of(selected + [n]) - current
                           for n in pool if n not in selected}
        if not round_gains:
            break
        best = max(round_gains, key=lambda n: round_gains[n])
        rounds.append({"round": rnd, "best": best, "gain": round_gains[best],
                       "considered": len(round_gains)})
        if round_gains[best] < config.min_gain:
            log(f"round {rnd}: best gain {round_gains[best]:+.4f} ({best}) is below "
                f"{config.min_gain}; stopping")
            break
        selected.append(best)
        current += round_gains[best]
        g = by_name[best]
        g.selected, g.round, g.gain_when_chosen = True, rnd, round_gains[best]
        log(f"round {rnd}: + {best} (gain {round_gains[best]:+.4f}, AUC {current:.4f})")
    return SelectionResult(auc_raw, current, selected, gains, rounds, evaluations())
