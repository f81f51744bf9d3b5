"""Open Inference Protocol (KServe v2) requests and answers: an ``/infer`` request's input
tensors checked against the served model (one tensor per feature, shape ``[N]`` or
``[N, 1]``, values of the tensor's datatype) and read as columns, from JSON ``data`` or
from binary tensor data (``serving/binary.py``); the scores answer and the model
metadata.

A multi-valued field (a sequence, separated tags) takes each row's values as one
separator-joined string (``[N]``), as a JSON list per row (``[N]``, terarec's own), or
as a ``BYTES`` tensor ``[N, L]`` padded with empty strings (or JSON nulls) after each
row's values: the padding is dropped, so a history shorter than ``L`` stays short."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from terarec.serving import binary
from terarec.serving.engine import ServedVersion
from terarec.serving.errors import BadRequest
from terarec.serving.schemas import BinaryInferRequest, InferRequest, decode
from terarec.validation import json_type

DATATYPES = frozenset({"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16",
                       "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES"})
OUTPUT_NAME = "score"


def output_names(version: ServedVersion) -> tuple[str, ...]:
    """The outputs of a served model: ``score``, or one per task (named as its label)
    for a model of several labels."""
    schema = version.schema
    return (OUTPUT_NAME,) if schema.num_tasks == 1 else schema.task_names


def model_metadata(version: ServedVersion, model_name: str) -> dict[str, Any]:
    """``GET /v2/models/NAME``: the served version, its inputs (one per raw feature;
    ``[-1, -1]`` for a multi-valued one, a list per row) and its outputs (one, or one
    per task)."""
    lists = version.list_names
    inputs = [{"name": f.name, "datatype": "FP64" if f.kind == "numeric" else "BYTES",
               "shape": [-1, -1] if f.name in lists else [-1]}
              for f in version.schema.fields]
    return {"name": model_name, "versions": [str(version.version)], "platform": "terarec",
            "inputs": inputs,
            "outputs": [{"name": name, "datatype": "FP32", "shape": [-1]}
                        for name in output_names(version)]}


def score_answer(model_name: str, version: ServedVersion, scores: list[Any],
                 request_id: str | None, requested: list[dict[str, Any]] | None = None
                 ) -> dict[str, Any]:
    """The answer of a scored v2 request: one FP32 output with one score per row, or,
    for a model of several labels, one output per task (those ``requested``, if the
    request named some)."""
    names = output_names(version)
    columns = [scores] if len(names) == 1 else [[row[t] for row in scores]
                                                for t in range(len(names))]
    wanted = {o.get("name") for o in requested or []}
    out: dict[str, Any] = {
        "model_name": model_name, "model_version": str(version.version),
        "outputs": [{"name": name, "datatype": "FP32", "shape": [len(data)], "data": data}
                    for name, data in zip(names, columns, strict=True)
                    if not wanted or name in wanted]}
    if request_id is not None:
        out["id"] = request_id
    return out


def json_columns(body: InferRequest, version: ServedVersion, max_rows: int
                 ) -> tuple[dict[str, Any], int]:
    """Columns of a v2 inference request: one input tensor per feature, shape [N] or
    [N, 1], all with the same N; and N."""
    check_outputs(body.outputs, version)
    columns: dict[str, Any] = {}
    rows = None
    for i, tensor in enumerate(body.inputs):
        name, shape, data = tensor.name, tensor.shape, tensor.data
        where = check_tensor(i, name, tensor.datatype, shape, columns, version)
        if name in version.list_names and (shape[1:] != [1] if len(shape) == 2 else any(
                isinstance(v, list) for v in data)):  # [N, L], or [N] of lists
            columns[name] = _json_lists(where, tensor.datatype, shape, data)
            rows = check_rows(where, shape[0], rows, max_rows)
            continue
        if len(data) and isinstance(data[0], list) and len(shape) == 2:
            if not all(isinstance(row, list) and len(row) == 1 for row in data):
                raise BadRequest(f"{where}: nested 'data' must hold one value per row")
            data = [row[0] for row in data]  # type: ignore[index]
        if shape[0] != len(data):
            raise BadRequest(f"{where}: shape {shape} does not match {len(data)} values")
        check_data(where, tensor.datatype, data)
        rows = check_rows(where, shape[0], rows, max_rows)
        columns[name] = data
    assert rows is not None  # InferRequest holds one input at least
    return columns, rows


def _json_lists(where: str, datatype: str, shape: list[int], data: list[Any]
                ) -> list[list[Any]]:
    """A multi-valued field's JSON tensor as one list of values per row: ``[N]`` data
    holding a list (or a joined string) per row, or ``[N, L]`` data (nested or flat, row
    major) whose empty strings and nulls are padding."""
    if len(shape) == 1:
        if shape[0] != len(data):
            raise BadRequest(f"{where}: shape {shape} does not match {len(data)} values")
        out = []
        for r, row in enumerate(data):
            if isinstance(row, list):
                check_data(f"{where} row {r}", datatype, row)
                out.append([v for v in row if v not in (None, "")])
            else:
                check_data(where, datatype, [row])
                out.append(row)
        return out
    n, width = shape
    if len(data) == n and all(isinstance(row, list) for row in data):
        if any(len(row) != width for row in data):
            raise BadRequest(f"{where}: shape {shape}: every row of 'data' must hold "
                             f"{width} values")
        flat = [v for row in data for v in row]
    else:
        flat = data
    if len(flat) != n * width:
        raise BadRequest(f"{where}: shape {shape} does not match {len(flat)} values")
    check_data(where, datatype, flat)
    return [[v for v in flat[r * width:(r + 1) * width] if v not in (None, "")]
            for r in range(n)]


def check_outputs(outputs: list[dict[str, Any]], version: ServedVersion) -> None:
    """A request may name the outputs there are (``score``, or the tasks), or none."""
    names = output_names(version)
    if any(o.get("name") not in names for o in outputs):
        if len(names) == 1:
            raise BadRequest(f"'outputs' may only request the output {OUTPUT_NAME!r}")
        raise BadRequest(f"'outputs' may only request the outputs {list(names)}")


def check_tensor(i: int, name: str, datatype: str, shape: list[int],
                 columns: Mapping[str, Any], version: ServedVersion) -> str:
    """``inputs[i]`` names a feature, once, with a known datatype and a [N] / [N, 1]
    shape; returns how errors about it name it."""
    if name not in version.feature_set:
        raise BadRequest(f"inputs[{i}]: unknown input {name!r}; the model's inputs are "
                         f"{list(version.feature_names)}")
    where = f"input {name!r}"
    if name in columns:
        raise BadRequest(f"{where} given twice")
    check_datatype(where, datatype)
    if name in version.list_names:  # a list per row: [N, L]
        if not shape or len(shape) > 2 or len(shape) == 2 and shape[1] < 1:
            raise BadRequest(f"{where}: shape must be [N] or [N, L] (L values per row, "
                             f"padded with empty strings), got {shape!r}")
        if len(shape) == 2 and shape[1] != 1 and datatype not in ("BYTES", "INT32",
                                                                   "INT64"):
            raise BadRequest(f"{where}: a [N, L] tensor of a multi-valued field must be "
                             f"BYTES, INT32 or INT64, got {datatype}")
        return where
    if not shape or len(shape) > 2 or (len(shape) == 2 and shape[1] != 1):
        raise BadRequest(f"{where}: shape must be [N] or [N, 1], got {shape!r}")
    return where


def check_datatype(where: str, datatype: str) -> None:
    """``datatype`` is one of the protocol's tensor datatypes."""
    if datatype not in DATATYPES:
        raise BadRequest(f"{where}: unknown datatype {datatype!r}")


# The JSON values each datatype's 'data' may hold (null: a missing value). An INT64 tensor
# holding 1.5 or a BOOL one holding 3 was read as the number it held.
_DATA_TYPES: dict[str, frozenset[type]] = {
    **{d: frozenset({int, type(None)}) for d in DATATYPES if "INT" in d},
    "BOOL": frozenset({bool, type(None)}),
    **{d: frozenset({int, float, type(None)}) for d in ("FP16", "FP32", "FP64")},
    "BYTES": frozenset({str, int, type(None)})}


# The values an integer datatype holds: UINT8 300 or INT64 2**70 was read as that number.
_INT_RANGES = {d: (int(np.iinfo(d.lower()).min), int(np.iinfo(d.lower()).max))
               for d in DATATYPES if "INT" in d}


def check_data(where: str, datatype: str, data: list[Any]) -> None:
    """Every value of a JSON tensor is of its datatype (integers within its range)."""
    allowed = _DATA_TYPES[datatype]
    low, high = _INT_RANGES.get(datatype, (None, None))
    if {type(v) for v in data} <= allowed:
        numbers = [v for v in data if v is not None] if low is not None else None
        if not numbers or low <= min(numbers) and max(numbers) <= high:
            return
    i, v = next((i, v) for i, v in enumerate(data) if type(v) not in allowed
                or (low is not None and v is not None and not low <= v <= high))
    shown = (str(v) if type(v) in (int, float) else msgspec.json.encode(v).decode())[:60]
    raise BadRequest(f"{where}: data[{i}] is {json_type(v)} {shown}, not a {datatype} value")


def check_rows(where: str, n: int, rows: int | None, max_rows: int) -> int:
    """The row count of one more tensor: at least one, at most ``max_rows``, as many as
    the tensors before it (``rows``)."""
    if rows is None:
        if n < 1:
            raise BadRequest(f"{where}: no rows")
        if n > max_rows:
            raise BadRequest(f"{n} rows exceed the limit of {max_rows}", 413)
        return n
    if n != rows:
        raise BadRequest(f"{where}: {n} rows, other inputs have {rows}")
    return rows


def _binary_lists(chunk: memoryview, datatype: str, rows: int, width: int) -> pa.Array:
    """A multi-valued field's binary ``[N, L]`` tensor as a list column: each row's
    ``L`` values (row major), empty strings (padding) dropped."""
    if datatype == "BYTES":
        values = binary.bytes_tensor(chunk, rows * width).cast(pa.string())
        keep = pc.not_equal(pc.binary_length(values), 0).to_numpy(zero_copy_only=False)
    else:
        values = binary.fixed_tensor(chunk, datatype, rows * width)
        keep = np.ones(len(values), bool)
    counts = keep.reshape(rows, width).sum(axis=1)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), values.filter(pa.array(keep)))


def binary_columns(raw: bytes, header: str, version: ServedVersion, max_rows: int
                   ) -> tuple[dict[str, Any], int, str | None]:
    """Columns of a request with binary tensor data (``binary``): the JSON header's
    first ``header`` bytes, then each input's ``binary_data_size`` bytes in order; N;
    and the request's id."""
    try:
        size = int(header)
    except ValueError:
        size = -1
    if not 0 < size <= len(raw):
        raise BadRequest(f"bad {binary.HEADER} header {header!r}: the body has "
                         f"{len(raw)} bytes", 400)
    body = decode(BinaryInferRequest, raw[:size])
    check_outputs(body.outputs, version)
    data = memoryview(raw)[size:]
    columns: dict[str, Any] = {}
    rows, start = None, 0
    for i, tensor in enumerate(body.inputs):
        name, shape = tensor.name, tensor.shape
        where = check_tensor(i, name, tensor.datatype, shape, columns, version)
        nbytes = tensor.parameters.get("binary_data_size")
        if type(nbytes) is not int or nbytes < 0:
            raise BadRequest(f"{where}: parameters.binary_data_size must be a byte count, "
                             f"got {nbytes!r}")
        rows = check_rows(where, shape[0], rows, max_rows)
        chunk = data[start:start + nbytes]
        if len(chunk) != nbytes:
            raise BadRequest(f"{where}: binary_data_size {nbytes} runs past the end of the "
                             f"body ({len(data) - start} bytes left)", 400)
        start += nbytes
        try:
            if len(shape) == 2 and shape[1] != 1:  # a multi-valued field's [N, L]
                col = _binary_lists(chunk, tensor.datatype, rows, shape[1])
            elif tensor.datatype == "BYTES":
                col = binary.bytes_tensor(chunk, rows)
                if name in version.numeric_names:
                    col = col.cast(pa.string())  # numeric text must be UTF-8
            else:
                col = binary.fixed_tensor(chunk, tensor.datatype, rows)
        except (binary.BinaryTensorError, pa.ArrowException) as exc:
            raise BadRequest(f"{where}: {exc}") from None
        columns[name] = col
    if start != len(data):
        raise BadRequest(f"the body holds {len(data)} bytes of tensor data, the inputs "
                         f"declare {start}", 400)
    assert rows is not None
    return columns, rows, body.id
