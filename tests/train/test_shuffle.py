"""``--shuffle`` (the default): each pass's batches in a new order every epoch, drawn from
the seed, the epoch and the pass's position, so that runs, resumed runs, N ranks and
search trials of any batch size agree."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from terarec.cli.main import main
from terarec.config import ModelConfig, TrainConfig
from terarec.data.positions import IDLE, FileMark, PassInput, Positions
from terarec.data.readers import csv_schema
from terarec.data.synth import generate
from terarec.distributed.context import DistContext
from terarec.train.passes import in_file_order, shuffled, shuffled_steps
from terarec.train.search.space import check_space
from terarec.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from ranks import run_ranks  # noqa: E402

COMMON = ["--threads", "1", "--no-progress", "--embedding-dim", "4", "--seed", "3",
          "--batch-size", "256", "--pass-rows", "1024",
          "--valid-split", "0",  # every row every epoch: the step order is the point
          "--autocast", "off"]


def _info(epoch: int, rows: int) -> PassInput:
    mark = FileMark(rows=rows, done=False, size=1, sha256="")
    return PassInput(Positions(epoch=epoch, files={"f": mark}))


def _order(seed: int, epoch: int, rows: int, n: int = 12) -> list[int]:
    (group, _), = shuffled_steps(iter([(list(range(n)), _info(epoch, rows))]), seed)
    return group


def test_each_pass_is_a_permutation_drawn_from_seed_epoch_and_position() -> None:
    order = _order(1, 0, 4096)
    assert sorted(order) == list(range(12)) and order != list(range(12))
    assert _order(1, 0, 4096) == order  # the same draw wherever it is made
    assert _order(2, 0, 4096) != order
    assert _order(1, 1, 4096) != order  # a new order every epoch
    assert _order(1, 0, 8192) != order  # and for every pass of an epoch
    items = list(shuffled_steps(iter([IDLE, ([7], _info(0, 1))]), 1))
    assert items[0] is IDLE and items[1][0] == [7]


def _history(out: Path) -> list[tuple[int, int, float]]:
    return [(h["epoch"], h["rows"], h["train_loss"])
            for h in json.loads((out / "history.json").read_text())]


def _weights(out: Path) -> tuple[dict[str, np.ndarray], dict[str, torch.Tensor]]:
    trainer = Trainer.from_checkpoint(out)
    return trainer.store.to_arrays(), trainer.model.state_dict()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("shuffle") / "train.tsv"
    generate(path, 3000, model_seed=1, sample_seed=3)
    return path


def test_shuffle_reorders_steps_not_rows_and_resumes_exactly(data, tmp_path) -> None:
    runs = {name: tmp_path / name for name in ("cyclic", "shuffled", "again", "resumed")}
    train = ["--train", str(data), *COMMON]
    assert main(["train", *train, "--out", str(runs["cyclic"]), "--epochs", "3",
                 "--no-shuffle"]) == 0
    for name in ("shuffled", "again"):
        assert main(["train", *train, "--out", str(runs[name]), "--epochs", "3",
                     "--shuffle"]) == 0
    # Stopped after two epochs, then resumed for the third.
    assert main(["train", *train, "--out", str(runs["resumed"]), "--epochs", "2",
                 "--shuffle"]) == 0
    assert main(["train", "--resume", *train, "--out", str(runs["resumed"]), "--epochs", "3",
                 "--shuffle"]) == 0
    cyclic, shuffled = _history(runs["cyclic"]), _history(runs["shuffled"])
    # The same passes and rows; the first pass of 4 batches already in another order.
    assert [h[:2] for h in shuffled] == [h[:2] for h in cyclic]
    assert [h[:2] for h in cyclic[:3]] == [(0, 1024), (0, 1024), (0, 952)]
    assert shuffled[0][2] != pytest.approx(cyclic[0][2], abs=1e-6)
    assert _history(runs["again"]) == shuffled
    assert _history(runs["resumed"]) == shuffled
    for name in ("again", "resumed"):
        (arrays, dense), (want, want_dense) = _weights(runs[name]), _weights(runs["shuffled"])
        for key in ("keys", "values", "state"):
            np.testing.assert_array_equal(arrays[key], want[key])
        for key, weight in want_dense.items():
            torch.testing.assert_close(dense[key], weight, atol=0, rtol=0)
    assert json.loads((runs["shuffled"] / "train_config.json").read_text())["shuffle"] is True


def _config(shuffle: bool) -> TrainConfig:
    return TrainConfig(batch_size=128, pass_rows=1024, epochs=2, threads=1, seed=5,
                       shuffle=shuffle, autocast="off",
                       model=ModelConfig(name="deepfm", embedding_dim=4))


def _fit(ctx: DistContext | None, path: str, shuffle: bool = True) -> dict:
    torch.manual_seed(0)
    schema = csv_schema("label", ["x"], ["a", "b"])
    trainer = Trainer(schema, _config(shuffle), ctx=ctx)
    history = trainer.fit([path], progress=False)
    arrays = trainer.store.to_arrays()
    return {"keys": arrays["keys"], "values": arrays["values"],
            "dense": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "losses": [h["train_loss"] for h in history]}


@pytest.mark.slow
def test_two_ranks_shuffle_as_one_process_does(tmp_path) -> None:
    rng = np.random.default_rng(4)
    n = 2500  # two epochs of 3 passes: 8, 8 and 4 steps (the last one short)
    a, b = rng.zipf(1.4, n) % 200, rng.integers(0, 9, n)
    y = (rng.random(n) < 1 / (1 + np.exp(-(np.sin(a) + 0.3 * b - 1.5)))).astype(int)
    lines = ["label,x,a,b", *(f"{y[i]},{rng.random():.3f},a{a[i]},b{b[i]}" for i in range(n))]
    path = tmp_path / "train.csv"
    path.write_text("\n".join(lines) + "\n")
    one = _fit(None, str(path))
    cyclic = _fit(None, str(path), shuffle=False)
    assert one["losses"][0] != pytest.approx(cyclic["losses"][0], rel=1e-6)
    parts = run_ranks(_fit, 2, str(path))
    keys = np.concatenate([p["keys"] for p in parts])
    order = np.argsort(keys)
    np.testing.assert_array_equal(keys[order], one["keys"])
    np.testing.assert_allclose(np.concatenate([p["values"] for p in parts])[order],
                               one["values"], atol=2e-5)
    for name, weight in one["dense"].items():
        torch.testing.assert_close(parts[0]["dense"][name], weight, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(parts[0]["losses"], one["losses"], rtol=1e-5)


def test_a_search_space_cannot_vary_how_the_shared_loop_reads() -> None:
    for name in ("shuffle", "pass_rows"):
        with pytest.raises(ValueError, match=f"space: {name}: the trials share one pass loop"):
            check_space({name: [True, False] if name == "shuffle" else [512, 1024]},
                        TrainConfig())


def test_in_file_order_undoes_the_shuffle() -> None:
    info = _info(2, 777)
    batches = list(range(9))
    assert in_file_order(shuffled(batches, 3, info), 3, info) == batches
