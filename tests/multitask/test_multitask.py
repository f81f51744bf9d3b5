"""Several labels in one model: the label flag, the schema, the three multi-task models,
training with per-task metrics and selection, and scoring every task."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from multitask_helpers import FIELDS, QUICK, write_pair

import terarec
from terarec.cli.main import main as cli_main
from terarec.config import ModelConfig
from terarec.data.spec import DataSpec, parse_labels
from terarec.models import build_model
from terarec.train.metrics import auc
from terarec.types import FeatureSchema, FieldSpec
from terarec.validation import InvalidInput

SCHEMA = FeatureSchema(label="click", extra_labels=("conversion",),
                       fields=(FieldSpec("u", "categorical"), FieldSpec("i", "categorical"),
                               FieldSpec("x", "numeric")))
SMALL = ModelConfig(embedding_dim=4, deep_mlp=(8,), tower_mlp=(4,), num_experts=3)


def test_label_flag_gives_columns_and_weights() -> None:
    assert parse_labels("click") == (("click",), ())
    assert parse_labels("click,conversion") == (("click", "conversion"), ())
    assert parse_labels("click:1,conversion:0.5") == (("click", "conversion"), (1.0, 0.5))
    assert parse_labels("click,conversion:2") == (("click", "conversion"), (1.0, 2.0))
    assert parse_labels("click,conversion", [1, 3]) == (("click", "conversion"), (1.0, 3.0))
    for bad, match in (("click:x,conv", "weight 'x' of 'click' is not a number"),
                       ("click:0,conv:0", "not all 0"), ("click:-1,conv", ">= 0"),
                       ("click:nan,conv", "finite"), ("click,,conv", "empty column")):
        with pytest.raises(ValueError, match=match):
            parse_labels(bad)
    with pytest.raises(ValueError, match="2 weights for 3 labels"):
        parse_labels("a,b,c", [1, 2])
    spec = DataSpec.of(format="csv", label=["click", "conversion"], label_weights=[1, 0.5],
                       categorical="u,i")
    schema = spec.schema()
    assert schema.task_names == ("click", "conversion")
    assert schema.task_weights == (1.0, 0.5)
    with pytest.raises(ValueError, match="--label names 'click' twice"):
        DataSpec.of(format="csv", label="click,click", categorical="u").schema()
    with pytest.raises(ValueError, match="--label and --categorical both name 'u'"):
        DataSpec.of(format="csv", label="click,u", categorical="u").schema()


def test_schema_json_keeps_the_labels_and_one_label_stays_as_it_was() -> None:
    one = replace(SCHEMA, extra_labels=())
    assert "extra_labels" not in one.to_dict() and "label_weights" not in one.to_dict()
    two = replace(SCHEMA, label_weights=(1.0, 0.25))
    again = FeatureSchema.from_dict(json.loads(two.json_text))
    assert again == two and again.num_tasks == 2
    bad = {**two.to_dict(), "label_weights": [1.0]}
    with pytest.raises(InvalidInput, match="label_weights: expected 2"):
        FeatureSchema.from_dict(bad, "schema.json")
    clash = {**two.to_dict(), "extra_labels": ["u"]}
    with pytest.raises(InvalidInput, match=r"extra_labels\[0\]: 'u'"):
        FeatureSchema.from_dict(clash, "schema.json")


@pytest.mark.parametrize("name", ["sharedbottom", "mmoe", "esmm"])
def test_multi_task_models_give_one_logit_per_label(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(SCHEMA, replace(SMALL, name=name))
    dense, emb = torch.randn(5, SCHEMA.dense_dim), torch.randn(5, 2, 5)
    out = model(dense, emb)
    assert out.shape == (5, 2) and torch.isfinite(out).all()
    assert model.task_names == ("click", "conversion")
    # each row's scores are its own: a batch of one gives the same logits
    assert torch.allclose(model.eval()(dense[:1], emb[:1]), model(dense, emb)[:1], atol=1e-6)


def test_esmm_second_output_is_the_product_of_ctr_and_cvr() -> None:
    torch.manual_seed(1)
    model = build_model(SCHEMA, replace(SMALL, name="esmm")).eval()
    dense, emb = torch.randn(64, SCHEMA.dense_dim), 3 * torch.randn(64, 2, 5)
    out = torch.sigmoid(model(dense, emb).double())
    cvr = torch.sigmoid(model.cvr_logits(dense, emb).double())
    assert torch.allclose(out[:, 1], out[:, 0] * cvr, rtol=1e-4, atol=1e-7)
    labels = torch.tensor([[0.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    assert model.task_targets(labels).tolist() == [[0, 0], [1, 1], [1, 0]]


def test_label_count_and_model_kind_must_agree() -> None:
    with pytest.raises(ValueError, match="predicts one label, the schema has 2"):
        build_model(SCHEMA, replace(SMALL, name="deepfm"))
    with pytest.raises(ValueError, match="needs two or more labels"):
        build_model(replace(SCHEMA, extra_labels=()), replace(SMALL, name="mmoe"))
    three = replace(SCHEMA, extra_labels=("conversion", "like"))
    with pytest.raises(ValueError, match="'esmm' has two tasks"):
        build_model(three, replace(SMALL, name="esmm"))
    assert build_model(three, replace(SMALL, name="mmoe"))(
        torch.zeros(2, 2), torch.zeros(2, 2, 5)).shape == (2, 3)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("two-labels"))


@pytest.fixture(scope="module")
def mmoe(data, tmp_path_factory):
    train, valid = data
    out = tmp_path_factory.mktemp("mmoe") / "model"
    return terarec.fit(train, valid, out=out, label="click:1,conversion:0.5",
                       model={**QUICK["model"], "name": "mmoe"}, select_by="auc",
                       select_task="conversion",
                       **{k: v for k, v in QUICK.items() if k != "model"}, **FIELDS)


def test_fit_reports_every_task_and_selects_by_the_named_one(mmoe, data) -> None:
    metrics = mmoe.metrics
    for task in ("click", "conversion"):
        assert metrics[f"auc_{task}"] > 0.6, metrics  # both tasks learn
    weighted = (metrics["auc_click"] + 0.5 * metrics["auc_conversion"]) / 1.5
    assert metrics["auc"] == pytest.approx(weighted)
    assert metrics["select_task"] == "conversion"
    history = mmoe.history
    best = max(history, key=lambda h: h["valid_auc_conversion"])
    assert metrics["best_value"] == pytest.approx(best["valid_auc_conversion"])
    assert mmoe.task_names == ("click", "conversion")


def test_the_report_shows_every_task(mmoe) -> None:
    html = (mmoe.path / "report" / "report.html").read_text()
    assert 'src="tasks.png"' in html and (mmoe.path / "report" / "tasks.png").is_file()
    table = html.split("<h2>Per task</h2>")[1].split("</table>")[0]
    for task in ("click", "conversion"):
        assert f"<td>{task}</td>" in table
        assert f"{mmoe.metrics[f'auc_{task}']:.4f}" in table


def test_predict_and_evaluate_give_every_task(mmoe, data) -> None:
    _, valid = data
    probs = mmoe.predict(valid)
    assert probs.shape == (2000, 2) and np.isfinite(probs).all()
    got = mmoe.evaluate(valid)
    labels = np.loadtxt(valid, delimiter=",", skiprows=1, usecols=(0, 1))
    for t, task in enumerate(("click", "conversion")):
        assert got[f"auc_{task}"] == pytest.approx(auc(labels[:, t], probs[:, t]), abs=1e-6)
    assert got["rows"] == 2000


def test_esmm_trains_ctr_and_ctcvr(data, tmp_path) -> None:
    train, valid = data
    model = terarec.fit(train, valid, out=tmp_path / "esmm", label="click,conversion",
                        model={**QUICK["model"], "name": "esmm"},
                        **{k: v for k, v in QUICK.items() if k != "model"}, **FIELDS)
    probs = model.predict(valid)
    assert (probs[:, 1] <= probs[:, 0] + 1e-6).all()  # pCTCVR = pCTR * pCVR <= pCTR
    assert model.metrics["auc_conversion"] > 0.6


def test_select_task_must_name_one_of_several_labels(data, tmp_path) -> None:
    train, valid = data
    with pytest.raises(ValueError, match="--select-task 'like': not one of several"):
        terarec.fit(train, valid, out=tmp_path / "m", label="click,conversion",
                    select_task="like", model="mmoe", **FIELDS)
    with pytest.raises(ValueError, match="--select-task needs --valid"):
        terarec.fit(train, out=tmp_path / "m", label="click,conversion",
                    select_task="click", model="mmoe", valid_split=0, **FIELDS)


def test_a_bad_second_label_is_named(tmp_path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("click,conversion,u\n1,0,a\n0,2,b\n")
    with pytest.raises(ValueError, match=r"line 3: field 'conversion': label must be 0 or 1"):
        terarec.fit(path, out=tmp_path / "m", format="csv", label="click,conversion",
                    categorical="u", model="mmoe", progress=False)


def test_cli_synth_conversion_and_train(tmp_path, capsys) -> None:
    train = tmp_path / "t.csv"
    assert cli_main(["synth", "--conversion", "--rows", "3000", "--out", str(train),
                     "--vocab-scale", "0.002"]) == 0
    said = capsys.readouterr().out
    assert "click: CTR" in said and "conversion:" in said and said.count("reachable AUC") == 2
    rows = np.loadtxt(train, delimiter=",", skiprows=1, usecols=(0, 1))
    assert rows[:, 1].sum() > 0 and (rows[:, 1] <= rows[:, 0]).all()  # only after a click
    truth = json.loads(train.with_name("t.csv.truth.json").read_text())
    assert 0.5 < truth["conversion_ceiling_auc"] < 1 and 0.5 < truth["ceiling_auc"] < 1
    out = tmp_path / "model"
    assert cli_main(["train", "--train", str(train), "--out", str(out), "--format", "csv",
                     "--label", "click:1,conversion:0.5", "--numeric", FIELDS["numeric"],
                     "--categorical", FIELDS["categorical"], "--model", "sharedbottom",
                     "--epochs", "1", "--batch-size", "512", "--no-progress"]) == 0
    capsys.readouterr()
    assert cli_main(["eval", "--model", str(out), "--data", str(train)]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"auc_click", "auc_conversion", "logloss_click", "logloss_conversion"} \
        <= set(evaluated)


@pytest.mark.parametrize("name", ["sharedbottom", "mmoe", "esmm"])
def test_the_server_runs_multi_task_networks_on_onnx(name: str) -> None:
    from terarec.serving.dense import TOLERANCE, OnnxForwards

    torch.manual_seed(2)
    model = build_model(SCHEMA, replace(SMALL, name=name)).eval()
    forward = OnnxForwards(threads=1).build(model, SCHEMA, model.row_dim)
    assert forward is not None, f"{name} is not served by ONNX Runtime"
    dense, emb = torch.randn(33, SCHEMA.dense_dim), torch.randn(33, 2, 5)
    got = torch.sigmoid(forward(dense, emb))
    assert got.shape == (33, 2)
    assert float((got - torch.sigmoid(model(dense, emb))).abs().max()) <= TOLERANCE


def test_esmm_ctcvr_logit_is_exact_where_the_product_nears_one() -> None:
    model = build_model(SCHEMA, replace(SMALL, name="esmm")).eval()
    a = torch.tensor([[30.0], [-30.0], [0.0], [8.0]])
    b = torch.tensor([[30.0], [5.0], [-40.0], [9.0]])
    model._ctr_cvr = lambda dense, emb: (a, b)  # type: ignore[method-assign]
    got = model(torch.zeros(4, 2), torch.zeros(4, 2, 5))[:, 1].double()
    want = torch.logit(torch.sigmoid(a.double()) * torch.sigmoid(b.double())).squeeze(1)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-3)


def test_synth_conversion_refuses_the_other_modes(tmp_path, capsys) -> None:
    for mode in (["--hourly", "2"], ["--retrieval"]):
        assert cli_main(["synth", "--conversion", *mode, "--rows", "10",
                         "--out", str(tmp_path / "x")]) == 2
        assert "--conversion plants a second label" in capsys.readouterr().err


def test_follow_trains_every_task_and_scores_each_before_training(data, tmp_path,
                                                                  capsys) -> None:
    """``train --follow`` with several labels: each landed file is scored per task before
    it trains, the summary and the report carry every task."""
    train, _ = data
    folder, out = tmp_path / "logs", tmp_path / "model"
    folder.mkdir()
    lines = train.read_text().splitlines(keepends=True)
    for h, part in enumerate((lines[1:1501], lines[1501:])):  # two hourly files
        (folder / f".h{h}.tmp").write_text(lines[0] + "".join(part))
        (folder / f".h{h}.tmp").rename(folder / f"2026-12-01T0{h}-00.csv")
    assert cli_main(["train", "--follow", str(folder), "--out", str(out), "--format", "csv",
                     "--label", "click:1,conversion:0.5", "--numeric", FIELDS["numeric"],
                     "--categorical", FIELDS["categorical"], "--model", "mmoe",
                     "--stop-after", "2", "--epochs", "1", "--batch-size", "256",
                     "--embedding-dim", "4", "--threads", "1", "--no-progress",
                     "--poll-seconds", "0.2"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    history = json.loads((out / "history.json").read_text())
    assert sum(h["rows"] for h in history) == 3000
    done = [h for h in history if h.get("file_done")]
    assert [h["file_done"] for h in done] == ["2026-12-01T00-00.csv", "2026-12-01T01-00.csv"]
    for task in ("click", "conversion"):
        assert all(0 <= h[f"progressive_auc_{task}"] <= 1 for h in history)
        assert all(h[f"file_auc_{task}"] is not None for h in done)
        # the summary's figure is the files' row-weighted mean of that task's
        rows = sum(h["file_rows"] for h in done)
        mean = sum(h[f"file_auc_{task}"] * h["file_rows"] for h in done) / rows
        assert summary[f"auc_{task}"] == pytest.approx(mean)
    # the second file is scored by a model trained on the first: above chance
    assert done[-1]["file_auc_click"] > 0.55
    assert 'src="tasks_progressive.png"' in (out / "report" / "report.html").read_text()
