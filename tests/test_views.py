"""Views: one frozen dataclass gives both a JSON object and its OpenAPI 3.0 schema."""
from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Any, Literal

import pytest

from trainmedic.service.store.schema import TIME, View, schema_of, view


class Color(StrEnum):
    RED = "red"
    BLUE = "blue"


@view
class Inner(View):
    n: int = dataclasses.field(metadata={"minimum": 0})
    tag: str | None


@view
class Outer(View):
    name: str = dataclasses.field(metadata={"example": "x"})
    color: Color
    kind: Literal["a", "b"]
    at: str | None = dataclasses.field(metadata=TIME)
    inner: Inner
    maybe: Inner | None
    items: list[Inner]
    labels: dict[str, str]
    anything: dict[str, Any]
    ratio: float
    flag: bool
    note: str | None = None


def outer(**changes: Any) -> Outer:
    made = Outer(name="n", color=Color.RED, kind="a", at=None, inner=Inner(n=1, tag=None), maybe=None,
                 items=[Inner(n=2, tag="t")], labels={"k": "v"}, anything={"x": [1]}, ratio=0.5, flag=True)
    return dataclasses.replace(made, **changes)


def test_a_views_schema_comes_from_its_fields_and_their_types() -> None:
    inner = {"$ref": "#/components/schemas/Inner"}
    assert schema_of(Outer, {Inner: "Inner"}) == {
        "type": "object",
        "required": ["name", "color", "kind", "at", "inner", "maybe", "items", "labels", "anything", "ratio", "flag"],
        "properties": {
            "name": {"type": "string", "example": "x"},
            "color": {"type": "string", "enum": ["red", "blue"]},
            "kind": {"type": "string", "enum": ["a", "b"]},
            "at": {"type": "string", "nullable": True, "format": "date-time"},
            "inner": inner,
            "maybe": {"allOf": [inner], "nullable": True},
            "items": {"type": "array", "items": inner},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "anything": {"type": "object", "additionalProperties": True},
            "ratio": {"type": "number"},
            "flag": {"type": "boolean"},
            "note": {"type": "string"},  # left out while None: neither required nor nullable
        },
    }
    # A dataclass that is not a named component is described inline.
    assert schema_of(Outer, {})["properties"]["inner"] == {
        "type": "object", "required": ["n", "tag"],
        "properties": {"n": {"type": "integer", "minimum": 0}, "tag": {"type": "string", "nullable": True}}}


def test_a_views_json_has_its_fields_in_order_nested_views_shown_and_unset_optional_keys_left_out() -> None:
    d = outer().as_dict()
    assert list(d) == ["name", "color", "kind", "at", "inner", "maybe", "items", "labels", "anything", "ratio",
                       "flag"]
    assert d["inner"] == {"n": 1, "tag": None} and d["maybe"] is None and d["items"] == [{"n": 2, "tag": "t"}]
    assert outer(note="hi", maybe=Inner(n=0, tag="m")).as_dict()["note"] == "hi"
    assert outer(maybe=Inner(n=0, tag="m")).as_dict()["maybe"] == {"n": 0, "tag": "m"}
    # Each call makes a new object: changing it changes nothing in the view.
    d["inner"]["n"] = 99
    assert outer().as_dict()["inner"]["n"] == 1


def test_a_view_is_a_frozen_dataclass_whose_optional_fields_default_to_none() -> None:
    v = outer()
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Inner(n=1)  # type: ignore[call-arg]
    assert v.note is None and v == outer() and v != outer(flag=False)
    with pytest.raises(TypeError, match="no default, or None"):
        @view
        class Bad(View):
            n: int = 0


def test_a_type_without_a_schema_is_refused() -> None:
    @view
    class Odd(View):
        when: tuple[int, int]

    with pytest.raises(TypeError, match="no OpenAPI schema"):
        schema_of(Odd, {})
