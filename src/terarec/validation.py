"""Validating JSON documents (configs, schemas, manifests, checkpoint metadata) against types.

The types are plain dataclasses (or TypedDicts) with ``STRICT`` as their pydantic config:
JSON rules (an array fills a tuple, ``"4096"`` is not an integer), unknown keys refused,
NaN and infinity refused. ``validate`` / ``validate_json`` turn pydantic's error list into
one line per problem that names the JSON path and the value, e.g.
``store.precision: 'int3' is not one of fp32, fp16, int8, int4``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import typing_extensions
from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

T = TypeVar("T")

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
"""The pydantic config of every validated document type."""


class InvalidInput(ValueError):
    """A document that does not fit its type; ``problems`` holds one line per error."""

    def __init__(self, message: str, problems: Sequence[Problem] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems)


@dataclass(frozen=True)
class Problem:
    """One validation error: where (``path``, e.g. ``fields[2].kind``) and what."""

    path: str
    kind: str  # pydantic's error type, e.g. "missing", "literal_error"
    message: str  # the whole line, path included
    field: str = ""  # for "missing" / "unknown": the key(s), comma-separated


@functools.cache
def _adapter(tp: Any) -> TypeAdapter[Any]:
    return TypeAdapter(tp)


def validate(tp: type[T], data: Any, where: str = "", root: str = "") -> T:
    """``data`` (JSON values: dicts, lists, numbers ...) as a ``tp``, or ``InvalidInput``
    naming every problem, prefixed with ``where`` (a file name, say)."""
    try:
        raw = json.dumps(data)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{where or root or 'document'}: not JSON data ({exc})") from None
    return validate_json(tp, raw, where, root)


def validate_json(tp: type[T], raw: str | bytes, where: str = "", root: str = "") -> T:
    """Parse and validate JSON text ``raw`` as a ``tp`` (see ``validate``); ``root`` names
    the whole document in errors about it (e.g. "request must be an object")."""
    try:
        return typing.cast(T, _adapter(typing.cast(Any, tp)).validate_json(raw))
    except ValidationError as exc:
        found = problems(exc, tp, root)
        text = "; ".join(p.message for p in found)
        raise InvalidInput(f"{where}: {text}" if where else text, found) from None


# -- error formatting --------------------------------------------------------------------

_JSON_NAMES = {dict: "object", list: "array", tuple: "array", str: "string", bool: "boolean",
               int: "integer", float: "number", type(None): "null"}
_EXPECTED = {"int": "an integer", "float": "a number", "string": "a string",
             "bool": "a boolean", "dict": "an object", "list": "an array",
             "tuple": "an array", "dataclass": "an object", "model": "an object",
             "typed_dict": "an object", "none_required": "null", "set": "an array",
             "frozen_set": "an array"}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
           "less_than_equal": "<="}


def json_type(value: Any) -> str:
    """The JSON name of ``value``'s type ("object", "array", "string" ...)."""
    return _JSON_NAMES.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _got(value: Any) -> str:
    """A wrong-typed value as an error shows it: its JSON type, then the value itself
    unless it is a container or null ("string 'x'", "boolean true", "null", "object")."""
    if value is None or isinstance(value, (dict, list, tuple)):
        return json_type(value)
    shown = json.dumps(value) if isinstance(value, bool) else _show(value)
    return f"{json_type(value)} {shown}"


_REQUIRED_MARKS = {typing_extensions.NotRequired, typing_extensions.Required,
                   getattr(typing, "NotRequired", None), getattr(typing, "Required", None)} - {None}


def _strip(tp: Any) -> tuple[Any, FieldInfo | None]:
    """``tp`` without Annotated / Optional wrappers, and its FieldInfo if it had one."""
    info = None
    while True:
        origin = typing.get_origin(tp)
        if origin in _REQUIRED_MARKS:
            tp = typing.get_args(tp)[0]
        elif origin is typing.Annotated:
            info = next((m for m in tp.__metadata__ if isinstance(m, FieldInfo)), info)
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp, info
            tp = args[0]
        else:
            return tp, info


def strip_type(tp: Any) -> Any:
    """``tp`` without ``Annotated`` constraints and ``| None``: ``Positive | None`` -> int."""
    return _strip(tp)[0]


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _hints(tp: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(tp, include_extras=True)
    except (TypeError, NameError):
        return {}


def _walk(root: Any, loc: tuple[int | str, ...]) -> tuple[str, Any, FieldInfo | None, Any]:
    """(path such as ``sparse.shards[0].rows`` or ``files['a.bin']``, the type at the end,
    its FieldInfo, the type holding the last key)."""
    path = ""
    tp: Any = root
    parent: Any = None
    for item in loc:
        tp, _ = _strip(tp)
        if tp is not None and _is_union(tp):  # pydantic names the member tried: not a key
            tp = None
            continue
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if isinstance(item, int) and (tp is None or origin in (tuple, list)):
            path += f"[{item}]"
            tp = args[0] if args else None
        elif origin is dict:
            path += f"[{item!r}]"
            tp = args[1] if args else None
        else:
            path += f".{item}" if path else str(item)
            parent = tp
            hints = _hints(tp) if tp is not None and (
                dataclasses.is_dataclass(tp) or _is_typed_dict(tp)) else {}
            tp = hints.get(str(item))
    stripped, info = _strip(tp) if tp is not None else (None, None)
    return path, stripped, info, parent


def _is_typed_dict(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__annotations__")


def _field_names(tp: Any) -> list[str]:
    if dataclasses.is_dataclass(tp):
        return [f.name for f in dataclasses.fields(tp)]
    return list(_hints(tp)) if _is_typed_dict(tp) else []


_KEY_ERRORS = {"extra_forbidden", "unexpected_keyword_argument", "missing", "missing_argument",
               "missing_keyword_only_argument", "missing_positional_only_argument"}


def problems(exc: ValidationError, tp: Any, root: str = "") -> list[Problem]:
    """One Problem per error (the errors of a union's members merged into one)."""
    out: list[Problem] = []
    unions: dict[str, list[ErrorDetails]] = {}
    missing: dict[str, list[Any]] = {}  # parent path -> [parent type, key, key ...]
    unknown: dict[str, list[Any]] = {}
    for err in exc.errors():
        loc = tuple(err["loc"])
        kind = err["type"]
        if kind in _KEY_ERRORS:
            parent_path = _walk(tp, loc[:-1])[0]
            _, _, info, parent = _walk(tp, loc)
            name = str(loc[-1])
            where = f"{parent_path}: " if parent_path else ""
            if kind in ("extra_forbidden", "unexpected_keyword_argument"):
                group = unknown
            elif info is not None and info.description:
                out.append(Problem(parent_path, "missing", f"{where}missing field {name!r}: "
                                   f"{info.description}", name))
                continue
            else:
                group = missing
            if parent_path not in group:
                group[parent_path] = [parent]
                out.append(Problem(parent_path, "unknown" if group is unknown else "missing",
                                   ""))  # the line is written below, once all are known
            group[parent_path].append(name)
            continue
        path, leaf, info, _ = _walk(tp, loc)
        if len(loc) and _walk(tp, loc[:-1])[0] == path and kind.endswith("_type"):
            unions.setdefault(path, []).append(err)  # one member of a union failed
            continue
        out.append(Problem(path, kind, _describe(err, path or root, leaf, info)))
    for i, p in enumerate(out):
        if p.message:
            continue
        parent, *names = (missing if p.kind == "missing" else unknown)[p.path]
        line = f"{p.path}: " if p.path else ""
        line += f"{p.kind} field(s) {names}"
        if p.kind == "unknown":
            line += "; known: " + (", ".join(_field_names(parent)) or "none")
        out[i] = Problem(p.path, p.kind, line, ",".join(names))
    for path, errs in unions.items():
        wanted = " or ".join(dict.fromkeys(
            _EXPECTED.get(e["type"][:-len("_type")], e["type"]) for e in errs))
        value = errs[0]["input"]
        out.append(Problem(path, "union_type",
                           f"{path or root}: expected {wanted}, got {_got(value)}"))
    return out


def _describe(err: ErrorDetails, path: str, leaf: Any, info: FieldInfo | None) -> str:
    kind, value, ctx = err["type"], err["input"], err.get("ctx") or {}
    subject = path or "document"
    desc = info.description if info is not None and info.description else None
    if kind == "literal_error":
        options = typing.get_args(leaf) if typing.get_origin(leaf) is typing.Literal else ()
        allowed = ", ".join(str(o) for o in options) or ctx.get("expected", "")
        return f"{subject}: {_show(value)} is not one of {allowed}"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()), "?")
        return f"{subject}: {_show(value)} must be {_BOUNDS[kind]} {bound}"
    if kind == "finite_number":
        return f"{subject}: {_show(value)} is not a finite number"
    if kind == "too_short":
        got = "an empty array" if not ctx.get("actual_length") else (
            f"{ctx.get('actual_length')} items")
        what = desc or f"at least {ctx.get('min_length')} items"
        return f"{subject} must be {what}, got {got}"
    if kind == "too_long":
        return f"{subject}: at most {ctx.get('max_length')} items, got {ctx.get('actual_length')}"
    if kind == "string_pattern_mismatch":
        return f"{subject}: {_show(value)} does not match {ctx.get('pattern')}"
    if kind == "json_invalid":
        return f"{subject}: invalid JSON ({ctx.get('error', err['msg'])})"
    if kind in ("value_error", "assertion_error"):
        return f"{subject}: {ctx.get('error', err['msg'])}"
    if kind.endswith("_type"):
        base = kind[:-len("_type")]
        wanted = desc or _EXPECTED.get(base, base)
        return f"{subject} must be {wanted}, got {_got(value)}"
    return f"{subject}: {err['msg']} (got {_show(value)})"
