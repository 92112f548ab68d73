"""Frozen dataclasses to and from their JSON form, at the edges where records meet files
(step_analysis.json, the study's results.jsonl, a trial's spec and result files).

Between modules a record travels as a dataclass; JSON is made and read only where a file is
written or read. The form follows the fields: a nested record is an object, a tuple a list, a
dict an object. A field whose default is None is left out while it is None (the files never
held it then), unless it is declared `written_when_none()`; a field without a default is always
written, null included. A record whose
file form differs from its fields overrides `to_json`/`from_json`, and nested records are read
and written through those.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, Self, TypeVar

T = TypeVar("T")
_WRITTEN_WHEN_NONE = "written_when_none"


class JsonRecord:
    """A frozen dataclass with a JSON form (the module docstring's)."""

    def to_json(self) -> dict[str, Any]:
        return fields_to_json(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        return fields_from_json(cls, data)


def written_when_none() -> Any:
    """A field that defaults to None and that the JSON form holds as null, not leaves out."""
    return dataclasses.field(default=None, metadata={_WRITTEN_WHEN_NONE: True})


def to_json(value: Any) -> Any:
    """The JSON form of a value: records by their own `to_json` where they have one."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        custom = getattr(value, "to_json", None)
        return custom() if custom is not None else fields_to_json(value)
    if isinstance(value, tuple | list):
        return [to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: to_json(item) for key, item in value.items()}
    return value


def fields_to_json(record: Any) -> dict[str, Any]:
    """Each field of `record` by name, left out where it is None and None is its default
    (unless the field is `written_when_none`)."""
    return {
        field.name: to_json(getattr(record, field.name))
        for field in dataclasses.fields(record)
        if getattr(record, field.name) is not None
        or field.default is not None
        or field.metadata.get(_WRITTEN_WHEN_NONE)
    }


def fields_from_json(cls: type[T], data: Mapping[str, Any]) -> T:
    """`cls` from its fields' JSON form; a field the data lacks takes its default, and keys
    that are no field are ignored (a file may hold more than the record reads)."""
    hints = _hints(cls)
    values = {
        field.name: _convert(hints[field.name], data[field.name])
        for field in dataclasses.fields(cls)
        if field.init and field.name in data
    }
    return cls(**values)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(hint: Any, value: Any) -> Any:
    """`value`, from JSON, as the type `hint` says: records, tuples and dicts of them."""
    if value is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = [arg for arg in args if arg is not type(None)]
        return _convert(kinds[0], value) if len(kinds) == 1 else value
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], item) for item in value)
        return tuple(_convert(arg, item) for arg, item in zip(args, value, strict=True))
    if origin is dict:
        return {key: _convert(args[1], item) for key, item in value.items()}
    if dataclasses.is_dataclass(hint):
        reader = getattr(hint, "from_json", None)
        return reader(value) if reader is not None else fields_from_json(hint, value)
    return value
