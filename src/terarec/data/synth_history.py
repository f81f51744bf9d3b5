"""Synthetic click logs with a planted behaviour-sequence effect (``terarec synth
--history``).

Each row is a user, a candidate item and the user's recent items (oldest first,
``|``-separated), the columns ``label,user,item,hist``. Items fall into topics, each
split into subtopics; a user favours a few topics, and most of the history and many
candidates come from them. The click probability depends on the similarity between the
candidate and the history's items::

    logit = bias + pop[item] + effect * [some history item is in the candidate's subtopic]

A pooled history tells which topics a user likes, which the user's id tells too; only
matching the candidate against the history's items one by one says whether this
subtopic was among them, and the effect saturates (one match counts as much as five):
what target attention (DIN) is for. Its AUC from the true probabilities is the ceiling any model can
reach, reported with the data. Everything is a function of ``seed`` (the truth) and
``sample_seed`` (the rows): a train and a validation file share one truth.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from terarec.data.synth import _AUCHistogram
from terarec.io import atomic_open, atomic_write_text

COLUMNS = ("label", "user", "item", "hist")


@dataclass(frozen=True)
class HistorySettings:
    """The planted world: sizes, history lengths and the effect's strength."""

    users: int = 1000
    items: int = 1000
    topics: int = 20
    subtopics: int = 25  # per topic: 2 items each at the defaults
    favourite_topics: int = 2
    max_history: int = 20
    min_history: int = 1
    # share of history items drawn from the user's favourite topics
    from_favourites: float = 0.8
    # share of candidates from the subtopic of one of the history's items, and from
    # the favourite topics (the rest: any topic)
    candidate_from_history: float = 0.4
    candidate_from_favourites: float = 0.3
    effect: float = 3.0
    popularity_std: float = 0.3
    bias: float = -2.0

    def with_items(self, items: int) -> HistorySettings:
        """These settings over ``items`` items: fewer items hold fewer subtopics (then
        topics), two items each at the least."""
        if items < 2:
            raise ValueError(f"--items must be at least 2 with --history, got {items}")
        subtopics = max(1, min(self.subtopics, items // (2 * self.topics)))
        topics = max(1, min(self.topics, items // (2 * subtopics)))
        return replace(self, items=items, topics=topics, subtopics=subtopics,
                       favourite_topics=min(self.favourite_topics, topics))

    def check(self) -> None:
        if min(self.users, self.items, self.topics, self.favourite_topics) < 1:
            raise ValueError("users, items, topics and favourite_topics must be positive")
        if self.topics * self.subtopics > self.items:
            raise ValueError(f"topics x subtopics ({self.topics * self.subtopics}) must not "
                             f"exceed items ({self.items})")
        if not 1 <= self.min_history <= self.max_history:
            raise ValueError(f"history lengths: need 1 <= min_history ({self.min_history}) "
                             f"<= max_history ({self.max_history})")


@dataclass
class HistoryInfo:
    """What ``generate_history`` wrote; saved as ``<path>.truth.json`` beside it."""

    rows: int
    ctr: float
    ceiling_auc: float
    path: str
    seed: int
    sample_seed: int
    max_history: int


@dataclass
class HistoryRows:
    """Rows in memory: ids, histories (``hist_offsets`` into ``hist``), labels and the
    true click probabilities."""

    users: np.ndarray
    items: np.ndarray
    hist: np.ndarray
    hist_offsets: np.ndarray
    labels: np.ndarray
    probs: np.ndarray


def draw_rows(rows: int, settings: HistorySettings, seed: int = 0,
              sample_seed: int = 0) -> HistoryRows:
    """``rows`` rows of the world ``seed`` makes, drawn with ``sample_seed``."""
    settings.check()
    s = settings
    world = np.random.default_rng([seed, 0x5E9])
    # every subtopic has items; subtopic t * subtopics + j belongs to topic t
    subtopic_of = world.permutation(np.arange(s.items) % (s.topics * s.subtopics))
    topic_of = subtopic_of // s.subtopics
    by_topic = [np.flatnonzero(topic_of == t) for t in range(s.topics)]
    by_subtopic = [np.flatnonzero(subtopic_of == t) for t in range(s.topics * s.subtopics)]
    favourites = np.stack([world.choice(s.topics, s.favourite_topics, replace=False)
                           for _ in range(s.users)])
    popularity = world.normal(0.0, s.popularity_std, s.items)

    rng = np.random.default_rng([seed, sample_seed, 0x0E5])

    def members(groups: list[np.ndarray], of: np.ndarray) -> np.ndarray:
        """A uniform item of group ``of[i]`` for each i."""
        sizes = np.array([len(g) for g in groups])
        pick = (rng.random(len(of)) * sizes[of]).astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        return np.concatenate(groups)[starts[of] + pick]

    def items_of(topics: np.ndarray) -> np.ndarray:
        return members(by_topic, topics)

    def draw_topics(users: np.ndarray, share: float) -> np.ndarray:
        fav = favourites[users, rng.integers(0, s.favourite_topics, len(users))]
        other = rng.integers(0, s.topics, len(users))
        return np.where(rng.random(len(users)) < share, fav, other)

    users = rng.integers(0, s.users, rows)
    lengths = rng.integers(s.min_history, s.max_history + 1, rows)
    owner = np.repeat(users, lengths)
    hist = items_of(draw_topics(owner, s.from_favourites))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    items = items_of(draw_topics(users, s.candidate_from_favourites
                                 / max(1e-9, 1.0 - s.candidate_from_history)))
    # a candidate like one of the history's items: an item of its subtopic
    seen = hist[offsets[:-1] + (rng.random(rows) * lengths).astype(np.int64)]
    like = members(by_subtopic, subtopic_of[seen])
    items = np.where(rng.random(rows) < s.candidate_from_history, like, items)
    same = subtopic_of[hist] == np.repeat(subtopic_of[items], lengths)
    matched = np.add.reduceat(same.astype(np.int64), offsets[:-1]) > 0
    logits = s.bias + popularity[items] + s.effect * matched
    probs = 1.0 / (1.0 + np.exp(-logits))
    labels = (rng.random(rows) < probs).astype(np.float32)
    return HistoryRows(users, items, hist, offsets, labels, probs)


def ceiling_auc(part: HistoryRows) -> float:
    """The AUC of the true probabilities on these rows: what no model can beat."""
    score = _AUCHistogram()
    score.add(part.probs, part.labels)
    return score.auc()


def _table(part: HistoryRows) -> pa.Table:
    names = pa.array(part.hist.astype(str))
    hist = pa.ListArray.from_arrays(pa.array(part.hist_offsets.astype(np.int32)), names)
    joined = pc.binary_join(hist, "|")
    return pa.table({"label": part.labels.astype(np.int64),
                     "user": pa.array(np.char.add("u", part.users.astype(str))),
                     "item": pa.array(part.items.astype(str)), "hist": joined})


def generate_history(path: str | Path, rows: int, *, seed: int = 0, sample_seed: int = 0,
                     settings: HistorySettings | None = None) -> HistoryInfo:
    """Write ``rows`` rows (CSV with a header: ``label,user,item,hist``) to ``path``
    atomically, and ``<path>.truth.json`` with the CTR and the ceiling AUC."""
    if rows <= 0:
        raise ValueError(f"rows must be positive, got {rows}")
    settings = settings or HistorySettings()
    part = draw_rows(rows, settings, seed, sample_seed)
    path = Path(path)
    with atomic_open(path, "wb") as fh:
        pa_csv.write_csv(_table(part), fh, pa_csv.WriteOptions(quoting_style="none"))
    info = HistoryInfo(rows=rows, ctr=float(part.labels.mean()),
                       ceiling_auc=ceiling_auc(part), path=str(path), seed=seed,
                       sample_seed=sample_seed, max_history=settings.max_history)
    atomic_write_text(path.with_name(path.name + ".truth.json"),
                      json.dumps(asdict(info), indent=2))
    return info
