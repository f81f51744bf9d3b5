"""The dense-step switches: autocast and compile, their ``auto`` rules, bad values, and
that a compiled or bf16 run trains the model an eager fp32 run would (within tolerance)
and writes checkpoints an eager trainer loads."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from terarec.config import ModelConfig, TrainConfig, from_dict
from terarec.data.synth import generate
from terarec.modeldir import save_checkpoint
from terarec.train import dense_step as ds
from terarec.train.dense_step import COMPILE_AFTER_STEPS, DenseStep, autocast_dtype, compile_wanted
from terarec.train.trainer import Trainer
from terarec.types import FeatureSchema

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_autocast_auto_follows_the_hardware(monkeypatch) -> None:
    monkeypatch.setattr(ds, "cpu_bf16_native", lambda: False)  # an AVX2 CPU
    assert autocast_dtype("auto", CPU) is None
    assert autocast_dtype("bf16", CPU) is torch.bfloat16  # forced: anywhere
    assert autocast_dtype("off", CPU) is None
    monkeypatch.setattr(ds, "cpu_bf16_native", lambda: True)  # AMX / AVX-512 BF16
    assert autocast_dtype("auto", CPU) is torch.bfloat16
    assert autocast_dtype("off", CPU) is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert autocast_dtype("auto", CUDA) is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert autocast_dtype("auto", CUDA) is None


def test_compile_auto_waits_for_a_long_run_and_skips_cpus() -> None:
    assert not compile_wanted("auto", CPU, 0)
    assert not compile_wanted("auto", CPU, 10 * COMPILE_AFTER_STEPS)
    assert not compile_wanted("auto", CUDA, 10)
    assert compile_wanted("auto", CUDA, COMPILE_AFTER_STEPS)
    assert compile_wanted("on", CPU, 0)
    assert not compile_wanted("off", CUDA, 10 * COMPILE_AFTER_STEPS)


@pytest.mark.parametrize(("field", "value"), [("compile", "yes"), ("autocast", "fp16")])
def test_bad_switch_values_name_the_field(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=field):
        from_dict(TrainConfig, {field: value})
    with pytest.raises(ValueError, match=f"{field} must be one of .*{value!r}"):
        DenseStep(nn.Identity(), F.mse_loss, CPU, **{field: value})


def test_bad_switch_values_rejected_by_the_cli(capsys) -> None:
    from terarec.cli.main import main
    with pytest.raises(SystemExit):
        main(["train", "--train", "x.tsv", "--out", "o", "--compile", "sometimes"])
    assert "--compile" in capsys.readouterr().err


def _tiny(batch: int = 64) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4, 16), nn.ReLU(), nn.Linear(16, 1),
                          nn.Flatten(0))
    emb = torch.randn(batch, 3, 4)
    return model, torch.zeros(batch, 0), emb, (torch.rand(batch) < 0.3).float()


def _fwd(model: nn.Module):
    return lambda dense, emb: model(emb)


def test_tiny_runs_stay_eager_under_auto(monkeypatch) -> None:
    """``auto`` never calls the compiler on a short run (nor on a CPU at all)."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: calls.append(1))
    model, dense, emb, y = _tiny()
    step = DenseStep(_fwd(model), F.binary_cross_entropy_with_logits, CPU, batch_size=64)
    for _ in range(5):
        step(dense, emb, y).backward()
    assert not step.compiled and not calls
    cuda_step = DenseStep(_fwd(model), F.binary_cross_entropy_with_logits, CUDA,
                          batch_size=64, autocast="off")
    cuda_step.steps = COMPILE_AFTER_STEPS - 1  # as if the run had trained that long
    cuda_step(dense, emb, y)
    assert not calls
    cuda_step(dense, emb, y)  # the step after the threshold compiles
    assert calls


def test_failed_compilation_falls_back_to_eager_with_one_line(monkeypatch, caplog) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(torch, "compile", lambda fn, **k: broken)
    model, dense, emb, y = _tiny()
    step = DenseStep(_fwd(model), F.binary_cross_entropy_with_logits, CPU, compile="on",
                     autocast="off", batch_size=64)  # fp32, the eager step compared with
    with caplog.at_level(logging.WARNING, logger="terarec.train.dense_step"):
        losses = [step(dense, emb, y) for _ in range(3)]
    assert [r.message for r in caplog.records if "failed" in r.message] == [
        "torch.compile of the dense step failed (RuntimeError: no compiler here); "
        "training eagerly"]
    assert not step.compiled
    expected = F.binary_cross_entropy_with_logits(model(emb), y)
    assert all(torch.equal(loss, expected) for loss in losses)


def test_bf16_autocast_close_to_fp32_and_its_gradients_reach_the_rows() -> None:
    model, dense, emb, y = _tiny()
    emb32, emb16 = emb.clone().requires_grad_(), emb.clone().requires_grad_()
    loss32 = DenseStep(_fwd(model), F.binary_cross_entropy_with_logits, CPU,
                       autocast="off")(dense, emb32, y)
    loss16 = DenseStep(_fwd(model), F.binary_cross_entropy_with_logits, CPU,
                       autocast="bf16")(dense, emb16, y)
    assert loss16.dtype == torch.float32
    loss32.backward()
    loss16.backward()
    assert emb16.grad is not None and emb16.grad.dtype == torch.float32
    assert abs(loss16.item() - loss32.item()) < 2e-2
    assert torch.allclose(emb16.grad, emb32.grad, atol=2e-3, rtol=5e-2)
    assert not torch.equal(emb16.grad, emb32.grad)  # bf16 did run


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense_step") / "train.tsv"
    generate(path, 1000, model_seed=0, sample_seed=3, vocab_scale=0.01)
    return path


def _trainer(**switches: str) -> Trainer:
    torch.set_num_threads(1)
    config = TrainConfig(batch_size=300, pass_rows=600, seed=2, threads=1, shuffle=False,
                         recalibrate=False,
                         model=ModelConfig(name="dlrm", embedding_dim=4, bottom_mlp=(8, 4),
                                           top_mlp=(8,)), **switches)  # type: ignore[arg-type]
    return Trainer(FeatureSchema.criteo(), config)


def test_forced_bf16_run_trains(data) -> None:
    """bf16 trains on any CPU when forced (emulated where the CPU has no bf16)."""
    fp32, bf16 = _trainer(autocast="off"), _trainer(autocast="bf16")
    assert bf16.dense_step.dtype is torch.bfloat16 and fp32.dense_step.dtype is None
    h32 = fp32.fit([data], progress=False)
    h16 = bf16.fit([data], progress=False)
    assert abs(h16[-1]["train_loss"] - h32[-1]["train_loss"]) < 0.01
    p32 = fp32.predict_batches(fp32.plan(_batches(data), counts=False).batches)
    p16 = bf16.predict_batches(bf16.plan(_batches(data), counts=False).batches)
    assert abs(float(p32.mean()) - float(p16.mean())) < 0.01
    assert not all(torch.equal(a, b) for a, b in zip(fp32.model.parameters(),
                                                     bf16.model.parameters(), strict=True))


def _batches(path):
    from terarec.train.passes import iter_file_batches
    return list(iter_file_batches([path], FeatureSchema.criteo(), 300))


@pytest.mark.slow
def test_compiled_run_matches_eager_and_its_checkpoint_loads_eagerly(data, tmp_path) -> None:
    """Compiled from the first step, with a partial last batch (1000 rows in batches of
    300: the 100-row step runs eagerly): the same losses and predictions as eager within
    float tolerance, and the checkpoint is an ordinary one."""
    eager, compiled = _trainer(compile="off"), _trainer(compile="on")
    h_eager = eager.fit([data], progress=False)
    h_comp = compiled.fit([data], progress=False)
    assert compiled.dense_step.compiled and not eager.dense_step.compiled
    for a, b in zip(h_eager, h_comp, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4, abs=1e-5)
    batches = _batches(data)
    p_eager = eager.predict_batches(batches)
    p_comp = compiled.predict_batches(batches)
    assert abs(p_eager - p_comp).max() < 1e-4
    save_checkpoint(tmp_path / "m", compiled)
    loaded = Trainer.from_checkpoint(tmp_path / "m", _trainer(compile="off").config)
    assert not loaded.dense_step.compiled
    assert abs(loaded.predict_batches(batches) - p_comp).max() < 1e-6


def test_the_ranked_step_shares_the_one_process_steps_autocast() -> None:
    """The ranked step runs its model through DDP, outside ``DenseStep.eager``: it takes
    the same context, so N ranks run the precision one process runs."""
    a, b = torch.randn(4, 8), torch.randn(8, 2)
    for mode, dtype in (("bf16", torch.bfloat16), ("off", torch.float32)):
        step = DenseStep(lambda d, e: d, F.binary_cross_entropy_with_logits, CPU,
                         autocast=mode)
        with step.autocast():
            assert (a @ b).dtype is dtype
