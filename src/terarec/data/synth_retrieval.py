"""Synthetic click logs with a planted user-item affinity, so retrieval quality (recall
of each user's true top items) can be measured.

The truth::

    item i   belongs to topic c(i) (uniform) and has popularity pop(i) (Zipf over a
             random permutation of the items)
    user u   likes TOPICS_PER_USER topics c with weights w(u, c) (Dirichlet(1))
    P(i | u) = w(u, c(i)) * pop(i) / Z(c(i))          Z(c) = sum of pop over topic c

A click row is a user drawn uniformly and an item drawn from ``P(i | u)`` (label 1); each
click is followed by ``negatives`` rows of the same user with an item drawn uniformly
(label 0), the usual pointwise training data. A user's true top-k items are the k largest
``P(i | u)``. Files (tab separated, with a header)::

    OUT           label  user  item  topic       the click log
    OUT.items     item  topic                    every item once: the catalog to index

Everything is a function of ``seed``; ``planted`` rebuilds the truth for evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from terarec.data.readers import csv_schema
from terarec.io import atomic_open
from terarec.types import FeatureSchema

TOPICS_PER_USER = 3
ZIPF_EXPONENT = 0.8
BLOCK_ROWS = 1 << 18
USER_FIELDS = ("user",)
ITEM_FIELDS = ("item", "topic")


@dataclass(frozen=True)
class Affinity:
    """The planted truth of ``users`` x ``items`` (see the module docstring)."""

    users: int
    items: int
    topics: int
    seed: int

    def __post_init__(self) -> None:
        if self.users < 1 or self.items < 2 or not 1 <= self.topics <= self.items:
            raise ValueError(f"synth --retrieval: need users >= 1, items >= 2 and 1 <= topics "
                             f"<= items; got {self.users}, {self.items}, {self.topics}")

    @cached_property
    def _items(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, 1])
        topic = rng.integers(0, self.topics, self.items)
        pop = (1.0 + rng.permutation(self.items)) ** -ZIPF_EXPONENT
        return topic, pop

    @property
    def item_topic(self) -> np.ndarray:
        return self._items[0]

    @cached_property
    def _by_topic(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Items ordered by topic, topic offsets, and the within-topic cumulative
        probability shifted by the topic number (one searchsorted draws any topic)."""
        topic, pop = self._items
        order = np.argsort(topic, kind="stable")
        offsets = np.searchsorted(topic[order], np.arange(self.topics + 1))
        z = np.add.reduceat(pop[order], offsets[:-1]) if self.items else np.empty(0)
        z = np.where(np.diff(offsets) > 0, z, 1.0)
        within = pop[order] / z[topic[order]]
        cum = np.cumsum(within)
        start = np.concatenate([[0.0], cum])[offsets[:-1]][topic[order]]
        return order, offsets, topic[order] + np.minimum(cum - start, 1.0)

    @cached_property
    def _users(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, 2])
        k = min(TOPICS_PER_USER, self.topics)
        liked = _distinct_topics(rng, self.users, self.topics, k)
        return liked, rng.dirichlet(np.ones(k), self.users)

    def probability(self, user: int) -> tuple[np.ndarray, np.ndarray]:
        """(items, P(item | user)) over the items of the user's topics."""
        order, offsets, _ = self._by_topic
        topic, pop = self._items
        liked, weights = self._users
        items = np.concatenate([order[offsets[c]:offsets[c + 1]] for c in liked[user]])
        w = dict(zip(liked[user].tolist(), weights[user].tolist(), strict=True))
        z = {c: float(pop[order[offsets[c]:offsets[c + 1]]].sum()) for c in liked[user]}
        prob = np.array([w[c] / z[c] for c in topic[items].tolist()]) * pop[items]
        return items, prob

    def true_top(self, users: np.ndarray, k: int) -> list[np.ndarray]:
        """Each user's ``k`` most likely items (fewer when the user's topics hold fewer)."""
        out = []
        for u in np.asarray(users).tolist():
            items, prob = self.probability(u)
            top = np.argsort(-prob, kind="stable")[:k]
            out.append(items[top])
        return out

    def draw(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``n`` clicks: (users, items)."""
        order, _, cum = self._by_topic
        liked, weights = self._users
        users = rng.integers(0, self.users, n)
        pick = (rng.random(n)[:, None] > np.cumsum(weights[users], axis=1)[:, :-1]).sum(1)
        topics = liked[users, pick]
        pos = np.searchsorted(cum, topics + rng.random(n) * (1 - 1e-12), side="right")
        return users, order[np.minimum(pos, self.items - 1)]


def _distinct_topics(rng: np.random.Generator, n: int, topics: int, k: int) -> np.ndarray:
    """``n`` rows of ``k`` distinct topics each (redrawn where a row repeats one)."""
    liked = rng.integers(0, topics, (n, k))
    while True:
        s = np.sort(liked, axis=1)
        bad = (s[:, 1:] == s[:, :-1]).any(axis=1)
        if not bad.any():
            return liked
        liked[bad] = rng.integers(0, topics, (int(bad.sum()), k))


def default_topics(items: int) -> int:
    """About sqrt(items) topics of about sqrt(items) items each."""
    return max(1, min(items, round(items ** 0.5)))


def retrieval_schema() -> FeatureSchema:
    """The schema of the click log ``write_retrieval`` writes."""
    return csv_schema("label", [], [*USER_FIELDS, *ITEM_FIELDS], delimiter="\t")


def catalog_path(path: str | Path) -> Path:
    return Path(f"{path}.items")


@dataclass(frozen=True)
class RetrievalInfo:
    path: Path
    catalog: Path
    rows: int
    clicks: int
    users: int
    items: int
    topics: int


def write_retrieval(path: str | Path, rows: int, *, users: int, items: int,
                    topics: int | None = None, negatives: int = 1,
                    seed: int = 0) -> RetrievalInfo:
    """Write ``rows`` rows (clicks and their ``negatives``) and the item catalog."""
    if rows < 1:
        raise ValueError(f"synth --retrieval: rows must be >= 1, got {rows}")
    if negatives < 0:
        raise ValueError(f"synth --retrieval: negatives must be >= 0, got {negatives}")
    truth = Affinity(users, items, topics or default_topics(items), seed)
    rng = np.random.default_rng([seed, 3])
    per = 1 + negatives
    options = pa_csv.WriteOptions(delimiter="\t", quoting_style="none", include_header=False)
    written = clicks = 0
    with atomic_open(path) as fh:
        fh.write(("\t".join(["label", *USER_FIELDS, *ITEM_FIELDS]) + "\n").encode())
        writer: pa_csv.CSVWriter | None = None
        while written < rows:
            n = min(BLOCK_ROWS, rows - written)
            c = -(-n // per)
            u, i = truth.draw(c, rng)
            user = np.repeat(u, per)[:n]
            item = np.repeat(i, per).reshape(c, per)
            item[:, 1:] = rng.integers(0, items, (c, negatives))
            item = item.reshape(-1)[:n]
            label = np.tile(np.r_[1, np.zeros(negatives, np.int8)], c)[:n].astype(np.int8)
            table = pa.table({"label": label, "user": user, "item": item,
                              "topic": truth.item_topic[item]})
            if writer is None:
                writer = pa_csv.CSVWriter(fh, table.schema, write_options=options)
            writer.write_table(table)
            written += n
            clicks += int(label.sum())
        assert writer is not None
        writer.close()
    catalog = catalog_path(path)
    with atomic_open(catalog) as fh:
        fh.write(("\t".join(ITEM_FIELDS) + "\n").encode())
        pa_csv.write_csv(pa.table({"item": np.arange(items), "topic": truth.item_topic}), fh,
                         write_options=options)
    return RetrievalInfo(Path(path), catalog, rows, clicks, users, items, truth.topics)
