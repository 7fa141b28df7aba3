"""JSON that refuses a key given twice in one object: ``json.loads`` keeps the last value without a word, so a
hand-edited file (a DeepSpeed JSON, a data row) could mean one thing to its author and another to the run. And
JSON nested deeper than any input needs: Python's parser raises ``RecursionError`` on it, which no reader's
``JSONDecodeError`` handler names; ``loads`` refuses it as a ``JSONDecodeError`` at the depth it passes. Likewise
an integer longer than Python converts (``sys.get_int_max_str_digits``, 4300 digits): a plain ``ValueError``
there, a ``HugeIntegerError`` (a ``JSONDecodeError``) here."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

__all__ = [
    "MAX_DEPTH",
    "DuplicateKeyError",
    "HugeIntegerError",
    "NestedTooDeepError",
    "expanded_size",
    "loads",
    "nesting_depth",
    "parse_json",
]


MAX_DEPTH = 100  # levels of arrays and objects: no input the project reads needs more than a handful


class NestedTooDeepError(json.JSONDecodeError):
    """JSON nested deeper than ``MAX_DEPTH``; its position is where that depth is first passed."""


class HugeIntegerError(json.JSONDecodeError):
    """An integer with more digits than Python converts; its position is where that integer starts."""


# A JSON string (skipped) or number; group 1: the digits of a number with neither fraction nor exponent.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|-?(\d+)(?![\d.eE])|-?\d+(?:\.\d*)?(?:[eE][+-]?\d*)?')


def loads(text: str | bytes, **kw: Any) -> Any:
    """``json.loads``, refusing arrays and objects nested deeper than ``MAX_DEPTH`` (``NestedTooDeepError``, a
    ``JSONDecodeError``): ``json.loads`` itself raises ``RecursionError`` on deep enough input, and so would every
    recursive walk over what it returns. An integer too long for ``int`` is a ``HugeIntegerError``, also a
    ``JSONDecodeError``, so that every reader's handler names it in its one line."""
    try:
        data = json.loads(text, **kw)
    except RecursionError:
        data = None
    except json.JSONDecodeError:
        raise
    except ValueError as e:
        if "integer string conversion" not in str(e):
            raise
        raise _huge_integer(text) from None
    else:
        if nesting_depth(data) <= MAX_DEPTH:
            return data
    doc = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    depth, pos = _deepest(doc)
    raise NestedTooDeepError(
        f"arrays and objects nested {depth} deep, more than the {MAX_DEPTH} levels an input may have", doc, pos
    ) from None


def _huge_integer(text: str | bytes) -> HugeIntegerError:
    """The error for the first integer of ``text`` longer than ``sys.get_int_max_str_digits()`` digits."""
    doc = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    limit = sys.get_int_max_str_digits()
    for m in _TOKEN.finditer(doc):
        if m.group(1) is not None and len(m.group(1)) > limit:
            digits = len(m.group(1))
            return HugeIntegerError(
                f"an integer of {digits} digits, more than the {limit} a number may have; no setting or row needs "
                "one this long: fix the value",
                doc,
                m.start(),
            )
    return HugeIntegerError(f"an integer of more than {limit} digits; fix the value", doc, 0)


def _children(node: Any) -> Any:
    if isinstance(node, dict):
        return node.values()
    return node if isinstance(node, (list, tuple)) else None


def expanded_size(value: Any, limit: int) -> int:
    """How many values ``value`` holds with every list or mapping it shares (a YAML alias: ``*a`` is the object
    ``&a`` names, not a copy) counted at each place it appears, as any walk over it would visit them; counted per
    object, never expanded, and only to ``limit`` + 1 (also for an object that contains itself)."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        node, closing = stack.pop()
        kids = _children(node)
        if kids is None or (id(node) in sizes and not closing):
            continue
        if closing:
            open_.discard(id(node))
            total = 1 + sum(1 if _children(k) is None else sizes[id(k)] for k in kids)
            sizes[id(node)] = min(total, limit + 1)
            continue
        if id(node) in open_:
            return limit + 1  # it contains itself
        open_.add(id(node))
        stack.append((node, True))
        for k in kids:
            if _children(k) is not None:
                if id(k) in open_:
                    return limit + 1
                stack.append((k, False))
    return sizes.get(id(value), 1)


def nesting_depth(value: Any) -> int:
    """How deeply ``value``'s lists, tuples and dicts nest (0: a scalar); counted without recursion and only to
    one past ``MAX_DEPTH``."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_DEPTH:
        node, depth = stack.pop()
        children = _children(node)
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _deepest(doc: str) -> tuple[int, int]:
    """The deepest nesting of ``doc``'s arrays and objects (strings skipped) and where ``MAX_DEPTH`` is first
    passed."""
    depth = best = 0
    pos = None
    in_string = escaped = False
    for i, ch in enumerate(doc):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            best = max(best, depth)
            if depth > MAX_DEPTH and pos is None:
                pos = i
        elif ch in "]}":
            depth -= 1
    return best, pos or 0


class DuplicateKeyError(ValueError):
    """A key given twice in one JSON object; ``path`` is where (dotted, "" at the top level)."""

    def __init__(self, key: str, path: str) -> None:
        self.key, self.path = key, path
        where = f'"{path}"' if path else "the top level"
        super().__init__(f'key "{key}" is given twice in {where} (JSON keeps only the last value); remove one')


def parse_json(text: str) -> Any:
    """``json.loads`` that refuses a key given twice in one object (``DuplicateKeyError`` naming where)."""
    seen: list[tuple[str, list[str]]] = []

    def pairs(items: list[tuple[str, Any]]) -> dict:
        keys = [k for k, _ in items]
        for k in keys:
            if keys.count(k) > 1:
                seen.append((k, keys))
                break
        return dict(items)

    data = loads(text, object_pairs_hook=pairs)
    if seen:
        key, keys = seen[0]
        raise DuplicateKeyError(key, _path_of(data, set(keys)) or "")
    return data


def _path_of(node: Any, keys: set[str], prefix: str = "") -> str | None:
    """The dotted path of the object in ``node`` whose keys are ``keys``."""
    if isinstance(node, dict):
        if set(node) == keys:
            return prefix.rstrip(".")
        children: Any = node.items()
    elif isinstance(node, list):
        children = enumerate(node)
    else:
        return None
    for k, v in children:
        found = _path_of(v, keys, f"{prefix}{k}.")
        if found is not None:
            return found
    return None
