"""The read-ahead of passes: below the training thread's priority, and a pass that does
not use the next one does not wait for it."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from terarec.config import StoreConfig, TrainConfig
from terarec.data.synth import generate
from terarec.train.passes import READ_AHEAD_NICE, prefetch
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are Linux's")
def test_read_ahead_thread_runs_below_its_consumer():
    def items():
        yield _nice()

    mine = _nice()
    (theirs,) = list(prefetch(items()))
    assert theirs == min(mine + READ_AHEAD_NICE, 19)
    assert _nice() == mine  # the consumer keeps its own


def test_memory_store_trains_a_pass_before_the_next_is_read(tmp_path):
    generate(tmp_path / "train.txt", 3000, sample_seed=1)
    config = TrainConfig(batch_size=256, pass_rows=1024, threads=1, seed=0)
    trainer = Trainer(FeatureSchema.criteo(), config)
    assert not trainer.reads_ahead  # nothing of the next pass to read into RAM
    training = threading.Event()
    real_iter, real_train = trainer.iter_passes, trainer.train_pass

    def iter_passes(*args, **kwargs):
        for number, item in enumerate(real_iter(*args, **kwargs)):
            if number == 1:  # the read-ahead thread: pass 1 only once pass 0 trains
                assert training.wait(20), "pass 0 waited for pass 1 to be read"
            yield item

    def train_pass(*args, **kwargs):
        training.set()
        return real_train(*args, **kwargs)

    trainer.iter_passes = iter_passes  # type: ignore[method-assign]
    trainer.train_pass = train_pass  # type: ignore[method-assign]
    history = trainer.fit([tmp_path / "train.txt"], progress=False)
    assert [h["rows"] for h in history] == [1024, 1024, 952]


def test_tiered_store_reads_the_next_pass_ahead(tmp_path):
    config = TrainConfig(batch_size=256, pass_rows=1024, threads=1, seed=0,
                         store=StoreConfig(memory_budget="1MB",
                                           disk_path=str(tmp_path / "store")))
    assert Trainer(FeatureSchema.criteo(), config).reads_ahead
