"""Feature configs: saved and loaded with their tables, installed into model directories."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from autofeature_helpers import CRITEO, criteo_rows, write_tsv

from terarec.autofeature import AutoFeatureError, Candidate, compute_tables
from terarec.autofeature.features import (
    FeatureConfig,
    feature_inputs,
    install_features,
    model_features,
)

CANDIDATES = [Candidate("count", ("C3",)), Candidate("groupby", ("I1", "C3"), "avg"),
              Candidate("cross_count", ("C1", "C2"))]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("config")
    train = write_tsv(root / "train.txt", criteo_rows(500, seed=4))
    tables = compute_tables(CANDIDATES, train, CRITEO, root / "all")
    return FeatureConfig(CRITEO, tables.select(["count(C3)", "cross_count(C1,C2)"]),
                         {"gain": 0.01}), train


def test_save_load_round_trip_keeps_only_the_selected_tables(config, tmp_path):
    cfg, _ = config
    saved = cfg.save(tmp_path / "run" / "features.json")
    assert saved.tables.directory == tmp_path / "run" / "features.tables"
    assert sorted(p.name for p in saved.tables.directory.glob("*.parquet")) == \
        ["000-count_C3.parquet", "002-cross_count_C1_C2.parquet"]
    loaded = FeatureConfig.load(tmp_path / "run" / "features.json")
    assert loaded.base_schema == CRITEO
    assert loaded.selected == ("count(C3)", "cross_count(C1,C2)")
    assert loaded.selection == {"gain": 0.01}
    assert [f.name for f in loaded.schema.fields] == \
        [f.name for f in CRITEO.fields] + ["count(C3)", "cross_count(C1,C2)"]
    # The config and its tables move together: a relative path links them.
    moved = tmp_path / "elsewhere"
    (tmp_path / "run").rename(moved)
    assert FeatureConfig.load(moved / "features.json").selected == loaded.selected


def test_broken_configs_are_refused(config, tmp_path):
    cfg, _ = config
    path = tmp_path / "features.json"
    cfg.save(path)
    body = json.loads(path.read_text())
    path.write_text(json.dumps({**body, "selected": ["count(C3)"]}))
    with pytest.raises(AutoFeatureError, match="do not match"):
        FeatureConfig.load(path)
    path.write_text(json.dumps({**body, "version": 7}))
    with pytest.raises(AutoFeatureError, match="not a version 1"):
        FeatureConfig.load(path)
    path.write_text("{")
    with pytest.raises(AutoFeatureError, match="not valid JSON"):
        FeatureConfig.load(path)
    with pytest.raises(FileNotFoundError, match="no such feature config"):
        FeatureConfig.load(tmp_path / "absent.json")


def test_installed_features_augment_raw_files(config, tmp_path):
    cfg, train = config
    model = tmp_path / "model"
    assert model_features(model) is None
    installed = install_features(model, cfg)
    assert installed.tables.directory == model / "features"
    assert model_features(model).selected == cfg.selected
    with feature_inputs(installed, [train]) as paths:
        written = pq.read_table(paths[0])
        assert written.num_rows == 500
        assert written.column_names[-2:] == ["count(C3)", "cross_count(C1,C2)"]
    assert not paths[0].exists()  # temporary copies go away
    with feature_inputs(None, [train]) as same:
        assert same == [train]
