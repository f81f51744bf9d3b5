"""The pass loop: stage a pass's working set, train its batches, write rows back.

::

    for each pass (N rows, read ahead in a thread):
        ws = WorkingSet.stage(store, batches)      unique keys -> store.pull -> device tensor
        for batch in ws.batches:                   plain lookups over ws.weights
            loss.backward()                        sparse optimizer runs inside backward
            dense_optimizer.step()
        ws.write_back(store); store.end_pass()     rows + optimizer state back, eviction
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from terarec.config import TrainConfig
from terarec.embedding.index import unique_inverse
from terarec.embedding.optimizers import SparseOptimizer
from terarec.embedding.protocol import EmbeddingStore
from terarec.embedding.store import MemoryStore
from terarec.embedding.tiered import TieredStore
from terarec.embedding.working_set import PassPlan, WorkingSet, plan_pass
from terarec.models import build_model
from terarec.train.metrics import evaluate_scores
from terarec.train.passes import group_passes, iter_file_batches
from terarec.train.selection import SelectionTracker
from terarec.types import Batch, FeatureSchema


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class PassResult:
    pass_id: int
    rows: int
    train_loss: float
    staging_s: float
    train_s: float
    write_back_s: float
    samples_per_s: float
    unique_keys: int
    admitted_keys: int
    evicted_keys: int
    store_keys: int
    prefetch_wait_s: float = 0.0  # time the pass waited for the next pass's disk reads

    def as_dict(self) -> dict:
        return asdict(self)


class Trainer:
    """Owns the model, the store and the optimizers; trains pass by pass."""

    def __init__(self, schema: FeatureSchema, config: TrainConfig,
                 store: EmbeddingStore | None = None) -> None:
        self.schema = schema
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        np.random.seed(config.seed)
        self.device = resolve_device(config.device)
        self.model = build_model(schema, config.model).to(self.device)
        self.sparse_optimizer = SparseOptimizer(config.sparse_optimizer)
        self.store = store if store is not None else make_store(
            self.model.row_dim, self.sparse_optimizer, config)
        self.dense_optimizer = _dense_optimizer(self.model, config)
        # The fused lookup's backward needs a graph input that requires grad.
        self._anchor = torch.zeros((), requires_grad=True, device=self.device)
        mean = [f.pooling == "mean" for f in schema.categorical]
        self.mean_fields = torch.tensor(mean, device=self.device) if any(mean) else None
        self.pass_id = 0
        self.history: list[dict] = []
        self.stop_reason: str | None = None  # why the last ``fit`` ended

    # -- one step / one pass ------------------------------------------------------------
    def _logits(self, ws: WorkingSet, batch: Batch, train: bool) -> torch.Tensor:
        emb = ws.lookup(batch.sparse, self.mean_fields, self._anchor if train else None)
        return self.model(batch.dense, emb)

    def train_pass(self, batches: list[Batch] | PassPlan, progress: tqdm | None = None,
                   upcoming: list[Batch] | PassPlan | None = None) -> PassResult:
        """Stage, train and write back one pass; returns its figures. A ``PassPlan`` made
        ahead (``plan_pass``, e.g. in the read-ahead thread) takes the key work off the
        critical path.

        ``upcoming``: the next pass, whose rows a store with a disk tier reads into RAM in
        a thread while this pass trains.
        """
        self.model.train()
        t0 = time.perf_counter()
        ws = WorkingSet.stage(self.store, batches, self.pass_id, self.device, train=True)
        batches = ws.batches
        prefetcher = _start_prefetch(self.store, upcoming)
        t1 = time.perf_counter()
        losses = []
        for batch in ws.batches:
            logits = self._logits(ws, batch, train=True)
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            self.dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.dense_optimizer.step()
            losses.append(loss.detach())
            if progress is not None:
                progress.update(len(batch))
        t2 = time.perf_counter()
        wait_s, evicted = self._close_pass(ws, prefetcher)
        t3 = time.perf_counter()
        rows = sum(len(b) for b in batches)
        weights = torch.tensor([len(b) for b in batches], dtype=torch.float32)
        mean_loss = float((torch.stack(losses).cpu() * weights).sum() / weights.sum())
        result = PassResult(
            pass_id=self.pass_id, rows=rows, train_loss=mean_loss, staging_s=t1 - t0,
            train_s=t2 - t1, write_back_s=t3 - t2, samples_per_s=rows / (t3 - t0),
            unique_keys=ws.stats.unique_keys, admitted_keys=ws.stats.admitted_keys,
            evicted_keys=evicted, store_keys=len(self.store), prefetch_wait_s=wait_s)
        self.pass_id += 1
        return result

    def _close_pass(self, ws, prefetcher: _Prefetcher | None) -> tuple[float, int]:
        """Wait for the next pass's read-ahead (the store is the pass's own again before
        write-back), write the pass's rows back and apply eviction: (wait s, evicted)."""
        start = time.perf_counter()
        if prefetcher is not None:
            prefetcher.join()
        wait_s = time.perf_counter() - start
        ws.write_back(self.store)
        return wait_s, self.store.end_pass(self.pass_id)

    @torch.no_grad()
    def predict_batches(self, batches: list[Batch] | PassPlan) -> np.ndarray:
        """Click probabilities for in-memory batches (global keys); the store is unchanged."""
        self.model.eval()
        if not batches:
            return np.empty(0, np.float32)
        ws = WorkingSet.stage(self.store, batches, self.pass_id, self.device, train=False)
        out = [torch.sigmoid(self._logits(ws, b, train=False)).cpu() for b in ws.batches]
        return torch.cat(out).numpy()

    def predict_stream(self, batches: Iterable[Batch] | list[PassPlan]
                       ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(probabilities, labels) chunk by chunk, one pass's worth of rows at a time.
        ``batches`` may be pass plans made once (``plan_pass(..., counts=False)``) for a
        set scored again and again, e.g. a validation set by every trial of a search."""
        if isinstance(batches, list) and batches and isinstance(batches[0], PassPlan):
            groups: Iterable = batches
        else:
            groups = group_passes(batches, self.config.pass_rows)
        for group in groups:
            rows = group.batches if isinstance(group, PassPlan) else group
            labels = torch.cat([b.labels for b in rows]).numpy()
            yield self.predict_batches(group), labels

    def evaluate(self, batches: Iterable[Batch] | list[PassPlan]) -> dict[str, float]:
        """AUC, logloss, rows and scoring samples/s (reading included) over ``batches``."""
        probs, labels = [], []
        start = time.perf_counter()
        for p, y in self.predict_stream(batches):
            probs.append(p)
            labels.append(y)
        seconds = time.perf_counter() - start
        all_labels, all_probs = self._all_scores(
            np.concatenate(labels) if labels else np.empty(0, np.float32),
            np.concatenate(probs) if probs else np.empty(0, np.float32))
        if not len(all_labels):
            raise ValueError("no rows to evaluate")
        metrics = evaluate_scores(all_labels, all_probs)
        metrics["rows"] = int(len(all_labels))
        metrics["samples_per_s"] = metrics["rows"] / seconds if seconds > 0 else 0.0
        return metrics

    def _all_scores(self, labels: np.ndarray,
                    probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The (labels, probabilities) metrics are computed over: here, this process's."""
        return labels, probs

    # -- whole runs ---------------------------------------------------------------------
    def iter_passes(self, train_paths: list[str | Path], stats=None, first: int = 0,
                    skip: int = 0) -> Iterator[list[Batch] | PassPlan]:
        """The passes ``fit`` trains, numbered from ``first``; runs in the read-ahead thread
        (a sharded trainer reads only its rank's share here)."""
        cfg = self.config
        batches = iter_file_batches(train_paths, self.schema, cfg.batch_size,
                                    on_bad_row=cfg.on_bad_row, stats=stats)
        return _plans(group_passes(batches, cfg.pass_rows), first, skip)

    def fit(self, train_paths: list[str | Path], valid_batches: list[Batch] | None = None,
            *, progress: bool = True, stats=None, on_pass_end=None,
            skip_passes: int = 0, selection: SelectionTracker | None = None) -> list[dict]:
        """Train up to ``config.epochs`` epochs over ``train_paths`` pass by pass; after
        each pass, score ``valid_batches`` (if any) and append a history record. With a
        ``selection`` tracker, records say which pass was ``best`` and training stops when
        its patience runs out; ``stop_reason`` says why training ended.

        ``skip_passes``: passes already trained (a resumed run): they are read, not trained,
        so the run continues with exactly the batches an uninterrupted run would see.
        This is the K = 1 case of ``train.loop.run_passes``.
        """
        from terarec.train.loop import TrialRun, run_passes

        run = TrialRun(self, selection, on_pass_end)
        run_passes([run], train_paths, valid_batches, progress=progress, stats=stats,
                   skip_passes=skip_passes)
        self.stop_reason = run.stop_reason
        return self.history


def _plans(groups: Iterator[list[Batch]], first: int, skip: int) -> Iterator:
    """Plan each pass numbered ``first``, ``first + 1``, ...; passes below ``skip`` (already
    trained, when resuming) pass through unplanned."""
    for number, group in enumerate(groups, first):
        yield plan_pass(group) if number >= skip else group


def make_store(row_dim: int, optimizer: SparseOptimizer,
               config: TrainConfig) -> EmbeddingStore:
    """The tiered store when a memory budget or a disk path is configured, else all in RAM."""
    if config.store.tiered:
        return TieredStore(row_dim, optimizer, config.store, seed=config.seed)
    return MemoryStore(row_dim, optimizer, config.store, seed=config.seed)


def _with_next(items: Iterator) -> Iterator[tuple]:
    """Each pass with the one after it (None for the last): the read-ahead pass is what
    the store prefetches while the current one trains."""
    current = next(items, None)
    while current is not None:
        following = next(items, None)
        yield current, following
        current = following


class _Prefetcher(threading.Thread):
    """Reads the next pass's rows from the disk tier; errors re-raised on join."""

    def __init__(self, store: EmbeddingStore, upcoming: list[Batch] | PassPlan | np.ndarray
                 ) -> None:
        super().__init__(name="terarec-store-prefetch", daemon=True)
        self.store, self.upcoming, self.error = store, upcoming, None

    def run(self) -> None:
        try:
            if isinstance(self.upcoming, np.ndarray):  # the keys themselves
                keys = self.upcoming
            elif isinstance(self.upcoming, PassPlan):
                keys = self.upcoming.keys
            else:
                keys, _ = unique_inverse(np.concatenate([b.sparse.values.numpy()
                                                         for b in self.upcoming]))
            self.store.prefetch(keys)
        except BaseException as exc:  # handed to the trainer thread
            self.error = exc

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


def _start_prefetch(store: EmbeddingStore, upcoming: list[Batch] | PassPlan | np.ndarray | None
                    ) -> _Prefetcher | None:
    """Start reading ``upcoming``'s rows (a pass, its plan, or its keys) into RAM, where
    the store has a disk tier to read them from."""
    if upcoming is None or not store.prefetches:
        return None
    if isinstance(upcoming, (list, np.ndarray)) and len(upcoming) == 0:
        return None
    thread = _Prefetcher(store, upcoming)
    thread.start()
    return thread


def _dense_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    c = config.dense_optimizer
    params = list(model.parameters())
    if c.name == "adam":
        return torch.optim.Adam(params, lr=c.lr, weight_decay=c.weight_decay)
    if c.name == "adagrad":
        return torch.optim.Adagrad(params, lr=c.lr, weight_decay=c.weight_decay)
    if c.name == "sgd":
        return torch.optim.SGD(params, lr=c.lr, weight_decay=c.weight_decay)
    raise ValueError(f"unknown dense optimizer {c.name!r}; known: adam, adagrad, sgd")
