"""Request bodies of the serving routes: one msgspec type per route, decoded once.

A body is decoded and checked against its route's type in one pass (``decode``); the
same types give the OpenAPI document its JSON Schema (``serving/openapi.py``). Feature
values are typed too (strings, numbers, null, or an array of them for a multi-valued
field), so the decoder itself refuses a boolean, an object or an array nested in an
array where a feature value belongs, and no body nests deeper than its type: a body
nested 1,000 levels deep is refused at its third level, never walked to the bottom.

Errors name the JSON path (``candidates[3].C7: ...``); a refused body is never decoded
a second way that could accept it.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Annotated, Any, TypeVar, Union

import msgspec

from terarec.serving.errors import BadRequest

T = TypeVar("T")

Scalar = Union[str, int, float, None]  # noqa: UP007 (msgspec reads the union as written)
FeatureValue = Union[str, int, float, None, list[Scalar]]  # noqa: UP007
"""What a request may send for one raw feature: a number or a numeric text for a numeric
field, a string or an integer for a categorical one, an array of those for a multi-valued
field, null for a missing value. JSON ``true`` / ``false`` is none of them."""
Features = dict[str, FeatureValue]

TensorScalar = Union[str, int, float, bool, None]  # noqa: UP007
TensorValue = Union[str, int, float, bool, None, list[TensorScalar]]  # noqa: UP007
"""One value of a v2 tensor's ``data``: a scalar, or a one-value row of a [N, 1] shape."""
Parameters = dict[str, TensorScalar]


class PredictRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``/predict`` body: ``candidates`` scored, each merged with ``context``."""

    candidates: Annotated[list[Features], msgspec.Meta(
        min_length=1, description="an array of feature objects, one per item to score")]
    context: Annotated[Features, msgspec.Meta(description="an object of feature values")] = {}


class InferInput(msgspec.Struct, forbid_unknown_fields=True):
    """One input tensor of a v2 inference request: a feature's values, one per row."""

    name: str
    shape: list[int]
    datatype: str
    data: list[TensorValue]
    parameters: Parameters = {}


class InferRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Open Inference Protocol (KServe v2) ``/infer`` body."""

    inputs: Annotated[list[InferInput], msgspec.Meta(
        min_length=1, description="a non-empty array of input tensors")]
    id: str | None = None
    outputs: list[dict[str, TensorScalar | Parameters]] = []
    parameters: Parameters = {}


class BinaryInput(msgspec.Struct, forbid_unknown_fields=True):
    """An input tensor whose values follow the JSON header as raw bytes."""

    name: str
    shape: list[int]
    datatype: str
    parameters: Parameters


class BinaryInferRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The JSON header of a v2 request with binary tensor data."""

    inputs: Annotated[list[BinaryInput], msgspec.Meta(
        min_length=1, description="a non-empty array of input tensors")]
    id: str | None = None
    outputs: list[dict[str, TensorScalar | Parameters]] = []
    parameters: Parameters = {}


_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {}
_ENCODER = msgspec.json.Encoder()


def encode(answer: Any) -> bytes:
    """An answer as JSON (the one codec of the request path: msgspec both ways)."""
    return _ENCODER.encode(answer)


def decode(tp: type[T], body: bytes) -> T:
    """``body`` decoded as a ``tp``, or ``BadRequest``: 400 for text that is no JSON,
    422 for JSON that is no ``tp``, naming the JSON path."""
    decoder = _DECODERS.get(tp)
    if decoder is None:
        decoder = _DECODERS[tp] = msgspec.json.Decoder(tp)
    try:
        return typing.cast(T, decoder.decode(body))
    except msgspec.ValidationError as exc:
        raise BadRequest(explain(str(exc), tp, body)) from None
    except msgspec.DecodeError as exc:
        reason = str(exc).removeprefix("JSON is malformed: ")
        raise BadRequest(f"malformed JSON: {_lower(reason)}", 400) from None
    except RecursionError:  # a type holding Any, nested past the interpreter's stack
        raise BadRequest("malformed JSON: nested too deeply", 400) from None


# -- error wording ------------------------------------------------------------------------

_MESSAGE = re.compile(r"(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?", re.S)
_EXPECTED = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
             "null": "null", "array": "an array", "object": "an object"}
_GOT = {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
        "null": "null", "array": "array", "object": "object"}
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def _lower(text: str) -> str:
    """msgspec's sentence as the tail of ours; its two words for a number no double or
    Python integer holds (``1e400``, 5,000 digits) as one."""
    if text in ("Integer value out of range", "Number out of range"):
        return "number out of range"
    return text[:1].lower() + text[1:]


def _fields(tp: Any) -> tuple[str, ...]:
    return getattr(tp, "__struct_fields__", ())


def _strip(tp: Any) -> Any:
    """``tp`` without ``Annotated`` and ``| None``."""
    while True:
        if typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
            continue
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) in (Union, types.UnionType) and len(args) == 1:
            tp = args[0]
            continue
        return tp


def _type_at(tp: Any, segments: list[tuple[str, str]]) -> Any:
    """The type a JSON path leads to inside ``tp`` (None past what the types say)."""
    for key, _ in segments:
        tp = _strip(tp)
        if key:
            tp = typing.get_type_hints(tp, include_extras=True).get(key) if _fields(tp) \
                else None
        else:
            args = typing.get_args(tp)
            origin = typing.get_origin(tp)
            tp = args[0] if origin is list and args else args[1] if origin is dict else None
        if tp is None:
            return None
    return tp


def _description(tp: Any) -> str | None:
    """The description a field's ``Annotated`` metadata gives it."""
    while typing.get_origin(tp) is Annotated:
        meta = next((m for m in tp.__metadata__ if isinstance(m, msgspec.Meta)), None)
        if meta is not None and meta.description:
            return meta.description
        tp = typing.get_args(tp)[0]
    return None


def _expected(types: str) -> str:
    return " or ".join(_EXPECTED.get(t.strip(), t.strip()) for t in types.split("|"))


def explain(message: str, tp: Any, body: bytes) -> str:
    """msgspec's validation error, in the words every other error of the server uses:
    ``candidates[1] must be an object, got null``; ``unknown field(s) ['user']``."""
    match = _MESSAGE.fullmatch(message)
    assert match is not None
    what, path = match["what"], match["path"] or ""
    segments = [(m[1] or "", m[2] or "") for m in _SEGMENT.finditer(path)]
    if any(index == "..." for _, index in segments):  # a value of a feature object
        return _feature_value_error(what, path, body)
    where = path.lstrip(".") or "request"
    got = re.fullmatch(r"Expected `([^`]*)`, got `([^`]*)`", what)
    if got:
        wanted = _description(_type_at(tp, segments)) or _expected(got[1])
        return f"{where} must be {wanted}, got {_GOT.get(got[2], got[2])}"
    if re.fullmatch(r"Expected `array` of length >= 1", what):
        return f"{where} must be a non-empty array"
    prefix = f"{where}: " if path else ""
    name = re.fullmatch(r"Object missing required field `([^`]*)`", what)
    if name:
        return f"{prefix}missing field {name[1]!r}"
    name = re.fullmatch(r"Object contains unknown field `([^`]*)`", what)
    if name:
        known = _fields(_strip(_type_at(tp, segments)))
        return f"{prefix}unknown field(s) [{name[1]!r}]; known: {', '.join(known) or 'none'}"
    text = re.sub(r"`([^`]*)`", lambda m: _expected(m[1]), what)
    return f"{where}: {_lower(text)}"


def _feature_value_error(what: str, path: str, body: bytes) -> str:
    """An error inside an object of feature values or parameters, whose keys msgspec's
    path leaves out (``$.candidates[3][...]``): the body is read again, untyped, to find
    the key. Only a refused body is; one too deep to read names the object alone."""
    head, _, rest = path.partition("[...]")
    where = head.lstrip(".") or "request"
    got = re.search(r"got `([^`]*)`", what)
    kind = _GOT.get(got[1], got[1]) if got else ""
    if not head.startswith((".candidates", ".context")):  # parameters
        return (f"{where}: values must be strings, numbers, booleans or null, got {kind}"
                if got else f"{where}: {_lower(what)}")
    if not got:  # a number msgspec cannot hold
        return f"{where}: a feature value: {_lower(what)}"
    problem = (f"{kind} is no feature value" if not rest
               else "an array inside an array is no feature value" if kind == "array"
               else f"an array holding {kind} is no feature value")
    hint = "; send a string, a number or null (an array of them for a multi-valued field)"
    try:
        obj: Any = msgspec.json.decode(body)
        for key, index in ((m[1], m[2]) for m in _SEGMENT.finditer(head)):
            obj = obj[key] if key else obj[int(index)]
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, LookupError,
            TypeError, ValueError):
        obj = None
    bad = next((k for k, v in obj.items() if not _is_feature_value(v)), None) \
        if isinstance(obj, dict) else None
    if bad is None:
        return f"{where}: a value: {problem}{hint}"
    return f"{where}: field {bad!r}: {problem}{hint}"


def _is_feature_value(v: Any, nested: bool = False) -> bool:
    if v is None or type(v) in (str, int, float):
        return True
    return not nested and type(v) is list and all(_is_feature_value(x, True) for x in v)
