"""Hyper-parameter search: K trials of one ``train`` run trained together in one pass
loop over one shared key index (``terarec search`` and ``terarec.search``).

A ``SearchJob`` is a ``TrainJob`` (what every trial is: data, config, selection,
features; its ``out`` is the search directory) plus the search's own settings. The
trials' base is what ``train`` would run: data-sized defaults, numeric statistics, and
the Adagrad start train would choose by validation as the first trials. The best trial
is written as an ordinary model directory (``OUT/best``) and refit like ``train``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from terarec.api.model import Model
from terarec.api.training import (
    SKIP_WITH_FEATURES,
    TrainJob,
    check_disjoint,
    check_no_repeats,
    run_features,
    selection_for,
)
from terarec.config import TrainConfig, parse_bytes
from terarec.data.readers import ReadStats

if TYPE_CHECKING:
    from terarec.autofeature.features import FeatureConfig
    from terarec.distributed.context import DistContext
    from terarec.train.search import SearchConfig, SearchResult


@dataclass
class SearchJob:
    """A search: ``run`` is what each trial is (``run.out``: the search directory);
    ``space`` a JSON file or a mapping ``{dotted.config.path: spec}`` (None: the
    model's default space); ``prune_after`` the pass pruning starts at (None: enough
    passes for 100 optimizer steps)."""

    run: TrainJob
    trials: int = 8
    parallel: int | None = None
    sampler: str = "tpe"
    pruner: str = "halving"
    prune_after: int | None = None
    space: Path | Mapping[str, Any] | None = None


@dataclass
class SearchOutcome:
    """What a search found: the best trial as a ``Model`` (None when no trial scored),
    its values and validation score, and one row per trial."""

    best: Model | None
    best_params: dict[str, Any] | None
    best_value: float | None
    trials: list[dict[str, Any]] = field(default_factory=list)
    result: SearchResult | None = None  # the search's own record (rank 0)
    stats: ReadStats = field(default_factory=ReadStats)
    is_main: bool = True
    world: int = 1


def run_search_job(job: SearchJob) -> SearchOutcome:
    """Run ``job`` alone or as one torchrun rank (the same code)."""
    from terarec.autofeature.features import feature_inputs
    from terarec.distributed.context import topology

    run = job.run
    assert run.train is not None
    check_no_repeats(run.train, "--train")
    check_no_repeats(run.valid, "--valid")
    check_disjoint(run.train, run.valid)
    if not run.valid:
        raise ValueError("a search needs validation files (--valid): they pick the best "
                         "trial")
    if job.trials < 1:
        raise ValueError(f"--trials {job.trials}: must be >= 1")
    if job.parallel is not None and job.parallel < 1:
        raise ValueError(f"--parallel {job.parallel}: must be >= 1 (leave it out for all)")
    if run.checkpoint_every < 1:
        raise ValueError(f"--checkpoint-every {run.checkpoint_every}: must be >= 1")
    if job.prune_after is not None and job.prune_after < 1:
        raise ValueError(f"--prune-after {job.prune_after}: must be >= 1")
    config = run.config
    if run.features and config.on_bad_row == "skip":
        raise ValueError(SKIP_WITH_FEATURES)
    if not run.features:
        run.data.schema()  # a bad column setting fails before any work
    ctx = topology(config.device)
    features = _features(run, ctx)
    raw = run.data.for_model(features.base_schema) if features else None
    with feature_inputs(features, run.train, schema=raw) as train, \
            feature_inputs(features, run.valid, schema=raw) as valid:
        # the inputs as the trials read them (joined copies with AutoFeature tables)
        return _run(job, train, valid, features, ctx)


def _features(run: TrainJob, ctx: DistContext) -> FeatureConfig | None:
    """The search's AutoFeature tables, kept in the search directory (``features/``); a
    resumed search takes its own copy and cannot gain tables it did not start with."""
    from terarec.autofeature.features import model_features

    out = Path(run.out)
    own = model_features(out)
    resuming = run.resume and (own is not None or (out / "search.json").exists())
    if resuming and run.features and own is None:
        raise ValueError(f"--resume: the search in {out} was started without "
                         "--features; resume it without them, or search into another --out")
    return run_features(run.features, out, ctx, resuming=resuming)


def _run(job: SearchJob, train: list[Path], valid: list[Path],
         features: FeatureConfig | None, ctx: DistContext) -> SearchOutcome:
    """The search on ``train`` / ``valid`` as the trials read them."""
    from terarec.autofeature.features import install_features, keyed_copies
    from terarec.embedding.shared import sharing_refusal
    from terarec.train.passes import iter_file_batches
    from terarec.train.search import run_search
    from terarec.train.search.results import write_results, write_search_report
    from terarec.train.search.waves import search_directory_lock

    run = job.run
    out = Path(run.out)
    search = search_config(job, train)  # before reading data
    config = search.base
    schema = run.data.train_schema(train, features.schema if features else None)
    stats = ReadStats()
    valid_batches = list(iter_file_batches(valid, schema, config.batch_size,
                                           on_bad_row=config.on_bad_row, stats=stats))
    why = sharing_refusal(config.store, config.sparse_optimizer)
    if why is not None and ctx.is_main:
        print(f"search: each trial keeps its own key index ({why})", file=sys.stderr)
    # Joined copies are named in checkpoints by the raw files, so a continued trial reads
    # on from its positions (the copies are made again in another temporary folder).
    inputs = keyed_copies(run.train or [], train) \
        if features is not None and features.tables.tables else train
    # The directory's lock is held through the refit and the results: a second search
    # (--resume) started while the refit ran rewrote best/ beside it.
    with search_directory_lock(out, ctx):
        result = run_search(search, schema, inputs, valid_batches, out, ctx=ctx,
                            locked=True)
        if result.best_dir is not None and features is not None and ctx.is_main:
            install_features(result.best_dir, features)  # eval / predict / serve join them
        ctx.barrier()
        # rank 0's reading of best/ decides for every rank (one refit, run by all)
        redo = ctx.broadcast_object(result.best_dir is not None and _refit(run, train)
                                    and not (ctx.is_main
                                             and _refit_done(result.best_dir, result.best)))
        if redo and result.best_dir is not None:
            refit_best(result.best_dir, dataclasses.replace(run, train=train, valid=valid),
                       ctx)
        if ctx.is_main:
            write_results(result, out)
            write_search_report(result, out)
    is_main, world = ctx.is_main, ctx.world
    ctx.close()
    return SearchOutcome(
        best=Model(result.best_dir) if result.best_dir is not None else None,
        best_params=result.best_params, best_value=result.best_value,
        trials=result.rows() if is_main else [], result=result, stats=stats,
        is_main=is_main, world=world)


def search_config(job: SearchJob, train: Sequence[str | Path]) -> SearchConfig:
    """The search ``job`` asks for. The trials' base is what ``train`` would run on
    ``train``: data-sized defaults (the files are read for their size)."""
    from terarec.train.defaults import (
        ACCUMULATOR_KEY,
        BUCKET_L2_KEY,
        DENSE_LR_KEY,
        FIRST_ORDER_MODEL,
        FIRST_ORDER_STARTS,
        MODEL_KEY,
        accumulator_choices,
        apply_sized_defaults,
        bucket_l2_choices,
        estimate_rows,
        first_order_choices,
        model_choices,
    )
    from terarec.train.search.config import SearchConfig
    from terarec.train.search.samplers import first_rung
    from terarec.train.search.space import (
        LR_SPAN,
        base_params,
        check_space,
        default_space,
        load_space,
    )

    run = job.run
    config, sized = apply_sized_defaults(run.config, train, run.given)
    if config.store.memory_budget is not None:
        parse_bytes(config.store.memory_budget)
    selection_for(dataclasses.replace(run, train=list(map(Path, train))), config)  # epochs
    fixed: list[dict] = []
    if isinstance(job.space, str | os.PathLike):
        space = load_space(job.space, config)
    elif job.space is not None:
        space = check_space(dict(job.space), config, "space")
    else:
        # Where ``train`` would choose Adagrad's start, the bucket prior and the model by
        # validation, so do the trials; the first trials are what ``train`` runs (each
        # start, with and without the prior, each with DeepFM and then ``lr`` at its own
        # dense rate; on larger data DeepFM, then lr at each start), so the search
        # answers at least what ``train`` would on the validation rows when it has
        # trials enough.
        space = default_space(config.model.name, config)
        starts = accumulator_choices(sized)  # set only for adagrad
        # (whether the numeric fields get buckets is the training rows' to say)
        strengths = bucket_l2_choices(starts, run.given, run.data.train_schema(train)) \
            if starts is not None and run.data.schema().numeric else None
        models = model_choices(starts, run.given, config.model.name,
                               int(sized.get("estimated_rows", 0)))
        # on larger data, the first trials are train's race of DeepFM against lr's starts
        first = first_order_choices(sized, run.given, config) \
            if config.store.memory_budget is None else None
        chosen = {ACCUMULATOR_KEY: starts, BUCKET_L2_KEY: strengths}
        if first is not None:  # the model and its rate per member, as small data's race
            rate = next(float(m[DENSE_LR_KEY]) for m in first.values() if m)
            models = {config.model.name: {DENSE_LR_KEY: config.dense_optimizer.lr},
                      FIRST_ORDER_MODEL: {DENSE_LR_KEY: rate}}
            chosen[ACCUMULATOR_KEY] = (config.sparse_optimizer.initial_accumulator,
                                       *FIRST_ORDER_STARTS)
        for key, values in chosen.items():
            if values is not None:
                space[key] = {"type": "categorical", "choices": list(dict.fromkeys(values))}
        if models is not None:
            space[MODEL_KEY] = {"type": "categorical", "choices": list(models)}
            rates = [rate for values in models.values() for rate in values.values()]
            dense = space[DENSE_LR_KEY]  # every model's own rate inside the range
            dense.update(low=min(rates) / LR_SPAN, high=max(rates) * LR_SPAN)
        own = base_params(space, config)
        if own is not None:
            fixed = [own]
            if first is not None:  # train's race: its members, in its order
                fixed = [{**own, **member} for member in first.values()]
            else:  # each start, with and without the prior, then each model
                for key, values in chosen.items():
                    if values is not None:
                        fixed = [{**params, key: v} for v in values for params in fixed]
                if models is not None:
                    fixed = [{**params, MODEL_KEY: m, **models[m]}
                             for params in fixed for m in models]
            fixed = fixed[:job.trials]
    rung = job.prune_after if job.prune_after is not None \
        else first_rung(estimate_rows(train), config)
    return SearchConfig(base=config, space=space, trials=job.trials,
                        parallel=job.parallel, sampler=job.sampler,  # type: ignore[arg-type]
                        pruner=job.pruner,  # type: ignore[arg-type]
                        first_rung=rung, select_by=run.select_by,  # type: ignore[arg-type]
                        patience=run.patience, rows=estimate_rows(train),
                        seed=config.seed, fixed=tuple(fixed),
                        unpruned=len(fixed),  # train's own runs, never pruned
                        checkpoint_every=run.checkpoint_every, resume=run.resume,
                        progress=run.progress)


def _refit(run: TrainJob, train: list[Path]) -> bool:
    from terarec.train.defaults import estimate_rows, refit_by_default

    if run.refit is not None:
        return bool(run.refit)
    return refit_by_default(estimate_rows(train))


def _refit_done(best_dir: Path, best: Any) -> bool:
    """Whether ``best_dir`` holds the refit of the best trial already: a resumed search
    that had finished keeps its ``best/`` (the trials' checkpoints are gone), and a
    second refit of it trained the same model again."""
    metrics_file = best_dir / "metrics.json"
    if best is None or not metrics_file.exists():
        return False
    metrics = json.loads(metrics_file.read_text())
    return bool(metrics.get("refit")) and metrics.get("trial") == best.number


def refit_best(best_dir: Path, run: TrainJob, ctx: DistContext) -> None:
    """``train``'s refit for the best trial (``best_dir``): a fresh model of its
    configuration on train + valid for its selected epoch count becomes ``BEST``;
    metrics.json says so under ``refit``."""
    from terarec.io import atomic_write_text, finite_json
    from terarec.modeldir import read_model_meta
    from terarec.train.run import TrainRun, refit_model

    metrics = json.loads((best_dir / "metrics.json").read_text())
    history = json.loads((best_dir / "history.json").read_text())
    schema, config = read_model_meta(best_dir)
    train_run = TrainRun(train=list(run.train or []), valid=list(run.valid), out=best_dir,
                         progress=run.progress)
    refit, model = refit_model(train_run, schema, config, history,
                               metrics.get("best_pass"), ctx)
    if model is not None:
        model.store.close()
    metrics["refit"] = refit
    if refit.get("checkpoint"):
        metrics.update(selected_checkpoint=metrics.get("checkpoint"),
                       checkpoint=refit["checkpoint"])
    if ctx.is_main:
        atomic_write_text(best_dir / "metrics.json", finite_json(metrics, indent=2))


def search(train: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
           valid: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
           out: str | os.PathLike[str], trials: int = 8, space: Any = None,
           parallel: int | None = None, sampler: str = "tpe", pruner: str = "halving",
           prune_after: int | None = None, config: TrainConfig | None = None,
           resume: bool = False, refit: bool | None = None, select_by: str = "logloss",
           patience: int | None = None, features: str | os.PathLike[str] | None = None,
           checkpoint_every: int = 1, progress: bool = True,
           **settings: Any) -> SearchOutcome:
    """Search ``trials`` configurations of one ``fit`` run together (one pass loop, one
    shared key index), suggested by optuna's ``sampler`` and pruned at pass boundaries
    by ``pruner``; the best trial is written to ``out/best`` and returned as a ``Model``
    (refit on train + valid below 100,000 rows, as ``fit`` does). ``space``: a JSON
    file or a mapping ``{"dotted.config.path": {"type": "float", "low": ...,
    "high": ..., "log": true} | [choices]}``; None searches the model's default space.
    Other settings are ``fit``'s."""
    from terarec.api.fit import job_settings

    job = SearchJob(
        run=job_settings(train, valid, out=out, config=config, resume=resume, refit=refit,
                         select_by=select_by, patience=patience, eval_every=None,
                         features=features, export=None, export_to=None, dense_comm=None,
                         checkpoint_every=checkpoint_every, progress=progress,
                         settings=settings),
        trials=trials, parallel=parallel, sampler=sampler, pruner=pruner,
        prune_after=prune_after,
        space=Path(space) if isinstance(space, str | os.PathLike) else space)
    return run_search_job(job)
