"""Selection by measured validation AUC gain finds the features planted in the labels."""

from __future__ import annotations

import pytest

from terarec.autofeature import AutoFeatureEngine, AutoFeatureError, compute_tables
from terarec.autofeature import enumerate_candidates as enumerate_
from terarec.autofeature.selection import (
    SelectionConfig,
    parquet_view,
    sample_rows,
    select_features,
)
from terarec.data.synth_features import generate_planted


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted")
    data = generate_planted(root / "train.csv", root / "valid.csv", 20_000, 5000, seed=3)
    with AutoFeatureEngine(memory_limit="256MB", threads=2) as engine:
        cands = enumerate_(data.schema, kinds=("count", "cross_count"),
                           cardinalities=engine.cardinalities(data.train, data.schema))
        tables = compute_tables(cands, data.train, data.schema, root / "tables", engine=engine)
        train = sample_rows(data.train, data.schema, 20_000, root / "t.parquet", engine=engine)
        valid = sample_rows(data.valid, data.schema, 5000, root / "v.parquet", engine=engine)
        yield data, tables, train, valid, engine


def select(planted, **overrides):
    data, tables, train, valid, engine = planted
    return select_features(tables, parquet_view(data.schema), train, valid,
                           SelectionConfig(**overrides), engine=engine)


def test_planted_features_are_selected_first(planted):
    data, tables = planted[:2]
    assert set(data.planted) <= set(tables.names)
    result = select(planted, budget=4)
    assert set(result.selected[:2]) == set(data.planted)
    assert len(result.selected) <= 4
    # Every candidate was measured once alone; the planted pair stands out.
    assert sorted(g.name for g in result.gains) == sorted(tables.names)
    gains = {g.name: g.gain for g in result.gains}
    others = [v for k, v in gains.items() if k not in data.planted]
    assert gains["cross_count(C5,C7)"] > max(others) + 0.01
    assert gains["count(C3)"] > 0.001
    assert result.auc_selected > result.auc_raw + 0.02
    chosen = [g for g in result.gains if g.selected]
    assert sorted(g.round for g in chosen) == list(range(1, len(chosen) + 1))


def test_budget_and_min_gain_stop_the_search(planted):
    one = select(planted, budget=1)
    assert one.selected == [max(one.gains, key=lambda g: g.gain).name]
    # A threshold above every gain keeps nothing, and says so in the rounds.
    none = select(planted, min_gain=0.5)
    assert none.selected == [] and none.auc_selected == none.auc_raw
    assert none.rounds[0]["gain"] < 0.5
    assert none.evaluations == len(none.gains) + 1


def test_bad_selection_settings_are_refused():
    with pytest.raises(AutoFeatureError, match="lr or fm"):
        SelectionConfig(model="deepfm")
    with pytest.raises(AutoFeatureError, match="budget"):
        SelectionConfig(budget=-1)


def test_fm_selection_model_also_ranks_the_planted_pair_first(planted):
    result = select(planted, model="fm", budget=1)
    assert result.selected == ["cross_count(C5,C7)"]
    assert result.gain > 0.01
