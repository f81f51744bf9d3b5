"""Sequence fields end to end: synth --history, training (memory and tiered stores),
prediction, export and serving a request whose history is a list."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.csv as pa_csv
import pytest

import terarec
from terarec.cli.main import main
from terarec.data.synth_history import HistorySettings, draw_rows, generate_history

SETTINGS = HistorySettings(users=50, items=100, topics=5, subtopics=4, max_history=6)
DATA = dict(format="csv", label="label", categorical="user,item", sequences="hist:4",
            share_tables="hist=item")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("history")
    generate_history(root / "train.csv", 3000, settings=SETTINGS)
    generate_history(root / "valid.csv", 600, sample_seed=1, settings=SETTINGS)
    return root / "train.csv", root / "valid.csv"


@pytest.fixture(scope="module")
def din(files: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> terarec.Model:
    train, valid = files
    return terarec.fit(train, valid, out=tmp_path_factory.mktemp("din") / "m", model="din",
                       progress=False, epochs=1, batch_size=256, refit=False, **DATA)


def test_the_planted_truth_depends_on_the_history_and_reports_its_ceiling(
        files: tuple[Path, Path]) -> None:
    rows = draw_rows(20000, SETTINGS)
    # the history effect: rows whose history shares the candidate's subtopic click more
    subtopic = np.random.default_rng([0, 0x5E9]).permutation(
        np.arange(SETTINGS.items) % (SETTINGS.topics * SETTINGS.subtopics))
    lengths = np.diff(rows.hist_offsets)
    same = subtopic[rows.hist] == np.repeat(subtopic[rows.items], lengths)
    matched = np.add.reduceat(same.astype(int), rows.hist_offsets[:-1]) > 0
    assert rows.probs[matched].min() > rows.probs[~matched].max() - 0.3
    assert rows.labels[matched].mean() > rows.labels[~matched].mean() + 0.3
    truth = json.loads(Path(str(files[1]) + ".truth.json").read_text())
    assert 0.6 < truth["ceiling_auc"] < 1.0 and truth["rows"] == 600
    again = draw_rows(20000, SETTINGS)
    assert np.array_equal(again.hist, rows.hist) and np.array_equal(again.labels, rows.labels)


def test_synth_history_cli_writes_train_and_valid(tmp_path: Path, capsys) -> None:
    code = main(["synth", "--history", "--rows", "200", "--out", str(tmp_path / "t.csv"),
                 "--valid-rows", "50", "--valid-out", str(tmp_path / "v.csv"),
                 "--users", "20", "--items", "100", "--max-history", "5"])
    assert code == 0
    assert "best reachable AUC" in capsys.readouterr().out
    table = pa_csv.read_csv(tmp_path / "v.csv")
    assert table.column_names == ["label", "user", "item", "hist"] and table.num_rows == 50
    longest = max(len(str(h).split("|")) for h in table.column("hist").to_pylist())
    assert longest <= 5
    assert main(["synth", "--history", "--truth", "deep", "--rows", "5", "--out",
                 str(tmp_path / "x.csv")]) == 2


def test_din_trains_predicts_and_serves_a_history_given_as_a_list(
        din: terarec.Model, files: tuple[Path, Path], tmp_path: Path) -> None:
    from terarec.serving.engine import ServingEngine

    train, valid = files
    assert din.schema.sequence_fields[0].max_len == 4
    metrics = din.evaluate(valid)
    assert np.isfinite(metrics["logloss"]) and 0.0 <= metrics["auc"] <= 1.0
    want = din.predict(valid)[:20]
    assert np.all(np.isfinite(want)) and np.ptp(want) > 0  # the rows differ
    din.export(str(tmp_path / "export"))
    engine = ServingEngine(tmp_path / "export")
    engine.refresh()
    rows = pa_csv.read_csv(valid, convert_options=pa_csv.ConvertOptions(
        column_types={"user": "string", "item": "string", "hist": "string"})).to_pylist()[:20]
    records = [{"user": r["user"], "item": r["item"],
                "hist": r["hist"].split("|") if r["hist"] else []} for r in rows]
    got, _ = engine.score_records(records)
    assert np.allclose(got, want, atol=1e-5)
    # the history in the context, candidates per item: each scored as its own row
    ctx = {"user": records[0]["user"], "hist": records[0]["hist"]}
    one, _ = engine.score_records([{"item": r["item"]} for r in records[:5]], context=ctx)
    each, _ = engine.score_records([{**ctx, "item": r["item"]} for r in records[:5]])
    assert np.allclose(one, each, atol=1e-6)
    engine.close()


def test_a_tiered_store_trains_the_same_sequence_model(
        din: terarec.Model, files: tuple[Path, Path], tmp_path: Path) -> None:
    train, valid = files
    tiered = terarec.fit(train, valid, out=tmp_path / "tiered", model="din", progress=False,
                         epochs=1, batch_size=256, refit=False,
                         store={"memory_budget": "60KB"}, **DATA)
    assert tiered.config.store.memory_budget is not None
    assert np.allclose(tiered.predict(valid), din.predict(valid), atol=1e-5)


def test_train_cli_takes_sequence_and_share_table(files: tuple[Path, Path],
                                                  tmp_path: Path, capsys) -> None:
    train, valid = files

    def run(sequence: str, *extra: str) -> int:
        return main(["train", "--train", str(train), "--valid", str(valid), "--out",
                     str(tmp_path / "m"), "--format", "csv", "--label", "label",
                     "--categorical", "user,item", "--sequence", sequence,
                     "--share-table", "hist=item", "--model", "seqpool", "--epochs", "1",
                     "--batch-size", "512", "--no-progress", *extra])

    assert run("hist:3") == 0
    capsys.readouterr()
    assert run("hist:5", "--resume") == 2  # another length: other columns
    assert "fields differs" in capsys.readouterr().err
    schema = terarec.load(tmp_path / "m").schema
    hist = schema.sequence_fields[0]
    assert (hist.name, hist.max_len, hist.key_space) == ("hist", 3, "item")


def test_v2_infer_takes_the_history_as_a_list_per_row(
        din: terarec.Model, files: tuple[Path, Path], tmp_path: Path) -> None:
    """A KServe v2 request carries a sequence field as a joined string, a JSON list per
    row or an [N, L] tensor padded with empty strings (JSON or binary): each scores as
    ``Model.predict`` does."""
    from fastapi.testclient import TestClient

    from terarec.serving import binary
    from terarec.serving.app import create_app
    from terarec.serving.engine import ServingEngine

    _, valid = files
    n = 24
    want = din.predict(valid)[:n]
    din.export(str(tmp_path / "export"))
    rows = pa_csv.read_csv(valid, convert_options=pa_csv.ConvertOptions(
        column_types={"user": "string", "item": "string", "hist": "string"})).to_pylist()[:n]
    hists = [r["hist"].split("|") if r["hist"] else [] for r in rows]
    width = max(len(h) for h in hists)
    assert min(len(h) for h in hists) < width  # some rows are padded
    padded = [h + [""] * (width - len(h)) for h in hists]
    base = [{"name": f, "datatype": "BYTES", "shape": [n], "data": [r[f] for r in rows]}
            for f in ("user", "item")]
    forms = [
        {"datatype": "BYTES", "shape": [n], "data": [r["hist"] or "" for r in rows]},
        {"datatype": "BYTES", "shape": [n, 1], "data": [[r["hist"] or ""] for r in rows]},
        {"datatype": "BYTES", "shape": [n], "data": hists},
        {"datatype": "BYTES", "shape": [n, width], "data": padded},
        {"datatype": "BYTES", "shape": [n, width], "data": [v for p in padded for v in p]},
        {"datatype": "INT64", "shape": [n, width],
         "data": [[int(v) if v else None for v in p] for p in padded]}]
    engine = ServingEngine(tmp_path / "export")
    engine.refresh()
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        shapes = {i["name"]: i["shape"] for i in client.get("/v2/models/terarec").json()[
            "inputs"]}
        assert shapes == {"user": [-1], "item": [-1], "hist": [-1, -1]}

        def infer(hist: dict) -> np.ndarray:
            r = client.post("/v2/models/terarec/infer",
                            json={"inputs": [*base, {"name": "hist", **hist}]})
            assert r.status_code == 200, (hist["shape"], r.text)
            return np.asarray(r.json()["outputs"][0]["data"])

        for form in forms:
            np.testing.assert_allclose(infer(form), want, atol=1e-5)
        # the history is read, not dropped: without it the scores differ
        empty = infer({"datatype": "BYTES", "shape": [n], "data": [[]] * n})
        assert np.abs(empty - want).max() > 1e-4  # 10x the tolerance the forms match to
        # binary tensor data: the padded [N, L] BYTES tensor
        tensors = [(f, [n], binary.encode_bytes([r[f] for r in rows])) for f in ("user", "item")]
        tensors.append(("hist", [n, width], binary.encode_bytes([v for p in padded for v in p])))
        head = json.dumps({"inputs": [
            {"name": f, "datatype": "BYTES", "shape": s,
             "parameters": {"binary_data_size": len(b)}} for f, s, b in tensors]}).encode()
        r = client.post("/v2/models/terarec/infer", content=head + b"".join(
            b for _, _, b in tensors), headers={binary.HEADER: str(len(head))})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["outputs"][0]["data"], want, atol=1e-5)
        # a row of the wrong width, and [N, L] for a single-valued field, are refused
        bad = client.post("/v2/models/terarec/infer", json={"inputs": [*base[:1], {
            "name": "hist", "datatype": "BYTES", "shape": [n, width],
            "data": [*padded[:-1], padded[-1][:-1]]}]})
        assert bad.status_code == 422 and f"every row of 'data' must hold {width}" in bad.text
        bad = client.post("/v2/models/terarec/infer", json={"inputs": [
            {"name": "user", "datatype": "BYTES", "shape": [n, 2], "data": padded[0] * n}]})
        assert bad.status_code == 422 and "shape must be [N] or [N, 1]" in bad.text
    engine.close()
