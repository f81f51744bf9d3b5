"""The model side of sequence fields: slot rows split into pooled fields and padded
sequences, DIN's target attention and the pooled baseline."""

from __future__ import annotations

import pytest
import torch

from terarec.config import ModelConfig
from terarec.models.registry import build_model
from terarec.models.sequence import SequenceRows, SlotLayout
from terarec.types import FeatureSchema, FieldSpec

DIM = 4
L = 3


def _schema(max_len: int | None = L, table: str | None = "item",
            pooling: str = "sum") -> FeatureSchema:
    return FeatureSchema(label="y", fields=(
        FieldSpec("x", "numeric"), FieldSpec("user", "categorical"),
        FieldSpec("item", "categorical"),
        FieldSpec("hist", "categorical", separator="|", max_len=max_len, table=table,
                  pooling=pooling)))  # type: ignore[arg-type]


def _config(name: str) -> ModelConfig:
    return ModelConfig(name=name, embedding_dim=DIM, deep_mlp=(8,))


def _slots(batch: int = 5, lengths: tuple[int, ...] = (3, 1, 0, 2, 3)) -> torch.Tensor:
    """``[B, 2 + L, D]`` slot rows: user, item, then the padded history."""
    gen = torch.Generator().manual_seed(0)
    emb = torch.randn(batch, 2 + L, DIM, generator=gen)
    for i, n in enumerate(lengths):
        emb[i, 2 + n:] = 0.0
    return emb


def test_layout_splits_slots_and_derives_lengths_from_filled_rows() -> None:
    layout = SlotLayout(_schema())
    emb = _slots()
    pooled, seqs = layout.split(emb)
    assert torch.equal(pooled, emb[:, :2])
    hist = seqs["hist"]
    assert hist.rows.shape == (5, L, DIM)
    assert hist.lengths.tolist() == [3, 1, 0, 2, 3]
    assert hist.mask[1].tolist() == [True, False, False]
    assert torch.allclose(layout.pool(emb)[:, 2], emb[:, 2:].sum(1))
    mean = SlotLayout(_schema(pooling="mean")).pool(emb)[:, 2]
    count = hist.lengths.clamp_min(1).unsqueeze(1).float()
    assert torch.allclose(mean, emb[:, 2:].sum(1) / count)


def test_a_pooled_model_sees_the_sequence_as_its_multi_valued_field() -> None:
    """DeepFM over a sequence field equals DeepFM over the same keys pooled by sum."""
    torch.manual_seed(0)
    seq_model = build_model(_schema(), _config("deepfm")).eval()
    multi_model = build_model(_schema(max_len=None), _config("deepfm")).eval()
    multi_model.load_state_dict(seq_model.state_dict())
    assert seq_model.num_fields == 3
    dense = torch.randn(5, 2)
    emb = torch.nn.functional.pad(_slots(), (0, 1))  # FM rows are 1 + D wide
    pooled = torch.cat([emb[:, :2], emb[:, 2:].sum(1, keepdim=True)], dim=1)
    assert torch.allclose(seq_model(dense, emb), multi_model(dense, pooled), atol=1e-6)


def _history(emb: torch.Tensor) -> SequenceRows:
    return SlotLayout(_schema()).split(emb)[1]["hist"]


def _din_reference(model: torch.nn.Module, dense: torch.Tensor,
                   emb: torch.Tensor) -> torch.Tensor:
    """DIN written out: attention MLP over [q, k, q-k, q*k], masked, no softmax; the
    MLP gets the interest and its product with the candidate."""
    q, keys = emb[:, 1], emb[:, 2:]
    mask = keys.ne(0).any(2).float()
    qe = q.unsqueeze(1).expand_as(keys)
    w = model.attention[0](torch.cat([qe, keys, qe - keys, qe * keys], 2)).squeeze(2)
    interest = ((w * mask).unsqueeze(2) * keys).sum(1)
    x = torch.cat([emb[:, :2].flatten(1), interest, interest * q, dense], 1)
    return model.deep(x).squeeze(1) + model.bias


def test_din_attends_from_the_candidate_over_the_filled_positions() -> None:
    torch.manual_seed(0)
    model = build_model(_schema(), _config("din")).eval()
    assert model.num_fields == 2 and model.query_index == [1]
    dense, emb = torch.randn(5, 2), _slots()
    with torch.no_grad():
        got = model(dense, emb)
        assert torch.allclose(got, _din_reference(model, dense, emb), atol=1e-6)
        # padding carries nothing: a row with an empty history equals zero interest
        short = emb.clone()
        short[0, 2 + 1:] = 0.0
        assert not torch.allclose(model(dense, short)[0], got[0])
        assert torch.allclose(model(dense, short)[1:], got[1:])
        # no softmax: the same history twice doubles the interest (intensity kept)
        x = emb.clone()
        x[:, 2:] = 0.0
        x[:, 2] = emb[:, 2]
        twice = x.clone()
        twice[:, 3] = emb[:, 2]
        one = model.interest(0, x[:, :2], _history(x))
        two = model.interest(0, twice[:, :2], _history(twice))
        assert torch.allclose(two, 2 * one, atol=1e-6)


def test_seqpool_sums_the_sequence_and_both_refuse_a_schema_they_cannot_use() -> None:
    torch.manual_seed(0)
    model = build_model(_schema(), _config("seqpool")).eval()
    emb = _slots()
    assert torch.allclose(model.interest(0, emb[:, :2], _history(emb)), emb[:, 2:].sum(1))
    with pytest.raises(ValueError, match="needs a sequence field"):
        build_model(_schema(max_len=None), _config("din"))
    with pytest.raises(ValueError, match=r"sequence field 'hist' needs a candidate field "
                                         r"on its table 'hist'.*--share-table hist="):
        build_model(_schema(table=None), _config("din"))


def test_din_exports_to_onnx_with_the_slot_input() -> None:
    pytest.importorskip("onnxruntime")
    from terarec.serving.dense import OnnxForwards

    torch.manual_seed(0)
    schema = _schema()
    model = build_model(schema, _config("din")).eval()
    forward = OnnxForwards(threads=1).build(model, schema, DIM)
    assert forward is not None  # matched PyTorch to the serving tolerance
    dense, emb = torch.randn(7, 2), _slots(7, (3, 1, 0, 2, 3, 0, 1))
    with torch.no_grad():
        assert torch.allclose(forward(dense, emb), model(dense, emb), atol=1e-5)


def test_din_learns_whether_the_candidate_is_in_the_history() -> None:
    """The planted history's core signal on fixed rows: the label is whether the
    candidate's row is among the history's. The interest must be compared with the
    candidate, which the model has to learn from rows alone."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    items, length, batch = 40, 3, 256
    table = torch.randn(items, DIM, generator=gen)
    model = build_model(_schema(), _config("din"))

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        hist = torch.randint(0, items, (n, length), generator=gen)
        pick = hist[torch.arange(n), torch.randint(0, length, (n,), generator=gen)]
        item = torch.where(torch.rand(n, generator=gen) < 0.5, pick,
                           torch.randint(0, items, (n,), generator=gen))
        label = (hist == item.unsqueeze(1)).any(1).float()
        user = torch.zeros(n, 1, DIM)
        emb = torch.cat([user, table[item].unsqueeze(1), table[hist]], dim=1)
        return emb, label

    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(300):
        emb, label = draw(batch)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(torch.zeros(batch, 2), emb), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    emb, label = draw(2000)
    with torch.no_grad():
        score = model(torch.zeros(2000, 2), emb)
    pos, neg = score[label == 1], score[label == 0]
    auc = (pos.unsqueeze(1) > neg.unsqueeze(0)).float().mean().item()
    assert auc > 0.95
