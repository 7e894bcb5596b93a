"""What the API shows, typed: frozen dataclasses whose fields are a JSON object's keys. One definition gives
both the JSON (View.as_dict) and the OpenAPI 3.0 schema (schema_of), so the two cannot drift apart.

A field's type says its schema: str, int, float, bool, a StrEnum or a Literal of strings (an enum), a list, a
dict of strings to a type (or to Any: any JSON), another dataclass (a $ref when it is a named component, else
inline), and `X | None` for a key that is always there but may be null. A field made with `sometimes()` is a key
the JSON has only when it holds a value: left out when None, and not required. Per-field OpenAPI extras
(description, example, pattern, format...) go in the field's metadata, through `shown()` or `sometimes()`.
"""
from __future__ import annotations

import dataclasses
import types
from enum import StrEnum
from functools import cache
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints
from collections.abc import Mapping

# A field's metadata: its OpenAPI extras, and whether its key is left out of the JSON while it is None.
OPENAPI = "openapi"
SOMETIMES = "sometimes"

# The format of a time (RFC 3339) in a field's extras.
TIME: dict[str, Any] = {"format": "date-time"}


def shown(**openapi: Any) -> Any:
    """A field that is always in the JSON, with its OpenAPI extras."""
    return dataclasses.field(metadata={OPENAPI: openapi})


def sometimes(**openapi: Any) -> Any:
    """A field whose key the JSON has only when it holds a value (None: left out), with its OpenAPI extras."""
    return dataclasses.field(default=None, metadata={SOMETIMES: True, OPENAPI: openapi})


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How a view class becomes JSON, worked out once from its fields and their types."""

    nested: tuple[str, ...]  # a dataclass (or None): its as_dict()
    nested_lists: tuple[str, ...]  # a list of dataclasses: each one's as_dict()
    sometimes: tuple[str, ...]  # left out while None


class View:
    """A frozen dataclass the API shows (see the module's docstring)."""

    __slots__ = ()

    def as_dict(self) -> dict[str, Any]:
        """The JSON object, its keys in field order (a page of a million records goes through here: a frozen
        dataclass's __dict__ holds exactly its fields, in order, so it is copied rather than walked)."""
        plan = _plan(type(self))
        d: dict[str, Any] = self.__dict__.copy()
        for name in plan.nested:
            value = d[name]
            if value is not None:
                d[name] = value.as_dict()
        for name in plan.nested_lists:
            d[name] = [v.as_dict() for v in d[name]]
        for name in plan.sometimes:
            if d[name] is None:
                del d[name]
        return d


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of `X | None`; other types as they are."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"only X | None is supported, not {tp}")
        return args[0], len(args) < len(get_args(tp))
    return tp, False


@cache
def _plan(cls: type) -> _Plan:
    hints = get_type_hints(cls)
    nested, lists, omitted = [], [], []
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(tp):
            nested.append(f.name)
        elif get_origin(tp) is list and dataclasses.is_dataclass(get_args(tp)[0]):
            lists.append(f.name)
        if f.metadata.get(SOMETIMES):
            omitted.append(f.name)
    return _Plan(tuple(nested), tuple(lists), tuple(omitted))


def schema_of(cls: type, components: Mapping[type, str]) -> dict[str, Any]:
    """The OpenAPI 3.0 schema of a view class: its fields as properties, those always present required.
    `components` names the classes that are schemas of their own ($ref); other dataclasses are inline."""
    hints = get_type_hints(cls)
    required, properties = [], {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get(SOMETIMES):
            required.append(f.name)
        tp, nullable = _unwrap(hints[f.name])
        schema = _type_schema(tp, components)
        if nullable and not f.metadata.get(SOMETIMES):
            # OpenAPI 3.0 ignores whatever sits beside a $ref: a nullable reference wraps it.
            schema = {"allOf": [schema], "nullable": True} if "$ref" in schema else {**schema, "nullable": True}
        properties[f.name] = {**schema, **f.metadata.get(OPENAPI, {})}
    return {"type": "object", "required": required, "properties": properties}


def _type_schema(tp: Any, components: Mapping[type, str]) -> dict[str, Any]:
    origin, args = get_origin(tp), get_args(tp)
    if tp is bool:  # before int: a bool is an int to issubclass
        return {"type": "boolean"}
    if tp is str:
        return {"type": "string"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        return {"type": "string", "enum": [m.value for m in tp]}
    if origin is Literal and all(isinstance(a, str) for a in args):
        return {"type": "string", "enum": list(args)}
    if isinstance(tp, type) and tp in components:
        return {"$ref": f"#/components/schemas/{components[tp]}"}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return schema_of(tp, components)
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0], components)}
    if origin is dict and args[0] is str:
        return {"type": "object",
                "additionalProperties": True if args[1] is Any else _type_schema(args[1], components)}
    raise TypeError(f"no OpenAPI schema for {tp!r}")
