"""Data-sized defaults: the row estimate and what it sets, and what it leaves alone."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from terarec.cli.common import add_train_args, config_from_args, explicit_config_keys
from terarec.config import TrainConfig
from terarec.models.registry import build_model
from terarec.train.defaults import (
    apply_sized_defaults,
    estimate_rows,
    sized_admission,
    sized_defaults,
    sized_embedding_dim,
    sized_initial_accumulator,
)
from terarec.types import FeatureSchema


def test_row_estimate_of_small_and_large_text_files(tmp_path: Path) -> None:
    small = tmp_path / "small.csv"
    small.write_text("y,x\n" + "".join(f"{i % 2},{i}\n" for i in range(999)))
    assert estimate_rows([small]) == 1000  # header included: within one row
    big = tmp_path / "big.tsv"
    big.write_text("".join(f"{i % 2}\t{i:08d}\n" for i in range(300_000)))
    assert abs(estimate_rows([big, small]) - 301_000) < 3_000
    assert estimate_rows([tmp_path / "missing.csv"]) is None


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".zst", ".lz4"])
def test_row_estimate_of_compressed_text_files(tmp_path: Path, suffix: str) -> None:
    """A compressed file was sized by the newlines of its compressed bytes: a 10,000-row
    .gz file came out about 1,200 rows (small-data defaults on large files)."""
    import pyarrow as pa

    rng = np.random.default_rng(0)
    text = "".join(f"{i % 2},{v:016x},{w}\n" for i, (v, w) in enumerate(zip(
        rng.integers(0, 2**62, 200_000), rng.integers(0, 50, 200_000), strict=True)))
    codec = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}[suffix]
    for rows in (200_000, 300):
        path = tmp_path / f"rows-{rows}.csv{suffix}"
        with pa.OSFile(str(path), "wb") as raw, pa.CompressedOutputStream(raw, codec) as out:
            out.write("".join(text.splitlines(keepends=True)[:rows]).encode())
        estimate = estimate_rows([path])
        assert estimate is not None and abs(estimate - rows) <= 0.15 * rows
    assert estimate == 300  # read whole: exact
    broken = tmp_path / f"broken.csv{suffix}"
    broken.write_bytes(b"not compressed\n" * 100)
    assert estimate_rows([broken]) is None


@pytest.mark.parametrize("rows, batch, epochs", [
    (1_000, 256, 2), (8_000, 256, 2), (32_768, 1024, 2), (100_000, 4096, 1),
    (10**10, 4096, 1)])
def test_sized_values(rows: int, batch: int, epochs: int) -> None:
    sized = sized_defaults(rows)
    assert sized["batch_size"] == batch and sized["epochs"] == epochs
    base = TrainConfig()
    scale = (batch / 4096) ** 0.5
    assert sized["sparse_optimizer.lr"] == pytest.approx(base.sparse_optimizer.lr * scale)
    assert sized["dense_optimizer.lr"] == pytest.approx(base.dense_optimizer.lr * scale)


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    return parser.parse_args(argv)


def test_sized_only_when_none_of_the_four_is_given(tmp_path: Path) -> None:
    data = tmp_path / "d.csv"
    data.write_text("y,x\n" + "".join(f"{i % 2},{i}\n" for i in range(5000)))
    config, sized = apply_sized_defaults(config_from_args(_args(["--seed", "3"])), [data],
                                         explicit_config_keys(_args(["--seed", "3"])))
    assert (config.batch_size, config.epochs) == (256, 2) and config.seed == 3
    assert config.sparse_optimizer.lr == pytest.approx(0.0125)
    assert sized["estimated_rows"] == 5001 and sized["batch_size"] == 256
    assert config.store.admit_min_count == 2 and sized["store.admit_min_count"] == 2
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"dense_optimizer": {"lr": 0.01}}))
    for argv in (["--batch-size", "100"], ["--config", str(cfg)]):
        args = _args(argv)
        explicit = explicit_config_keys(args)
        config, sized = apply_sized_defaults(config_from_args(args), [data], explicit)
        assert set(sized) <= {"estimated_rows", "store.admit_min_count", "model.embedding_dim"}
        assert config.epochs == 1 and config.sparse_optimizer.lr == 0.05
        assert config.store.admit_min_count == 2  # admission is sized on its own
    assert explicit == {"dense_optimizer.lr"}
    args = _args(["--admit-min-count", "1"])
    config, sized = apply_sized_defaults(config_from_args(args), [data],
                                         explicit_config_keys(args))
    assert config.store.admit_min_count == 1 and "store.admit_min_count" not in sized
    assert config.batch_size == 256  # the schedule is still sized


def test_admission_sized_only_on_small_data() -> None:
    assert sized_admission(8_000) == 2
    assert sized_admission(10**9) == TrainConfig().store.admit_min_count == 1


def test_adagrad_accumulator_starts_at_zero_only_on_small_data(tmp_path: Path) -> None:
    """Large data keeps the fixed start (keys seen once move in proportion to their
    gradient); small data starts at 0 with its sized rates, unless the user set the
    value, the schedule, or another optimizer that reads none."""
    assert sized_initial_accumulator(8_000) == 0.0
    assert sized_initial_accumulator(10**9) == TrainConfig().sparse_optimizer.initial_accumulator
    assert TrainConfig().sparse_optimizer.initial_accumulator > 0
    data = tmp_path / "d.csv"
    data.write_text("y,x\n" + "".join(f"{i % 2},{i}\n" for i in range(5000)))

    def sized(argv: list[str]) -> tuple[TrainConfig, dict]:
        args = _args(argv)
        return apply_sized_defaults(config_from_args(args), [data], explicit_config_keys(args))

    config, chosen = sized([])
    assert config.sparse_optimizer.initial_accumulator == 0.0
    assert chosen["sparse_optimizer.initial_accumulator"] == 0.0
    config, chosen = sized(["--batch-size", "512"])  # the fixed rates: the fixed start
    assert config.sparse_optimizer.initial_accumulator == 0.001
    assert "sparse_optimizer.initial_accumulator" not in chosen
    given = tmp_path / "acc.json"
    given.write_text(json.dumps({"sparse_optimizer": {"initial_accumulator": 0.5}}))
    config, chosen = sized(["--config", str(given)])
    assert config.sparse_optimizer.initial_accumulator == 0.5
    assert "sparse_optimizer.initial_accumulator" not in chosen
    config, chosen = sized(["--sparse-optimizer", "adam"])
    assert "sparse_optimizer.initial_accumulator" not in chosen


def test_epoch_bound_with_validation_leaves_room_for_enough_steps() -> None:
    from terarec.train.defaults import MAX_SELECTED_EPOCHS, MIN_SELECTED_STEPS, max_epochs
    from terarec.train.selection import DEFAULT_MAX_EPOCHS

    assert max_epochs(None, 256) == DEFAULT_MAX_EPOCHS  # unknown size: the fixed bound
    assert max_epochs(10 ** 9, 4096) == DEFAULT_MAX_EPOCHS  # large data: unchanged
    small = max_epochs(20_000, 256)  # 79 steps an epoch
    assert small * 79 >= MIN_SELECTED_STEPS and (small - 1) * 79 < MIN_SELECTED_STEPS
    assert max_epochs(100, 256) == MAX_SELECTED_EPOCHS  # one step an epoch: capped


def test_evaluations_per_epoch_follow_the_pass_cut() -> None:
    from terarec.train.defaults import evaluations_per_epoch

    assert evaluations_per_epoch(None, 4096, 200_000) == 1  # unknown size
    assert evaluations_per_epoch(150_000, 4096, 200_000) == 1
    # passes are whole batches of at least 200,000 rows: 49 * 4096 = 200,704
    assert evaluations_per_epoch(437_500, 4096, 200_000) == 3
    assert evaluations_per_epoch(401_408, 4096, 200_000) == 2
    assert evaluations_per_epoch(8_000, 500, 2_000) == 4


def test_admission_by_probability_is_not_given_a_sized_count(tmp_path: Path) -> None:
    data = tmp_path / "d.csv"
    data.write_text("y,x\n" + "".join(f"{i % 2},{i}\n" for i in range(5000)))
    args = _args(["--admit-probability", "0.5"])
    config, sized = apply_sized_defaults(config_from_args(args), [data],
                                         explicit_config_keys(args))
    assert config.store.admit_min_count == 1 and "store.admit_min_count" not in sized
    assert config.store.admit_probability == 0.5 and config.batch_size == 256


def test_small_data_deep_models_are_narrower_and_their_dense_part_slower(tmp_path: Path
                                                                        ) -> None:
    data = tmp_path / "d.csv"
    data.write_text("y,x\n" + "".join(f"{i % 2},{i}\n" for i in range(5000)))
    sized_lr = TrainConfig().dense_optimizer.lr * (256 / 4096) ** 0.5

    def sized(argv: list[str]) -> tuple[TrainConfig, dict]:
        args = _args(argv)
        return apply_sized_defaults(config_from_args(args), [data], explicit_config_keys(args))

    # deepfm, the default model: the full width, an eighth of the dense rate (its deep
    # part starts at zero and stays near it on few rows)
    config, chosen = sized([])
    assert config.model.embedding_dim == 16 and "model.embedding_dim" not in chosen
    assert config.dense_optimizer.lr == pytest.approx(sized_lr * 0.125)
    wide = ["--model", "widedeep"]
    config, chosen = sized([*wide, "--embedding-dim", "16"])  # a given width is kept
    assert config.model.embedding_dim == 16 and "model.embedding_dim" not in chosen
    assert config.dense_optimizer.lr == pytest.approx(sized_lr * 0.5)
    config, chosen = sized([*wide, "--dense-lr", "0.001"])  # the width is sized on its own
    assert config.model.embedding_dim == 8 and config.dense_optimizer.lr == 0.001
    for model in ("widedeep", "dlrm"):  # measured to gain from it too (docs/models.md)
        config, chosen = sized(["--model", model])
        assert config.model.embedding_dim == 8 and chosen["model.embedding_dim"] == 8
        assert config.dense_optimizer.lr == pytest.approx(sized_lr * 0.5)
    config, _ = sized(["--model", "dlrm"])  # its bottom MLP ends at the sized width
    assert config.model.bottom_mlp == (*TrainConfig().model.bottom_mlp[:-1], 8)
    build_model(FeatureSchema.criteo(), config.model)  # the shapes fit together
    cfg = tmp_path / "dlrm.json"  # a bottom MLP the user gave keeps the width it ends at
    cfg.write_text(json.dumps({"model": {"name": "dlrm", "bottom_mlp": [64, 16]}}))
    config, chosen = sized(["--config", str(cfg)])
    assert config.model.embedding_dim == 16 and config.model.bottom_mlp == (64, 16)
    assert "model.embedding_dim" not in chosen
    for model in ("lr", "fm", "dcnv2"):  # other models: measured at the fixed shape
        config, chosen = sized(["--model", model])
        assert config.model.embedding_dim == TrainConfig().model.embedding_dim
        assert config.dense_optimizer.lr == pytest.approx(sized_lr)
    fixed = TrainConfig().dense_optimizer.lr
    large = sized_defaults(10**9, "deepfm")  # deepfm's eighth holds at every size
    assert large["dense_optimizer.lr"] == pytest.approx(fixed * 0.125)
    assert sized_defaults(10**9, "widedeep")["dense_optimizer.lr"] == fixed
    assert sized_embedding_dim(10**9, "deepfm") == TrainConfig().model.embedding_dim


def test_config_file_without_epochs_keeps_the_validation_epoch_bound(tmp_path: Path) -> None:
    """With --valid the epoch count is an upper bound sized to the data unless the user
    set it: a config file that only reshapes the model does not set it."""
    from terarec.cli.common import add_selection_args, selection_from_args
    from terarec.train.defaults import max_epochs
    from terarec.train.selection import DEFAULT_PATIENCE

    data = tmp_path / "d.csv"
    data.write_text("y,x\n" + "".join(f"{i % 2},{i}\n" for i in range(5000)))
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    add_selection_args(parser)
    parser.add_argument("--train", nargs="+", type=Path)
    parser.add_argument("--valid", nargs="+", type=Path)

    def epochs(argv: list[str]) -> int:
        args = parser.parse_args(["--train", str(data), "--valid", str(data), *argv])
        config, _ = apply_sized_defaults(config_from_args(args), args.train,
                                         explicit_config_keys(args))
        selection_from_args(args, config)
        return config.epochs

    bound = max_epochs(5000, 256) + DEFAULT_PATIENCE
    assert epochs([]) == bound
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps({"model": {"deep_mlp": [64, 32]}}))
    assert epochs(["--config", str(shape)]) == bound
    fixed = tmp_path / "epochs.json"
    fixed.write_text(json.dumps({"epochs": 3}))
    assert epochs(["--config", str(fixed)]) == 3
    assert epochs(["--config", str(shape), "--epochs", "4"]) == 4
