"""The types every stage shares: ``KeyedIds`` (sparse keys), ``Batch`` and ``FeatureSchema``.

Everything between ingestion and the model flows through ``Batch``; the sparse part is
always a ``KeyedIds``. Keys are int64 from the hash to the store: never floats.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import Field

from terarec.validation import STRICT, InvalidInput, validate

if TYPE_CHECKING:  # imported where used: the schema and the command line's flags need neither
    import numpy as np
    import torch

FieldKind = Literal["numeric", "categorical"]
Pooling = Literal["sum", "mean"]
NumericTransform = Literal["none", "log1p"]


class KeyedIds:
    """A jagged set of int64 keys per (field, sample), field-major, like TorchRec's KJT.

    Stored state is just ``fields``, a flat ``values`` tensor and ``offsets``; lengths and
    per-field views are derived on demand. For fields ``a, b`` and a batch of 3 samples::

        sample:      0      1     2   |   0    1      2
        field:       a      a     a   |   b    b      b
        values:  [ 11,12 | 13 |   -   |  21 | 22 | 23,24 ]
        offsets: [ 0,    2,   3,  3,     4,   5,      7  ]     (len = F * B + 1)

    Sample ``i`` of field ``f`` holds ``values[offsets[f*B+i] : offsets[f*B+i+1]]``. An
    empty slot (missing multi-valued cell) pools to a zero vector.
    """

    __slots__ = ("fields", "values", "offsets", "__dict__")

    def __init__(self, fields: tuple[str, ...] | list[str], values: torch.Tensor,
                 offsets: torch.Tensor) -> None:
        import torch

        self.fields = tuple(fields)
        if values.dtype != torch.int64 or offsets.dtype != torch.int64:
            raise TypeError(
                f"KeyedIds needs int64 values and offsets, got {values.dtype} / {offsets.dtype}"
            )
        if len(self.fields) == 0:
            raise ValueError("KeyedIds needs at least one field")
        if (offsets.numel() - 1) % len(self.fields) != 0:
            raise ValueError(
                f"offsets has {offsets.numel()} entries; expected F*B+1 with F={len(self.fields)}"
            )
        self.values = values
        self.offsets = offsets

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_lengths(cls, fields: tuple[str, ...] | list[str], values: torch.Tensor,
                     lengths: torch.Tensor) -> KeyedIds:
        import torch

        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(lengths.to(torch.int64), 0, out=offsets[1:])
        return cls(fields, values, offsets)

    @classmethod
    def from_dense(cls, fields: tuple[str, ...] | list[str], ids: torch.Tensor) -> KeyedIds:
        """One key per (sample, field); ``ids`` is ``[B, F]`` int64."""
        import torch

        batch, num_fields = ids.shape
        values = ids.t().contiguous().view(-1)
        offsets = torch.arange(batch * num_fields + 1, dtype=torch.int64, device=ids.device)
        return cls(fields, values, offsets)

    # -- derived views ------------------------------------------------------------------
    @property
    def num_fields(self) -> int:
        return len(self.fields)

    @property
    def batch_size(self) -> int:
        return (self.offsets.numel() - 1) // len(self.fields)

    @cached_property
    def lengths(self) -> torch.Tensor:
        """Number of keys per (field, sample), field-major, shape ``[F * B]``."""
        return self.offsets[1:] - self.offsets[:-1]

    @cached_property
    def one_per_slot(self) -> bool:
        """True when every (field, sample) holds exactly one key: the fast path."""
        import numpy as np
        import torch

        if self.values.numel() != self.offsets.numel() - 1:
            return False
        if self.offsets.device.type == "cpu":  # numpy: no intra-op thread pool for a check
            offsets = self.offsets.numpy()
            return bool(np.array_equal(offsets, np.arange(len(offsets))))
        return bool(torch.equal(self.offsets, torch.arange(self.offsets.numel(),
                                                           device=self.offsets.device)))

    @cached_property
    def sample_major(self) -> torch.Tensor:
        """``[B, F]`` keys when ``one_per_slot``: lookups then yield ``[B, F, D]`` rows
        without transposing float tensors."""
        if not self.one_per_slot:
            raise ValueError("sample_major needs exactly one key per (field, sample)")
        return self.values.view(self.num_fields, self.batch_size).t().contiguous()

    def field_values(self, name: str) -> torch.Tensor:
        f = self.fields.index(name)
        b = self.batch_size
        return self.values[self.offsets[f * b]:self.offsets[(f + 1) * b]]

    def with_values(self, values: torch.Tensor) -> KeyedIds:
        """Same layout with replaced values (e.g. global keys remapped to local row ids)."""
        if values.shape != self.values.shape:
            raise ValueError(f"values shape {tuple(values.shape)} != {tuple(self.values.shape)}")
        out = KeyedIds(self.fields, values, self.offsets)
        for derived in ("lengths", "one_per_slot"):  # layout-only views carry over
            if derived in self.__dict__:
                out.__dict__[derived] = self.__dict__[derived]
        return out

    def select_fields(self, names: list[str] | tuple[str, ...]) -> KeyedIds:
        """A KeyedIds holding only ``names`` (in that order)."""
        import torch

        b = self.batch_size
        parts_v, parts_l = [], []
        for name in names:
            f = self.fields.index(name)
            lo, hi = int(self.offsets[f * b]), int(self.offsets[(f + 1) * b])
            parts_v.append(self.values[lo:hi])
            parts_l.append(self.lengths[f * b:(f + 1) * b])
        return KeyedIds.from_lengths(tuple(names), torch.cat(parts_v), torch.cat(parts_l))

    def slice(self, start: int, stop: int) -> KeyedIds:
        """Samples ``start:stop`` of every field."""
        import torch

        b = self.batch_size
        stop = min(stop, b)
        parts_v, parts_l = [], []
        for f in range(self.num_fields):
            lo = int(self.offsets[f * b + start])
            hi = int(self.offsets[f * b + stop])
            parts_v.append(self.values[lo:hi])
            parts_l.append(self.lengths[f * b + start:f * b + stop])
        return KeyedIds.from_lengths(self.fields, torch.cat(parts_v), torch.cat(parts_l))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedIds:
        return KeyedIds(self.fields, self.values.to(device, non_blocking=non_blocking),
                        self.offsets.to(device, non_blocking=non_blocking))

    @classmethod
    def one_per_slot_of(cls, fields: tuple[str, ...] | list[str], values: torch.Tensor
                        ) -> KeyedIds:
        """One key per (field, sample): ``values`` field-major ``[F * B]``. The offsets
        (``arange``) are shared per size, since no KeyedIds writes its offsets, and the fast
        path is known without checking them."""
        out = cls(fields, values, _slot_offsets(values.numel()))
        out.__dict__["one_per_slot"] = True  # the cached_property, known by construction
        return out

    @staticmethod
    def concat(parts: list[KeyedIds]) -> KeyedIds:
        """Concatenate along the batch dimension (same fields in the same order)."""
        import torch

        if not parts:
            raise ValueError("nothing to concatenate")
        fields_ = parts[0].fields
        if all(p.fields == fields_ and p.one_per_slot for p in parts):  # [F, B] blocks
            ids = torch.cat([p.values.view(len(fields_), -1) for p in parts], dim=1)
            return KeyedIds.one_per_slot_of(fields_, ids.reshape(-1))
        values, lengths = [], []
        for f in range(len(fields_)):
            for p in parts:
                if p.fields != fields_:
                    raise ValueError(f"field mismatch: {p.fields} vs {fields_}")
                b = p.batch_size
                values.append(p.values[p.offsets[f * b]:p.offsets[(f + 1) * b]])
                lengths.append(p.lengths[f * b:(f + 1) * b])
        return KeyedIds.from_lengths(fields_, torch.cat(values), torch.cat(lengths))

    def __repr__(self) -> str:
        return (f"KeyedIds(fields={len(self.fields)}, batch={self.batch_size}, "
                f"keys={self.values.numel()})")



@lru_cache(maxsize=1024)
def _slot_offsets(slots: int) -> torch.Tensor:
    """``arange(slots + 1)``: the offsets of one key per slot, built once per size."""
    import torch

    return torch.arange(slots + 1, dtype=torch.int64)

@dataclass
class Batch:
    """One minibatch: ``dense`` float32 ``[B, D]``, ``sparse`` keys, ``labels`` float32
    ``[B]`` (``[B, T]`` for a schema with T > 1 labels, in ``task_names`` order)."""

    dense: torch.Tensor
    sparse: KeyedIds
    labels: torch.Tensor

    def __post_init__(self) -> None:
        b = self.labels.shape[0]
        if self.dense.shape[0] != b or self.sparse.batch_size != b:
            raise ValueError(
                f"batch sizes differ: dense {self.dense.shape[0]}, "
                f"sparse {self.sparse.batch_size}, labels {b}"
            )

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(self.dense.to(device, non_blocking=non_blocking),
                     self.sparse.to(device, non_blocking=non_blocking),
                     self.labels.to(device, non_blocking=non_blocking))

    def slice(self, start: int, stop: int) -> Batch:
        return Batch(self.dense[start:stop], self.sparse.slice(start, stop),
                     self.labels[start:stop])

    @staticmethod
    def concat(parts: list[Batch]) -> Batch:
        import torch

        return Batch(torch.cat([p.dense for p in parts]),
                     KeyedIds.concat([p.sparse for p in parts]),
                     torch.cat([p.labels for p in parts]))


@dataclass(frozen=True)
class FieldSpec:
    """One input column. ``separator`` makes a categorical cell multi-valued (CSV);
    Parquet list columns are multi-valued without one.

    A numeric field feeds ``transform(x)``, standardised as ``(transform(x) - mean) / std``
    when the statistics are set (``terarec.data.numeric``; schemas saved without them
    feed ``transform(x)`` as they always did). With ``buckets`` (increasing edges on
    ``transform(x)``) it also feeds one categorical key per row: the index of its bucket,
    so the model learns a weight and an embedding per value range."""

    __pydantic_config__ = STRICT

    name: str
    kind: FieldKind
    transform: NumericTransform = "none"
    separator: str | None = None
    pooling: Pooling = "sum"
    mean: float | None = None
    std: Annotated[float, Field(gt=0)] | None = None
    buckets: tuple[float, ...] | None = None
    # A sequence field (``terarec.data.sequences``): the most recent ``max_len`` values
    # of an ordered multi-valued cell, kept in order rather than pooled.
    max_len: Annotated[int, Field(ge=1)] | None = None
    # The key space (embedding table) the field hashes into; None: its own name.
    table: str | None = None

    @property
    def key_space(self) -> str:
        """The name keys are hashed with: the shared table's, else the field's own, so
        fields naming one table map a value to one key (and one row)."""
        return self.table if self.table is not None else self.name

    @property
    def slots(self) -> tuple[FieldSpec, ...]:
        """The slots the field occupies in ``Batch.sparse``: itself, or ``max_len``
        slots ``name#0`` .. of a sequence field (``terarec.data.sequences``); each keeps
        the separator, since a slot may be empty."""
        if self.max_len is None:
            return (self,)
        return tuple(replace(self, name=f"{self.name}#{i}", pooling="sum")
                     for i in range(self.max_len))

    @property
    def sparse(self) -> bool:
        """True when the field feeds a key per row (categorical, or bucketed numeric)."""
        return self.kind == "categorical" or self.buckets is not None


SCHEMA_VERSION = 1


_Derived = TypeVar("_Derived")


def per_schema(build: Callable[[FeatureSchema], _Derived]
               ) -> Callable[[FeatureSchema], _Derived]:
    """``build(schema)`` computed once per schema object, as ``cached_property`` does for
    the schema's own fields: a reader or a server keeps one schema and needs what other
    packages derive from it on every batch. Kept in the schema's ``__dict__``, so it
    lives as long as the schema and never outlives a replaced one."""
    slot = f"_per_schema:{build.__module__}.{build.__qualname__}"

    def get(schema: FeatureSchema) -> _Derived:
        try:
            return schema.__dict__[slot]
        except KeyError:
            value = schema.__dict__[slot] = build(schema)
            return value

    get.__doc__ = build.__doc__
    return get


@dataclass(frozen=True)
class FeatureSchema:
    """How raw columns become a Batch; saved as JSON beside every model so that serving
    parses and hashes exactly as training did."""

    __pydantic_config__ = STRICT

    label: str
    fields: tuple[FieldSpec, ...]
    hash_salt: str = "terarec-v1"
    missing_flags: bool = True
    format: str = "csv"
    delimiter: str = ","
    has_header: bool = True
    column_names: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    # Several labels (multi-task models): the columns after ``label``, and each task's
    # weight in the training loss (empty: 1 each). Left out of the JSON when empty, so a
    # one-label schema reads and writes as before.
    extra_labels: tuple[str, ...] = ()
    label_weights: tuple[float, ...] = ()

    @property
    def task_names(self) -> tuple[str, ...]:
        """The label columns, one task each: ``label`` first."""
        return (self.label, *self.extra_labels)

    @property
    def num_tasks(self) -> int:
        return 1 + len(self.extra_labels)

    @property
    def task_weights(self) -> tuple[float, ...]:
        """Each task's loss weight (1 where none was given)."""
        return self.label_weights or (1.0,) * self.num_tasks

    @cached_property
    def numeric(self) -> tuple[FieldSpec, ...]:
        return tuple(f for f in self.fields if f.kind == "numeric")

    @cached_property
    def categorical(self) -> tuple[FieldSpec, ...]:
        return tuple(f for f in self.fields if f.kind == "categorical")

    @cached_property
    def key_fields(self) -> tuple[FieldSpec, ...]:
        """The fields that feed keys, one entry each: the categorical fields, then the
        bucketed numeric ones."""
        return self.categorical + tuple(f for f in self.numeric if f.buckets is not None)

    @cached_property
    def sparse_fields(self) -> tuple[FieldSpec, ...]:
        """The slots of ``Batch.sparse`` (and of the model's embedding rows), in order:
        ``key_fields``, each sequence field spread over ``max_len`` slots named
        ``name#0`` .. (oldest kept value first, empty slots after the last), so every
        lookup, store and rank handles a sequence as ordinary fields."""
        if not any(f.max_len for f in self.categorical):
            return self.key_fields
        return tuple(s for f in self.key_fields for s in f.slots)

    @cached_property
    def sequence_fields(self) -> tuple[FieldSpec, ...]:
        return tuple(f for f in self.categorical if f.max_len is not None)

    @cached_property
    def sparse_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.sparse_fields)

    @cached_property
    def dense_dim(self) -> int:
        """Width of ``Batch.dense``: each numeric value, plus a missing flag if enabled."""
        return len(self.numeric) * (2 if self.missing_flags else 1)

    @classmethod
    def criteo(cls, hash_salt: str = "terarec-v1", missing_flags: bool = True) -> FeatureSchema:
        """Criteo Kaggle ``train.txt``: label, I1..I13 counts, C1..C26 hashed categoricals."""
        numeric = tuple(FieldSpec(f"I{i}", "numeric", transform="log1p") for i in range(1, 14))
        cats = tuple(FieldSpec(f"C{i}", "categorical") for i in range(1, 27))
        names = ("label",) + tuple(f.name for f in numeric + cats)
        return cls(label="label", fields=numeric + cats, hash_salt=hash_salt,
                   missing_flags=missing_flags, format="criteo", delimiter="\t",
                   has_header=False, column_names=names)

    def with_fields(self, extra_fields: tuple[FieldSpec, ...]) -> FeatureSchema:
        return replace(self, fields=self.fields + tuple(extra_fields))

    # -- persistence --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fields"] = [asdict(f) for f in self.fields]
        d["column_names"] = list(self.column_names)
        for key in ("extra_labels", "label_weights"):
            if d[key]:
                d[key] = list(d[key])
            else:
                del d[key]
        d["schema_version"] = SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "") -> FeatureSchema:
        """A schema from its JSON form, validated: a bad key, type or value (say
        ``"kind": "categorcal"``) is an ``InvalidInput`` naming its path."""
        prefix = f"{where}: " if where else ""
        if isinstance(d, dict) and "schema_version" in d:
            d = dict(d)
            version = d.pop("schema_version")
            if version != SCHEMA_VERSION:
                raise InvalidInput(f"{prefix}schema_version: {version!r} is not "
                                   f"{SCHEMA_VERSION}")
        schema = validate(cls, d, where, root="feature schema")
        names = [f.name for f in schema.fields]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise InvalidInput(f"{prefix}fields[{i}].name: {name!r} repeats "
                                   f"fields[{names.index(name)}]")
        if schema.label in names:
            raise InvalidInput(f"{prefix}label: {schema.label!r} is also an input field")
        for i, name in enumerate(schema.extra_labels):
            if name in names or name in schema.task_names[:i + 1]:
                raise InvalidInput(f"{prefix}extra_labels[{i}]: {name!r} is also an input "
                                   "field or another label")
        weights = schema.label_weights
        if weights and (len(weights) != schema.num_tasks
                        or not all(math.isfinite(w) and w >= 0 for w in weights)
                        or not any(weights)):
            raise InvalidInput(f"{prefix}label_weights: expected {schema.num_tasks} finite "
                               f"weights >= 0, not all 0, got {list(weights)}")
        for i, spec in enumerate(schema.fields):
            if spec.max_len is not None and (spec.kind != "categorical"
                                             or spec.separator is None):
                raise InvalidInput(f"{prefix}fields[{i}].max_len: only a multi-valued "
                                   "categorical field (with a separator) is a sequence")
            if spec.buckets is None:
                continue
            if spec.kind != "numeric":
                raise InvalidInput(f"{prefix}fields[{i}].buckets: only numeric fields are "
                                   "bucketed")
            edges = spec.buckets
            if not edges or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
                raise InvalidInput(f"{prefix}fields[{i}].buckets: expected a non-empty "
                                   "list of strictly increasing edges")
        return schema

    @cached_property
    def json_text(self) -> str:
        """What ``save`` writes, made once (a schema is immutable; a search writes it with
        every trial's checkpoints)."""
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        from terarec.io import atomic_write_text

        atomic_write_text(path, self.json_text)

    @classmethod
    def load(cls, path: str | Path) -> FeatureSchema:
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data, str(path))


def as_int64_tensor(array: np.ndarray) -> torch.Tensor:
    """Zero-copy int64 numpy -> torch, refusing anything that is not int64 already."""
    import numpy as np
    import torch

    if array.dtype != np.int64:
        raise TypeError(f"expected int64 keys, got {array.dtype}")
    return torch.from_numpy(np.ascontiguousarray(array))
