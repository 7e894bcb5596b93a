"""What the API shows, typed: frozen dataclasses (@view) whose fields are a JSON object's keys. One definition
gives both the JSON (View.as_dict) and the OpenAPI 3.0 schema (schema_of), so the two cannot drift apart.

A field's type says its schema: str, int, float, bool, a StrEnum or a Literal of strings (an enum), a list, a
dict of strings to a type (or to Any: any JSON), another dataclass (a $ref when it is a named component, else
inline), and `X | None` for a key that may be null. A field without a default is a key the JSON always has
(required); one with a default, None, is a key the JSON has only while it holds a value (left out when None).
A field's metadata (dataclasses.field(metadata=...)) holds its OpenAPI extras: description, example, pattern,
format...
"""
from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any, Literal, TypeVar, Union, dataclass_transform, get_args, get_origin, get_type_hints

# A field's format for a time (RFC 3339), as its metadata.
TIME: Mapping[str, Any] = {"format": "date-time"}

V = TypeVar("V", bound="View")


class View:
    """The base of a @view class: its JSON."""

    __slots__ = ()

    def as_dict(self) -> dict[str, Any]:
        """The JSON object, its keys in field order."""
        # Made for each class on its first use, then called directly (see _as_dict).
        made = _as_dict(type(self))
        type(self).as_dict = made  # type: ignore[method-assign, assignment]
        return made(self)


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def view(cls: type[V]) -> type[V]:
    """A frozen dataclass the API shows (see the module's docstring)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.default_factory is not dataclasses.MISSING or f.default not in (None, dataclasses.MISSING):
            raise TypeError(f"{cls.__name__}.{f.name}: a view's field has no default, or None")
    cls.__init__ = _fast_init(cls)  # type: ignore[method-assign]
    return cls


def _fast_init(cls: type) -> Callable[..., None]:
    """An __init__ with the dataclass's signature that sets the instance's __dict__ in one step: a frozen
    dataclass's own sets each field through object.__setattr__, several µs for a record's fields, on the path
    that shows a page of the history (a million records)."""
    fields = dataclasses.fields(cls)
    params = ", ".join(f.name if f.default is dataclasses.MISSING else f"{f.name}=None" for f in fields)
    values = ", ".join(f"{f.name!r}: {f.name}" for f in fields)
    namespace: dict[str, Any] = {"_set": object.__setattr__}
    exec(f"def __init__(self, {params}):\n    _set(self, '__dict__', {{{values}}})\n", namespace)
    init: Callable[..., None] = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    return init


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of `X | None`; other types as they are."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"only X | None is supported, not {tp}")
        return args[0], len(args) < len(get_args(tp))
    return tp, False


def _always(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING


def _as_dict(cls: type) -> Callable[[Any], dict[str, Any]]:
    """A view class's as_dict, made from its fields: its instance's __dict__ (exactly its fields, in order: see
    _fast_init) copied, nested views shown, and the keys of fields with a default left out while None."""
    hints = get_type_hints(cls)
    lines = ["def as_dict(self):", "    d = self.__dict__.copy()"]
    for f in dataclasses.fields(cls):
        tp, nullable = _unwrap(hints[f.name])
        key = repr(f.name)
        if dataclasses.is_dataclass(tp):
            lines += [f"    v = d[{key}]", f"    if v is not None: d[{key}] = v.as_dict()"] if nullable else [
                f"    d[{key}] = d[{key}].as_dict()"]
        elif get_origin(tp) is list and dataclasses.is_dataclass(get_args(tp)[0]):
            shown = f"[x.as_dict() for x in d[{key}]]"
            lines.append(f"    if d[{key}] is not None: d[{key}] = {shown}" if nullable else f"    d[{key}] = {shown}")
        if not _always(f):
            lines.append(f"    if d[{key}] is None: del d[{key}]")
    namespace: dict[str, Any] = {}
    exec("\n".join([*lines, "    return d", ""]), namespace)
    as_dict: Callable[[Any], dict[str, Any]] = namespace["as_dict"]
    as_dict.__qualname__ = f"{cls.__qualname__}.as_dict"
    return as_dict


def schema_of(cls: type, components: Mapping[type, str]) -> dict[str, Any]:
    """The OpenAPI 3.0 schema of a view class: its fields as properties, those always present required.
    `components` names the classes that are schemas of their own ($ref); other dataclasses are inline."""
    hints = get_type_hints(cls)
    required, properties = [], {}
    for f in dataclasses.fields(cls):
        tp, nullable = _unwrap(hints[f.name])
        schema = _type_schema(tp, components)
        if _always(f):
            required.append(f.name)
            if nullable:
                # OpenAPI 3.0 ignores what sits beside a $ref: a nullable reference wraps it.
                schema = {"allOf": [schema], "nullable": True} if "$ref" in schema else {**schema, "nullable": True}
        properties[f.name] = {**schema, **f.metadata}
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
