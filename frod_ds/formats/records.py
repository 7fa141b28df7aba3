"""Typed on-disk records: dataclasses to and from JSON objects, checked field by field.

The factor-store manifest (``frod_ds.formats.factor_store``) and the adapter config (``frod_ds.formats.adapter_dir``)
are dataclasses; this module turns them into JSON objects and back. Reading checks that every required
field is there, that no unknown field is, and that each value has its field's type (``int`` is accepted
for ``float``; nested dataclasses, ``list[...]``, ``dict[str, ...]`` and ``X | None`` are followed), and
raises the caller's error type naming the file and the field. Imports nothing heavy (no torch).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from frod_ds.runtime.errors import FrodError
from frod_ds.runtime.strict_json import loads

__all__ = ["record_to_dict", "record_from_dict", "record_to_json", "parse_json"]

R = TypeVar("R")
_MISSING = dataclasses.MISSING


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return record_to_dict(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def record_to_dict(record: Any) -> dict[str, Any]:
    """A JSON-ready dict of a record, fields in declaration order (nested records too); an optional field
    that is ``None`` and defaults to ``None`` is left out."""
    return {
        f.name: _plain(getattr(record, f.name))
        for f in dataclasses.fields(record)
        if not (getattr(record, f.name) is None and f.default is None)
    }


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str, error: type[FrodError]) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], where, error)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return record_from_dict(tp, value, where, error)
    if origin is list:
        if not isinstance(value, list):
            raise error(f"{where}: expected a list, got {type(value).__name__}")
        return [_convert(v, args[0], f"{where}[{i}]", error) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise error(f"{where}: expected an object, got {type(value).__name__}")
        return {str(k): _convert(v, args[1], f"{where}.{k}", error) for k, v in value.items()}
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise error(f"{where}: expected {_type_name(tp)}, got {value!r}"[:300])


def record_from_dict(cls: type[R], data: Any, where: str, error: type[FrodError]) -> R:
    """``cls(**data)`` with every field checked; ``error`` naming ``where`` and the field otherwise."""
    if not isinstance(data, dict):
        raise error(f"{where}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise error(f"{where}: unknown field {unknown[0]!r} (written by a newer frod-ds, or edited by hand)")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], f"{where}.{name}", error)
        elif f.default is _MISSING and f.default_factory is _MISSING:
            raise error(f"{where}: field {name!r} is missing")
    return cls(**kwargs)


def record_to_json(record: Any, indent: int = 1, sort_keys: bool = False) -> str:
    """:func:`record_to_dict` as JSON text, newline-terminated."""
    return json.dumps(record_to_dict(record), indent=indent, sort_keys=sort_keys) + "\n"


def changed_keys(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The keys of either mapping whose values differ (a missing key counts as ``None``), sorted."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def parse_json(text: str, where: str | Path, error: type[FrodError], hint: str = "") -> Any:
    """``json.loads(text)``; ``error`` saying ``where`` is corrupt (and ``hint``: what to do) otherwise."""
    try:
        return loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{where} is corrupt: not valid JSON ({e}){hint}") from None
