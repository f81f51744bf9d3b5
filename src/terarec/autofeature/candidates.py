"""Candidate features: which SQL aggregates over the training data might help the model.

Three kinds, each one ``GROUP BY`` over the training rows, later joined back on its keys:

    count(C3)            SELECT C3, count(*)         ... GROUP BY C3
    cross_count(C3,C7)   SELECT C3, C7, count(*)     ... GROUP BY C3, C7
    max(I5)_by(C3)       SELECT C3, max(I5)          ... GROUP BY C3     (also min, avg, sum)

``enumerate_candidates`` proposes a bounded set of them for a schema; validation rejects
ones that could not be computed, with the reason, before any file is read.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from terarec.types import FeatureSchema

CandidateKind = Literal["count", "cross_count", "groupby"]
Aggregate = Literal["max", "min", "avg", "sum"]

ALL_KINDS: tuple[CandidateKind, ...] = get_args(CandidateKind)
ALL_AGGREGATES: tuple[Aggregate, ...] = get_args(Aggregate)

_GROUPBY_NAME = re.compile(r"^(max|min|avg|sum)\((.+)\)_by\((.+)\)$")
_KEYED_NAME = re.compile(r"^(count|cross_count)\((.+)\)$")


class AutoFeatureError(ValueError):
    """A candidate, schema or training range that cannot produce features."""


@dataclass(frozen=True)
class Candidate:
    """One aggregate feature.

    ``columns`` are the source columns: ``(key,)`` for count, ``(key_a, key_b)`` for
    cross_count, ``(value, key)`` for groupby (read as "agg of value by key").
    """

    kind: CandidateKind
    columns: tuple[str, ...]
    agg: Aggregate | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", tuple(self.columns))

    @property
    def keys(self) -> tuple[str, ...]:
        """The GROUP BY columns, which are also the join keys when the feature is applied."""
        return self.columns[1:] if self.kind == "groupby" else self.columns

    @property
    def value_column(self) -> str | None:
        """The aggregated numeric column of a groupby candidate; None for counts."""
        return self.columns[0] if self.kind == "groupby" else None

    @property
    def is_count(self) -> bool:
        return self.kind in ("count", "cross_count")

    @property
    def name(self) -> str:
        """Stable, human-readable name; also the name of the column the feature adds."""
        if self.kind == "groupby":
            return f"{self.agg}({self.columns[0]})_by({','.join(self.columns[1:])})"
        return f"{self.kind}({','.join(self.columns)})"

    @classmethod
    def from_name(cls, name: str) -> Candidate:
        """Parse a name written by ``name`` (e.g. from a feature config listing kept ones)."""
        if m := _GROUPBY_NAME.match(name):
            return cls("groupby", (m.group(2), *m.group(3).split(",")), m.group(1))  # type: ignore[arg-type]
        if m := _KEYED_NAME.match(name):
            return cls(m.group(1), tuple(m.group(2).split(",")))  # type: ignore[arg-type]
        raise AutoFeatureError(
            f"cannot parse candidate name {name!r}; expected count(A), cross_count(A,B) "
            "or max|min|avg|sum(V)_by(K)"
        )

    def to_dict(self) -> dict:
        return {"kind": self.kind, "columns": list(self.columns), "agg": self.agg}

    @classmethod
    def from_dict(cls, d: Mapping) -> Candidate:
        return cls(d["kind"], tuple(d["columns"]), d.get("agg"))

    def __str__(self) -> str:
        return self.name


def validate_candidates(candidates: Iterable[Candidate], schema: FeatureSchema) -> list[Candidate]:
    """Check every candidate against ``schema``; return them as a list or raise
    ``AutoFeatureError`` naming the candidate and what is wrong with it."""
    fields = {f.name: f for f in schema.fields}
    seen: set[str] = set()
    out = list(candidates)
    if not out:
        raise AutoFeatureError("no candidates given")
    for cand in out:
        where = f"candidate {cand.name}"
        if cand.kind not in ALL_KINDS:
            raise AutoFeatureError(f"{where}: unknown kind {cand.kind!r}; known: {ALL_KINDS}")
        expected = {"count": 1, "cross_count": 2, "groupby": 2}[cand.kind]
        if len(cand.columns) != expected:
            raise AutoFeatureError(
                f"{where}: {cand.kind} takes {expected} column(s), got {len(cand.columns)}"
            )
        if len(set(cand.columns)) != len(cand.columns):
            raise AutoFeatureError(f"{where}: a column appears twice")
        for col in cand.columns:
            if col == schema.label:
                raise AutoFeatureError(
                    f"{where}: uses the label column {col!r}; features must not see the label"
                )
            if col not in fields:
                raise AutoFeatureError(
                    f"{where}: unknown column {col!r}; the schema's fields are "
                    f"{', '.join(fields)}"
                )
        if cand.kind == "groupby":
            if cand.agg not in ALL_AGGREGATES:
                raise AutoFeatureError(
                    f"{where}: aggregate {cand.agg!r} is not one of {ALL_AGGREGATES}"
                )
            value = fields[cand.columns[0]]
            if value.kind != "numeric":
                raise AutoFeatureError(
                    f"{where}: {cand.agg} needs a numeric column, but {value.name!r} is "
                    f"{value.kind}"
                )
        elif cand.agg is not None:
            raise AutoFeatureError(f"{where}: {cand.kind} takes no aggregate, got {cand.agg!r}")
        if cand.name in seen:
            raise AutoFeatureError(f"{where}: listed twice")
        seen.add(cand.name)
    return out


def enumerate_candidates(
    schema: FeatureSchema,
    *,
    kinds: Sequence[CandidateKind] = ALL_KINDS,
    aggs: Sequence[Aggregate] = ALL_AGGREGATES,
    cardinalities: Mapping[str, int] | None = None,
    max_cross_pairs: int = 16,
    max_groupby_keys: int = 4,
) -> list[Candidate]:
    """Propose candidates for ``schema``, bounded so that computing them stays affordable.

    * count: every categorical field.
    * cross_count: pairs of categorical fields, at most ``max_cross_pairs``.
    * groupby: every numeric field x ``aggs`` by each of ``max_groupby_keys`` categorical keys.

    With ``cardinalities`` (distinct counts, see ``AutoFeatureEngine.cardinalities``),
    constant columns are dropped (their counts carry no information), cross pairs are taken
    in order of increasing cardinality product (a small product bounds the table size and
    keeps counts above 1, where they say something) and groupby keys are the
    lowest-cardinality fields (many rows per group, so the aggregate is a stable
    statistic). Without them, fields are taken in schema order.
    """
    unknown_kinds = set(kinds) - set(ALL_KINDS)
    if unknown_kinds:
        raise AutoFeatureError(f"unknown candidate kinds {sorted(unknown_kinds)}")
    bad_aggs = set(aggs) - set(ALL_AGGREGATES)
    if bad_aggs:
        raise AutoFeatureError(f"unknown aggregates {sorted(bad_aggs)}; known {ALL_AGGREGATES}")
    if max_cross_pairs < 0 or max_groupby_keys < 0:
        raise AutoFeatureError("max_cross_pairs and max_groupby_keys must be >= 0")

    categorical = [f.name for f in schema.categorical if f.name != schema.label]
    numeric = [f.name for f in schema.numeric if f.name != schema.label]
    if cardinalities is not None:
        missing = [c for c in categorical if c not in cardinalities]
        if missing:
            raise AutoFeatureError(f"cardinalities lack categorical fields {missing}")
        categorical = [c for c in categorical if cardinalities[c] > 1]
        # Stable sort: equal cardinalities keep schema order.
        by_cardinality = sorted(categorical, key=lambda c: cardinalities[c])
        pairs = sorted(itertools.combinations(categorical, 2),
                       key=lambda p: cardinalities[p[0]] * cardinalities[p[1]])
    else:
        by_cardinality = categorical
        pairs = list(itertools.combinations(categorical, 2))

    out: list[Candidate] = []
    if "count" in kinds:
        out += [Candidate("count", (c,)) for c in categorical]
    if "cross_count" in kinds:
        out += [Candidate("cross_count", p) for p in pairs[:max_cross_pairs]]
    if "groupby" in kinds:
        out += [Candidate("groupby", (value, key), agg)
                for key in by_cardinality[:max_groupby_keys]
                for value in numeric
                for agg in aggs]
    return out
