"""The training-throughput baselines: same network, three embedding paths."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "_baselines.py"
_spec = importlib.util.spec_from_file_location("_baselines", _PATH)
baselines = importlib.util.module_from_spec(_spec)
sys.modules["_baselines"] = baselines
_spec.loader.exec_module(baselines)

ROWS, BATCH, TABLE_ROWS, VOCAB = 2048, 256, 1000, 20


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These batches are tiny; a second intra-op thread only adds spin-waiting, which on
    a busy 2-core runner slows the steps tenfold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


needs_torchrec = pytest.mark.skipif(not baselines.torchrec_available(),
                                    reason="torchrec does not load here")


def _planted(by_key: bool, seed: int = 0):
    """Rows whose label is a function of field 0's key (``by_key``) or of dense[:, 0].

    Each field draws from ``VOCAB`` full-range int64 keys (negative ones included), so
    every key recurs often enough to be learned in a few steps.
    """
    g = torch.Generator().manual_seed(seed)
    vocab = torch.randint(-2**62, 2**62, (baselines.NUM_FIELDS, VOCAB), generator=g)
    pick = torch.randint(0, VOCAB, (ROWS, baselines.NUM_FIELDS), generator=g)
    ids = torch.gather(vocab, 1, pick.t()).t().contiguous()
    dense = torch.randn(ROWS, baselines.NUM_DENSE, generator=g)
    labels = (pick[:, 0] % 2) if by_key else (dense[:, 0] > 0)
    return dense, ids, labels.float()


def _train(step, batches, steps: int = 40) -> list[float]:
    return [float(step(batches[i % len(batches)])) for i in range(steps)]


def _assert_learns(losses: list[float], factor: float) -> None:
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < factor * first, (first, last)


def test_network_shapes_and_pairwise_interaction() -> None:
    torch.manual_seed(0)
    net = baselines.DLRMDense()
    assert net.top[0].in_features == 16 + 26 * 27 // 2 == 367
    assert [m.out_features for m in net.bottom if hasattr(m, "out_features")] == [64, 16]
    assert [m.out_features for m in net.top if hasattr(m, "out_features")] == [512, 256, 1]

    dense, emb = torch.randn(3, 13), torch.randn(3, 26, 16)
    assert net(dense, emb).shape == (3,)
    # The interaction is every unordered pair of the 27 vectors, each once, no self-dots.
    bottom = net.bottom(dense)
    vectors = torch.cat([bottom.unsqueeze(1), emb], dim=1)
    expected = torch.stack([(vectors[:, i] * vectors[:, j]).sum(-1)
                            for i, j in itertools.combinations(range(27), 2)], dim=1)
    dots = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1)[:, net.pair_index]
    torch.testing.assert_close(dots, expected)


def test_make_batches_drops_ragged_tail_and_checks_inputs() -> None:
    dense, ids, labels = _planted(by_key=True)
    batches = baselines.make_batches(dense[:1000], ids[:1000], labels[:1000], 256)
    assert len(batches) == 3
    torch.testing.assert_close(batches[1].ids, ids[256:512])

    with pytest.raises(ValueError, match=r"ids must be torch.int64 \[N, 26\], got torch.float32"):
        baselines.make_batches(dense, ids.float(), labels, 256)
    with pytest.raises(ValueError, match=r"dense must be torch.float32 \[N, 13\]"):
        baselines.make_batches(dense[:, :5], ids, labels, 256)
    with pytest.raises(ValueError, match=r"labels must be torch.float32 \[N\]"):
        baselines.make_batches(dense, ids, labels.long(), 256)
    with pytest.raises(ValueError, match="same number of rows, got 2048, 2048 and 10"):
        baselines.make_batches(dense, ids, labels[:10], 256)
    with pytest.raises(ValueError, match="100 rows < batch_size 256"):
        baselines.make_batches(dense[:100], ids[:100], labels[:100], 256)


def _fake_clock(monkeypatch: pytest.MonkeyPatch, *readings: float) -> None:
    ticks = iter(readings)
    monkeypatch.setattr(baselines, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))


def test_time_steps_cycles_batches_and_counts_only_timed_samples(
        monkeypatch: pytest.MonkeyPatch) -> None:
    batches = [baselines.DLRMBatch(torch.zeros(n, 13), torch.zeros(n, 26, dtype=torch.long),
                                   torch.full((n,), float(k)))
               for k, n in enumerate((10, 20, 30))]
    seen = []

    def step(batch):
        seen.append(int(batch.labels[0]))
        return torch.tensor(0.0)

    _fake_clock(monkeypatch, 100.0, 104.0)
    sps = baselines.time_steps(step, batches, warmup=2, steps=4)
    assert seen == [0, 1, 2, 0, 1, 2]
    assert sps == (30 + 10 + 20 + 30) / 4.0

    with pytest.raises(ValueError, match="steps >= 1"):
        baselines.time_steps(step, batches, warmup=0, steps=0)
    with pytest.raises(ValueError, match="no batches"):
        baselines.time_steps(step, [], warmup=0, steps=1)


def test_entry_point_times_the_requested_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    dense, ids, labels = _planted(by_key=False)
    _fake_clock(monkeypatch, 10.0, 12.0)
    sps = baselines.dense_only_sps(dense, ids, labels, steps=3, warmup=1, batch_size=BATCH)
    assert sps == 3 * BATCH / 2.0


def test_dense_only_learns_a_dense_signal() -> None:
    dense, ids, labels = _planted(by_key=False)
    step, _ = baselines.make_dense_only_step(BATCH)
    _assert_learns(_train(step, baselines.make_batches(dense, ids, labels, BATCH)), 0.8)


def test_dense_only_cannot_see_the_keys() -> None:
    dense, ids, labels = _planted(by_key=True)
    step, _ = baselines.make_dense_only_step(BATCH)
    losses = _train(step, baselines.make_batches(dense, ids, labels, BATCH))
    assert min(losses[-5:]) > 0.6  # chance is ln 2 = 0.693: no embedding, no signal


def _touched_rows(ids: torch.Tensor, field: int) -> torch.Tensor:
    touched = torch.zeros(TABLE_ROWS, dtype=torch.bool)
    touched[ids[:, field] % TABLE_ROWS] = True
    return touched


def test_pytorch_learns_the_keys_and_updates_only_touched_rows() -> None:
    dense, ids, labels = _planted(by_key=True)
    step, _, tables = baselines.make_pytorch_step(TABLE_ROWS)
    before = tables.bags[0].weight.detach().clone()
    _assert_learns(_train(step, baselines.make_batches(dense, ids, labels, BATCH)), 0.2)

    after = tables.bags[0].weight.detach()
    changed = (after != before).any(dim=1)
    assert torch.equal(changed, _touched_rows(ids, 0))


@needs_torchrec
def test_torchrec_learns_the_keys_and_updates_only_touched_rows() -> None:
    dense, ids, labels = _planted(by_key=True)
    step, _, collection = baselines.make_torchrec_step(TABLE_ROWS)
    weight = collection.embedding_bags["t0"].weight
    before = weight.detach().clone()
    _assert_learns(_train(step, baselines.make_batches(dense, ids, labels, BATCH)), 0.2)

    changed = (weight.detach() != before).any(dim=1)
    assert torch.equal(changed, _touched_rows(ids, 0))


def test_torchrec_sps_is_none_without_torchrec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(baselines, "torchrec_available", lambda: False)
    dense, ids, labels = _planted(by_key=True)
    assert baselines.torchrec_sps(dense, ids, labels, steps=1, warmup=0,
                                  batch_size=BATCH, table_rows=TABLE_ROWS) is None


def test_the_dense_only_bound_with_the_embeddings_gradient_computes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``embedding_grad``: backward computes the gradient of the zero embeddings the
    network is fed (the plain bound skips it), and the network trains as it does."""
    from terarec.train.dense_step import DenseStep

    grads: list[torch.Size] = []
    call = DenseStep.__call__

    def watched(self, dense, emb, labels):
        if emb.requires_grad:
            emb.register_hook(lambda g: grads.append(g.shape))
        return call(self, dense, emb, labels)

    monkeypatch.setattr(DenseStep, "__call__", watched)
    dense, ids, labels = _planted(by_key=False)
    batch = baselines.make_batches(dense, ids, labels, BATCH)[0]
    plain, _ = baselines.make_dense_only_step(BATCH)
    with_grad, model = baselines.make_dense_only_step(BATCH, embedding_grad=True)
    assert torch.equal(plain(batch), with_grad(batch))  # same seed, same first loss
    assert grads == [torch.Size([BATCH, baselines.NUM_FIELDS, baselines.EMB_DIM])]
    with_grad(batch)
    assert len(grads) == 2 and all(p.grad is not None for p in model.parameters())
