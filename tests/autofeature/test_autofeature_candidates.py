"""Candidate naming, enumeration and validation (no files read)."""

from __future__ import annotations

import itertools

import pytest

from terarec.autofeature import (
    ALL_AGGREGATES,
    AutoFeatureError,
    Candidate,
    enumerate_candidates,
    validate_candidates,
)
from terarec.types import FeatureSchema, FieldSpec

CRITEO = FeatureSchema.criteo()


def test_names_are_stable_and_parse_back():
    cands = [Candidate("count", ("C3",)), Candidate("cross_count", ("C3", "C7")),
             Candidate("groupby", ("I5", "C3"), "max")]
    assert [c.name for c in cands] == ["count(C3)", "cross_count(C3,C7)", "max(I5)_by(C3)"]
    assert [Candidate.from_name(c.name) for c in cands] == cands
    assert [Candidate.from_dict(c.to_dict()) for c in cands] == cands
    assert cands[2].keys == ("C3",) and cands[2].value_column == "I5"
    assert cands[1].keys == ("C3", "C7") and cands[1].value_column is None


@pytest.mark.parametrize("bad", ["C3", "count C3", "median(I5)_by(C3)", "max(I5)"])
def test_unparseable_names_are_rejected(bad):
    with pytest.raises(AutoFeatureError, match="cannot parse"):
        Candidate.from_name(bad)


def test_enumerate_without_cardinalities_takes_schema_order():
    cands = enumerate_candidates(CRITEO, max_cross_pairs=3, max_groupby_keys=2)
    counts = [c for c in cands if c.kind == "count"]
    crosses = [c for c in cands if c.kind == "cross_count"]
    groupbys = [c for c in cands if c.kind == "groupby"]
    assert [c.columns for c in counts] == [(f"C{i}",) for i in range(1, 27)]
    assert [c.columns for c in crosses] == [("C1", "C2"), ("C1", "C3"), ("C1", "C4")]
    assert {c.keys for c in groupbys} == {("C1",), ("C2",)}
    assert len(groupbys) == 2 * 13 * len(ALL_AGGREGATES)
    assert len({c.name for c in cands}) == len(cands)
    validate_candidates(cands, CRITEO)  # everything proposed is computable


def test_enumerate_with_cardinalities_prefers_small_tables_and_drops_constants():
    card = {f"C{i}": 1000 + 37 * i for i in range(1, 27)}
    card.update({"C4": 1, "C9": 3, "C20": 3, "C6": 7, "C22": 10})
    cands = enumerate_candidates(CRITEO, cardinalities=card, max_cross_pairs=5,
                                 max_groupby_keys=3, aggs=("avg",))
    assert "count(C4)" not in {c.name for c in cands}  # constant: no information
    crosses = [c.columns for c in cands if c.kind == "cross_count"]
    products = [card[a] * card[b] for a, b in crosses]
    usable = [c for c in card if card[c] > 1]
    all_products = sorted(card[a] * card[b] for a, b in itertools.combinations(usable, 2))
    assert products == all_products[:5]
    assert crosses[0] == ("C9", "C20")
    assert all("C4" not in pair for pair in crosses)
    keys = [c.keys[0] for c in cands if c.kind == "groupby"]
    assert list(dict.fromkeys(keys)) == ["C9", "C20", "C6"]


def test_enumerate_kinds_filter_and_bad_arguments():
    only_counts = enumerate_candidates(CRITEO, kinds=("count",))
    assert {c.kind for c in only_counts} == {"count"}
    with pytest.raises(AutoFeatureError, match="kinds"):
        enumerate_candidates(CRITEO, kinds=("ratio",))
    with pytest.raises(AutoFeatureError, match="aggregates"):
        enumerate_candidates(CRITEO, aggs=("median",))
    with pytest.raises(AutoFeatureError, match="C26"):
        enumerate_candidates(CRITEO, cardinalities={"C1": 5})


@pytest.mark.parametrize(("cand", "message"), [
    (Candidate("count", ("C99",)), "unknown column 'C99'"),
    (Candidate("cross_count", ("C1", "I99")), "unknown column 'I99'"),
    (Candidate("groupby", ("C5", "C3"), "max"), "max needs a numeric column, but 'C5' is "
                                                "categorical"),
    (Candidate("groupby", ("I5", "C3"), "median"), "aggregate 'median'"),
    (Candidate("groupby", ("I5", "C3")), "aggregate None"),
    (Candidate("count", ("C3",), "max"), "takes no aggregate"),
    (Candidate("count", ("label",)), "label"),
    (Candidate("groupby", ("label", "C3"), "avg"), "label"),
    (Candidate("cross_count", ("C3",)), "takes 2 column"),
    (Candidate("cross_count", ("C3", "C3")), "appears twice"),
])
def test_validation_names_the_candidate_and_the_problem(cand, message):
    with pytest.raises(AutoFeatureError, match=message) as info:
        validate_candidates([cand], CRITEO)
    assert cand.name in str(info.value)


def test_validation_rejects_duplicates_and_empty_lists():
    with pytest.raises(AutoFeatureError, match="listed twice"):
        validate_candidates([Candidate("count", ("C3",))] * 2, CRITEO)
    with pytest.raises(AutoFeatureError, match="no candidates"):
        validate_candidates([], CRITEO)


def test_counting_a_numeric_column_is_allowed():
    schema = FeatureSchema(label="y", fields=(FieldSpec("age", "numeric"),
                                              FieldSpec("city", "categorical")))
    ok = [Candidate("count", ("age",)), Candidate("groupby", ("age", "city"), "sum")]
    assert validate_candidates(ok, schema) == ok
