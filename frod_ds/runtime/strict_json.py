"""JSON that refuses a key given twice in one object: ``json.loads`` keeps the last value without a word, so a
hand-edited file (a DeepSpeed JSON, a data row) could mean one thing to its author and another to the run."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["DuplicateKeyError", "parse_json"]


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

    data = json.loads(text, object_pairs_hook=pairs)
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
