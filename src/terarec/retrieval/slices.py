"""Model slices: a named part of a model exported as an ordinary version, holding only its
fields' keys and the layers it needs, so that each serving group loads only its part.

::

    user_tower   dssm       the user fields' rows + user_tower.*    serves /retrieve
    item_tower   dssm       the item fields' rows + item_tower.*    input of `terarec index`
    wide         widedeep   every row's column 0 + bias, dense_linear.*   /predict (wide logit)
    deep         widedeep   every row's columns 1: + deep.*               /predict (deep logit)
    F1,F2,...    any        those fields' rows + every layer        serves /predict

A key does not record its field (it is a hash of field and value), so the keys of a
slice's fields are read from data that holds them (``keys_from``: the training log, an
item catalog), hashed as training hashed them. The manifest's ``slice`` entry says what
the version is; a server loading it sets every layer the slice leaves out to zero
(``export/reader.py``). A second export of the same slice to the same URI is a delta
against the first: only rows whose values changed, and the keys that left.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import torch

from terarec.config import ModelConfig, to_dict
from terarec.data.hashing import hash_column
from terarec.data.readers import text_columns
from terarec.embedding.store import CHUNK_ROWS
from terarec.export.delta import row_diff, version_rows
from terarec.export.format import Manifest
from terarec.export.writer import ExportedVersion, ModelExporter, as_json, check_same_part
from terarec.modeldir import checkpoint_name, load_checkpoint, read_model_meta
from terarec.models import row_dim_for
from terarec.models.dssm import DSSM
from terarec.types import FeatureSchema

NAMED = ("user_tower", "item_tower", "wide", "deep")
READ_ROWS = 1 << 18


@dataclass(frozen=True)
class SliceSpec:
    """What a slice holds: ``fields`` (whose keys), ``modules`` (state-dict key
    prefixes, None for every layer) and the routes a server of it answers."""

    name: str
    fields: tuple[str, ...]
    modules: tuple[str, ...] | None
    routes: tuple[str, ...]
    # Row columns the slice's layers read ([start, stop); None: all); the others are zero.
    columns: tuple[int, int | None] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "fields": list(self.fields),
            "modules": None if self.modules is None else list(self.modules),
            "routes": list(self.routes)}
        if self.columns is not None:
            out["columns"] = list(self.columns)
        return out


def slice_spec(schema: FeatureSchema, config: ModelConfig, name: str) -> SliceSpec:
    """The slice ``name`` of a model (see the module docstring for the names)."""
    model = config.name.lower()
    if name in ("user_tower", "item_tower"):
        if model != "dssm":
            raise ValueError(f"--slice {name}: only model 'dssm' has towers, this model is "
                             f"{config.name!r}")
        user, item = DSSM._split_fields(schema, config)
        if name == "user_tower":
            return SliceSpec(name, user, ("user_tower.",), ("retrieve",))
        return SliceSpec(name, item, ("item_tower.",), ())
    if name in ("wide", "deep"):
        if model != "widedeep":
            raise ValueError(f"--slice {name}: only model 'widedeep' has wide and deep parts, "
                             f"this model is {config.name!r}")
        # Column 0 of a row is its wide weight, the rest its deep factors (WideDeep).
        if name == "wide":
            return SliceSpec(name, schema.sparse_names, ("bias", "dense_linear."),
                             ("predict",), (0, 1))
        return SliceSpec(name, schema.sparse_names, ("deep.",), ("predict",), (1, None))
    # Once each (a repeated field failed in the keys file's reader), and categorical only:
    # a bucketed numeric field's keys cannot be read from --keys-from.
    fields = tuple(dict.fromkeys(f.strip() for f in name.split(",") if f.strip()))
    categorical = [f.name for f in schema.categorical if f.separator is None]
    unknown = [f for f in fields if f not in categorical]
    if not fields or unknown:
        raise ValueError(f"--slice {name!r}: expected one of {NAMED} or a comma-separated "
                         f"list of single-valued categorical fields from {categorical}"
                         + (f"; not among them: {unknown}" if unknown else ""))
    return SliceSpec(",".join(fields), fields, None, ("predict",))


def slice_of(manifest: Manifest) -> dict[str, Any] | None:
    """A version's ``slice`` entry, None for a whole model."""
    return manifest.data.get("slice")


def iter_field_columns(path: str | Path, schema: FeatureSchema, fields: Sequence[str],
                       rows: int = READ_ROWS) -> Iterator[dict[str, pa.Array]]:
    """Blocks of ``fields``' raw values (as strings) from a CSV/TSV file with a header, a
    Parquet file, or (for a Criteo-format model) a headerless Criteo file such as the
    training files; the file may hold only these columns (an item catalog)."""
    path = Path(path)
    if not path.is_file():  # a folder was called "no such file"
        raise FileNotFoundError(f"{path}: " + ("a folder, expected a file" if path.is_dir()
                                               else "no such file"))
    for name in fields:
        spec = next(f for f in schema.fields if f.name == name)
        if spec.kind != "categorical" or spec.separator is not None:
            raise ValueError(f"{path}: field {name!r} is not a single-valued categorical "
                             "field; slices and item catalogs read those only")
    if path.suffix == ".parquet":
        pf = pq.ParquetFile(path)
        lacking = [f for f in fields if f not in pf.schema_arrow.names]
        if lacking:
            raise ValueError(f"{path}: lacks columns {lacking}")
        for block in pf.iter_batches(rows, columns=list(fields)):
            yield {f: block.column(f).cast(pa.string()) for f in fields}
        return
    delimiter = "\t" if schema.delimiter == "\t" or path.suffix in (".tsv", ".items") \
        else schema.delimiter
    names = None  # from the header line
    criteo = schema.format == "criteo"
    if criteo and not set(fields) <= set(_first_line(path, delimiter)):
        # a Criteo file as training read it: no header, the schema's columns (the label
        # may be left out, as in Criteo's test files)
        names, _ = text_columns(path, schema, with_label=False)
    try:
        reader = pa_csv.open_csv(
            path, read_options=pa_csv.ReadOptions(block_size=1 << 22, column_names=names),
            parse_options=pa_csv.ParseOptions(delimiter=delimiter,
                                              quote_char=False if criteo else '"'),
            convert_options=pa_csv.ConvertOptions(
                include_columns=list(fields), column_types={f: pa.string() for f in fields},
                strings_can_be_null=False))
        for block in reader:
            yield {f: block.column(f) for f in fields}
    except (pa.ArrowInvalid, KeyError) as exc:
        raise ValueError(f"{path}: cannot read columns {list(fields)} ({exc})") from None


def _first_line(path: Path, delimiter: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.readline().rstrip("\r\n").split(delimiter)


def field_keys(paths: Sequence[str | Path], schema: FeatureSchema,
               fields: Sequence[str]) -> np.ndarray:
    """The sorted unique keys of ``fields`` in the files ``paths``."""
    parts = [np.empty(0, np.int64)]
    for path in paths:
        for block in iter_field_columns(path, schema, fields):
            parts.extend(np.unique(hash_column(f, block[f], schema.hash_salt)) for f in fields)
            if len(parts) > 64:
                parts = [np.unique(np.concatenate(parts))]
    return np.unique(np.concatenate(parts))


def export_slice(model_dir: str | Path, uri: str | Path, name: str,
                 keys_from: Sequence[str | Path], *,
                 storage_options: dict[str, Any] | None = None, shard_rows: int = 1 << 20,
                 checkpoint: str = "best") -> ExportedVersion:
    """Export slice ``name`` of a model directory's checkpoint to ``uri``: a full version,
    or, when ``uri``'s newest version is the same slice of the same model, a delta on it
    (rows that changed, keys that left)."""
    schema, config = read_model_meta(Path(model_dir))
    spec = slice_spec(schema, config.model, name)
    if not keys_from:
        raise ValueError(f"--slice {name}: needs --keys-from (a file holding the values of "
                         f"fields {list(spec.fields)}): keys do not record their field")
    exporter = ModelExporter(uri, storage_options, shard_rows)
    latest = exporter.latest()
    check_same_part(exporter.storage.uri, latest, spec.name)
    wanted = field_keys(keys_from, schema, spec.fields)
    ckpt = load_checkpoint(model_dir, checkpoint_name(model_dir, checkpoint))
    dense = {k: v for k, v in ckpt.dense.items()
             if spec.modules is None or any(k.startswith(p) for p in spec.modules)}
    row_dim = row_dim_for(config.model.name, config.model)
    info = spec.to_dict()
    # Compared as the manifest holds them once read back (a schema's bucket edges are
    # tuples here, lists there): compared raw, a slice exported again was always full.
    if latest is not None and latest.data.get("slice") == info \
            and latest.data["schema"] == as_json(schema.to_dict()) \
            and latest.data["model"] == as_json(to_dict(config.model)):
        keys, values = _sliced_rows(ckpt, wanted, spec.columns, row_dim)
        old_keys, old_values = version_rows(exporter, latest)
        changed, deleted = row_diff(keys, values, old_keys, old_values)
        return exporter.write_delta(dense=dense, keys=keys[changed], values=values[changed],
                                    deleted=deleted, pass_id=int(ckpt.meta["pass_id"]))
    if not len(wanted):
        raise ValueError(f"--keys-from {', '.join(map(str, keys_from))}: no value of fields "
                         f"{list(spec.fields)} in it")
    rows = _not_empty(_filtered(ckpt.iter_sorted(CHUNK_ROWS), wanted, spec.columns),
                      f"--slice {spec.name}: none of the {len(wanted):,} keys of fields "
                      f"{list(spec.fields)} in --keys-from is a row of the model (files "
                      "other than those it was trained on?); no version written")
    return exporter.write_full(schema=schema, model_config=config.model, dense=dense,
                               rows=rows, row_dim=row_dim, pass_id=int(ckpt.meta["pass_id"]),
                               slice_info=info)


def _filtered(chunks: Iterator[Any], wanted: np.ndarray,
              columns: tuple[int, int | None] | None = None) -> Iterator[Any]:
    """Row chunks cut to the keys in sorted ``wanted``, values outside ``columns`` zero
    (the other part's weights must not reach the slice's sum)."""
    from dataclasses import fields

    for chunk in chunks:
        keep = _member(np.asarray(chunk.keys, np.int64), wanted)
        if keep.any():
            part = {f.name: getattr(chunk, f.name)[keep] for f in fields(chunk)}
            if columns is not None:
                values = np.zeros_like(part["values"])
                lo, hi = columns
                values[:, lo:hi] = part["values"][:, lo:hi]
                part["values"] = values
            yield type(chunk)(**part)


def _not_empty(chunks: Iterator[Any], message: str) -> Iterator[Any]:
    """``chunks``, then a ValueError(``message``) if there were none: raised inside the
    writer's loop, before the manifest, so an empty full version is never published."""
    empty = True
    for chunk in chunks:
        empty = False
        yield chunk
    if empty:
        raise ValueError(message)


def _member(keys: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    pos = np.minimum(np.searchsorted(wanted, keys), max(len(wanted) - 1, 0))
    return (wanted[pos] == keys) if len(wanted) else np.zeros(len(keys), bool)


def _sliced_rows(ckpt: Any, wanted: np.ndarray, columns: tuple[int, int | None] | None,
                 row_dim: int) -> tuple[np.ndarray, np.ndarray]:
    # No row at all is still rows of ``row_dim``: a delta of 0-wide rows wrote a manifest
    # (row_dim 0) that every reader refuses.
    keys, values = [np.empty(0, np.int64)], [np.empty((0, row_dim), np.float32)]
    for chunk in _filtered(ckpt.iter_sorted(CHUNK_ROWS), wanted, columns):
        keys.append(np.asarray(chunk.keys, np.int64))
        values.append(np.asarray(chunk.values, np.float32))
    return np.concatenate(keys), np.concatenate(values)


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
