"""Nothing non-finite gets in (input rows) or out (checkpoints, exports, scores)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from terarec.cli.main import main
from terarec.config import ModelConfig, SparseOptimizerConfig, TrainConfig
from terarec.data.readers import DataError, ReadStats, csv_schema, iter_batches
from terarec.data.synth import generate
from terarec.export.writer import ModelExporter
from terarec.finite import NonFiniteError, check_finite, check_finite_loss, check_scores
from terarec.modeldir import list_checkpoints, save_checkpoint
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema

SCHEMA = csv_schema("y", ["x"], ["c"])


def _csv(path: Path, xs: list[str]) -> Path:
    path.write_text("y,x,c\n" + "".join(f"{i % 2},{x},k{i % 3}\n" for i, x in enumerate(xs)))
    return path


@pytest.mark.parametrize("value, problem", [
    ("1e39", "outside the float32 range"), ("-3.5e38", "outside the float32 range"),
    ("inf", "not a finite number"), ("nan", "not a finite number"),
    # Python's float() takes these; the reader does not, and must not call them out of range
    ("1_000", "not a finite number"), (" 3", "not a number (it has spaces around it)")])
def test_overflowing_or_non_finite_value_names_file_line_field(tmp_path: Path, value: str,
                                                               problem: str) -> None:
    path = _csv(tmp_path / "a.csv", ["1", "2", value, "4"])
    with pytest.raises(DataError) as err:
        list(iter_batches(path, SCHEMA, 2))
    message = str(err.value)
    assert message.startswith(f"{path}: line 4: field 'x': {problem}")
    assert message.endswith(f"got '{value}'")


def test_overflowing_rows_are_skipped_and_counted(tmp_path: Path) -> None:
    path = _csv(tmp_path / "a.csv", ["1", "1e39", "3.4e38", "-1e300", "5"])
    stats = ReadStats()
    batches = list(iter_batches(path, SCHEMA, 10, on_bad_row="skip", stats=stats))
    assert stats.skipped == 2 and "line 3" in stats.examples[0]
    dense = torch.cat([b.dense for b in batches])
    assert torch.isfinite(dense).all() and len(dense) == 3  # 3.4e38 fits in float32


def test_check_finite_names_the_bad_tensors() -> None:
    check_finite({"a": torch.ones(3), "keys": np.arange(3)}, "x")
    with pytest.raises(NonFiniteError, match=r"ckpt: .*b \(2 entries\)"):
        check_finite({"a": torch.ones(3), "b": torch.tensor([1.0, np.nan, np.inf])}, "ckpt")
    with pytest.raises(NonFiniteError):
        check_scores(np.array([0.5, np.nan]))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("finite") / "train.tsv"
    generate(path, 3000, model_seed=1, sample_seed=2, vocab_scale=0.01)
    return path


def _trainer(data: Path) -> Trainer:
    config = TrainConfig(batch_size=500, pass_rows=1500, threads=1,
                         model=ModelConfig(name="deepfm", embedding_dim=4, deep_mlp=(8,)))
    trainer = Trainer(FeatureSchema.criteo(), config)
    trainer.fit([data], progress=False)
    return trainer


def test_poisoned_weights_never_replace_a_checkpoint(tmp_path: Path, data: Path) -> None:
    trainer = _trainer(data)
    good = save_checkpoint(tmp_path, trainer)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    trainer.pass_id += 1
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float("nan"))
    with pytest.raises(NonFiniteError, match="dense weights"):
        save_checkpoint(tmp_path, trainer)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    assert (tmp_path / "LATEST").read_text() == good.name


def test_poisoned_embedding_rows_are_refused(tmp_path: Path, data: Path) -> None:
    trainer = _trainer(data)
    _, slots = trainer.store.index.items()
    trainer.store.values[slots[0], 0] = np.inf
    with pytest.raises(NonFiniteError, match="embedding rows"):
        save_checkpoint(tmp_path, trainer)
    assert not list_checkpoints(tmp_path)


def test_a_stale_row_in_a_freed_slot_does_not_refuse_the_checkpoint(tmp_path: Path,
                                                                    data: Path) -> None:
    """The quick check reads every slot handed out; a NaN left in a slot whose key was
    evicted is not the model's, so the live rows decide."""
    trainer = _trainer(data)
    keys, slots = trainer.store.index.items()
    assert trainer.store.evict(keys[:1]) == 1
    trainer.store.values[slots[0], 0] = np.nan  # the freed slot
    assert save_checkpoint(tmp_path, trainer).name == list_checkpoints(tmp_path)[0].name


def test_export_refuses_non_finite_weights(tmp_path: Path) -> None:
    exporter = ModelExporter(tmp_path / "export")
    keys = np.arange(1, 4, dtype=np.int64)
    values = np.ones((3, 2), np.float32)
    with pytest.raises(NonFiniteError, match=r"dense weights: .*w \(1 entries\)"):
        exporter.write_full(schema=FeatureSchema.criteo(), model_config=ModelConfig(),
                            dense={"w": torch.tensor([1.0, np.nan])}, keys=keys,
                            values=values, pass_id=1)
    values[1, 1] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        exporter.write_full(schema=FeatureSchema.criteo(), model_config=ModelConfig(),
                            dense={"w": torch.ones(2)}, keys=keys, values=values, pass_id=1)
    assert not (tmp_path / "export" / "LATEST").exists()


def test_nan_learning_rate_cannot_write_a_checkpoint(tmp_path: Path, data: Path,
                                                     capsys) -> None:
    out = tmp_path / "model"
    code = main(["train", "--train", str(data), "--out", str(out), "--no-progress",
                 "--threads", "1", "--embedding-dim", "4", "--sparse-lr", "nan"])
    assert code == 2 and "--sparse-lr" in capsys.readouterr().err
    # A config built in code is not validated: the checkpoint guard still holds.
    config = TrainConfig(batch_size=500, pass_rows=1500, threads=1,
                         model=ModelConfig(name="deepfm", embedding_dim=4, deep_mlp=(8,)),
                         sparse_optimizer=SparseOptimizerConfig(lr=float("nan")))
    trainer = Trainer(FeatureSchema.criteo(), config)
    history = trainer.fit([data], progress=False)
    assert not np.isfinite(history[-1]["train_loss"])
    with pytest.raises(NonFiniteError, match="not finite"):
        save_checkpoint(out, trainer)
    assert not list_checkpoints(out)
    with pytest.raises(NonFiniteError, match="training loss is nan"):
        check_finite_loss(history[-1]["train_loss"], "pass 2")


def test_overflowing_finite_weights_stop_scoring(tmp_path: Path, data: Path, capsys) -> None:
    """Learning rates far too high leave finite weights whose forward pass overflows:
    scoring (validation in training, eval, predict) stops naming the cause instead of
    writing NaN metrics or 'nan' scores (it did)."""
    config = TrainConfig(batch_size=500, pass_rows=1500, threads=1,
                         model=ModelConfig(name="deepfm", embedding_dim=4, deep_mlp=(8,)),
                         sparse_optimizer=SparseOptimizerConfig(lr=1e30))
    trainer = Trainer(FeatureSchema.criteo(), config)  # built in code: not bounded
    trainer.fit([data], progress=False)
    with pytest.raises(NonFiniteError, match="scores are not finite.*lower the learning"):
        trainer.evaluate(iter_batches(data, FeatureSchema.criteo(), 500))
    model = tmp_path / "model"
    assert main(["train", "--train", str(data), "--out", str(model), "--no-progress",
                 "--threads", "1", "--embedding-dim", "4", "--valid-split", "0"]) == 0
    trainer = Trainer.from_checkpoint(model)  # (no BEST: readers take the newest below)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.mul_(1e30)  # finite (float32 holds 3.4e38), overflowing once multiplied
    trainer.pass_id += 1
    save_checkpoint(model, trainer)  # the weights are finite: the checkpoint guard passes
    capsys.readouterr()
    scores = tmp_path / "scores.txt"
    assert main(["predict", "--model", str(model), "--data", str(data), "--out",
                 str(scores)]) == 2
    assert "scores are not finite" in capsys.readouterr().err and not scores.exists()
    assert main(["eval", "--model", str(model), "--data", str(data), "--out",
                 str(tmp_path / "m.json")]) == 2
    assert "scores are not finite" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def test_pruning_keeps_the_pinned_checkpoint(tmp_path: Path, data: Path) -> None:
    """Older checkpoints go but the one named ``pinned`` (a search's last commit that
    every trial of its wave holds) stays, as ``BEST`` would."""
    trainer = _trainer(data)
    names = []
    for _ in range(4):
        trainer.pass_id += 1
        names.append(save_checkpoint(tmp_path, trainer,
                                     pinned=names[0] if names else None).name)
    kept = sorted(c.name for c in list_checkpoints(tmp_path))
    assert kept == sorted([names[0], *names[-2:]])
