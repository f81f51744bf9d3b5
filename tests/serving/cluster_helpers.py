"""A small model exported as a chain (full, deltas, full again) for the sparse-tier tests,
with the trainer's own predictions recorded for every version."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from serving_helpers import SCHEMA, make_data, raw_records, small_config

from terarec.data.readers import batch_from_records
from terarec.export import IncrementalExporter
from terarec.modeldir import save_checkpoint
from terarec.serving.engine import ServingEngine
from terarec.train.trainer import Trainer

ROWS = 3000
SCORED_ROWS = 48


@dataclass
class ChainRun:
    export: Path
    model_dir: Path
    rows_file: Path
    records: list[dict]
    # version number -> the trainer's predictions of ``records`` when it was exported
    trainer_scores: dict[int, np.ndarray] = field(default_factory=dict)


def train_chain(root: Path) -> ChainRun:
    """v000001 full, v000002-v000003 deltas (with evictions), v000004 full again."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = make_data(root / "train.tsv", ROWS)
        rows_file = root / "rows.tsv"
        rows_file.write_text("".join(data.read_text().splitlines(keepends=True)[:SCORED_ROWS]))
        records = raw_records(rows_file, SCORED_ROWS)
        run = ChainRun(root / "export", root / "model", rows_file, records)
        trainer = Trainer(SCHEMA, small_config())
        exporter = IncrementalExporter(run.export, trainer, every_passes=1)
        batch = batch_from_records(records, SCHEMA)

        def on_pass_end(t: Trainer, record: dict) -> None:
            result = exporter.on_pass_end(t, record)
            run.trainer_scores[int(result.name[1:])] = t.predict_batches([batch])

        trainer.fit([data], progress=False, on_pass_end=on_pass_end)
        save_checkpoint(run.model_dir, trainer)
        time.sleep(0.01)
        result = exporter.export(trainer, full=True)
        run.trainer_scores[int(result.name[1:])] = trainer.predict_batches([batch])
        return run
    finally:
        torch.set_num_threads(threads)


def local_scores(export: Path, records: list[dict]) -> np.ndarray:
    """What the local (memory-mapped) server scores for ``records``."""
    engine = ServingEngine(export, cache_rows=0)
    try:
        engine.refresh()
        return engine.score_records(records)[0]
    finally:
        engine.close()
