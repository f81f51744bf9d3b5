"""Synthetic click logs with a planted behaviour-sequence effect (``terarec synth
--history``).

Each row is a user, a candidate item and the user's recent items (oldest first,
``|``-separated), the columns ``label,user,item,hist``. Items fall into topics; a user
favours a few topics and most of the history comes from them. The click probability
depends on the similarity between the candidate and the history::

    logit = bias + pop[item] + effect * [some history item shares the candidate's topic]

The effect saturates (one matching item is as good as five), so it is the candidate's
relation to individual history items that matters, not the pooled history: what target
attention (DIN) is for. Its AUC from the true probabilities is the ceiling any model can
reach, reported with the data. Everything is a function of ``seed`` (the truth) and
``sample_seed`` (the rows): a train and a validation file share one truth.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
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

    users: int = 5000
    items: int = 2000
    topics: int = 100
    favourite_topics: int = 3
    max_history: int = 50
    min_history: int = 1
    # share of history items (and of candidates) drawn from the user's favourite topics
    from_favourites: float = 0.7
    candidate_from_favourites: float = 0.3
    effect: float = 2.5
    popularity_std: float = 0.3
    bias: float = -2.0

    def check(self) -> None:
        if min(self.users, self.items, self.topics, self.favourite_topics) < 1:
            raise ValueError("users, items, topics and favourite_topics must be positive")
        if self.topics > self.items:
            raise ValueError(f"topics ({self.topics}) must not exceed items ({self.items})")
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
    topic_of = world.permutation(np.arange(s.items) % s.topics)  # every topic has items
    by_topic = [np.flatnonzero(topic_of == t) for t in range(s.topics)]
    favourites = np.stack([world.choice(s.topics, s.favourite_topics, replace=False)
                           for _ in range(s.users)])
    popularity = world.normal(0.0, s.popularity_std, s.items)

    rng = np.random.default_rng([seed, sample_seed, 0x0E5])

    def items_of(topics: np.ndarray) -> np.ndarray:
        sizes = np.array([len(by_topic[t]) for t in range(s.topics)])
        pick = (rng.random(len(topics)) * sizes[topics]).astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        flat = np.concatenate(by_topic)
        return flat[starts[topics] + pick]

    def draw_topics(users: np.ndarray, share: float) -> np.ndarray:
        fav = favourites[users, rng.integers(0, s.favourite_topics, len(users))]
        other = rng.integers(0, s.topics, len(users))
        return np.where(rng.random(len(users)) < share, fav, other)

    users = rng.integers(0, s.users, rows)
    lengths = rng.integers(s.min_history, s.max_history + 1, rows)
    owner = np.repeat(users, lengths)
    hist = items_of(draw_topics(owner, s.from_favourites))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    items = items_of(draw_topics(users, s.candidate_from_favourites))
    same = topic_of[hist] == np.repeat(topic_of[items], lengths)
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
