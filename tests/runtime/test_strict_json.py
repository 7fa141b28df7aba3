"""``frod_ds.runtime.strict_json``: JSON nested past what Python's parser follows is a ``JSONDecodeError`` naming
the depth and where it is reached (``json.loads`` raises ``RecursionError``, which no reader's handler names),
and everything ``json.loads`` reads is read the same."""

from __future__ import annotations

import json

import pytest

from frod_ds.runtime.strict_json import MAX_DEPTH, NestedTooDeepError, loads, nesting_depth, parse_json


@pytest.mark.parametrize(
    "text",
    ['{"a": [1, 2, {"b": "]]]{{"}], "c": null}', "[]", '"x"', "1e3", '[[[[["\\"[["]]]]]'],
)
def test_loads_reads_what_json_reads(text):
    assert loads(text) == json.loads(text) == parse_json(text)


@pytest.mark.parametrize("reader", [loads, parse_json])
def test_nesting_too_deep_is_a_decode_error_at_its_depth(reader):
    with pytest.raises(RecursionError):
        json.loads("[" * 100_000 + "]" * 100_000)
    text = '{"s": "[[[[", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(json.JSONDecodeError) as e:
        reader(text)
    assert isinstance(e.value, NestedTooDeepError)
    assert "nested 100001 deep" in e.value.msg  # the object and the arrays; the string's brackets are not nesting
    assert e.value.pos == text.index("[[[[[") + MAX_DEPTH - 1  # the bracket that opens level MAX_DEPTH + 1


def test_nesting_up_to_the_limit_is_read_and_one_more_level_refused():
    at_limit = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads(at_limit) == json.loads(at_limit) and nesting_depth(json.loads(at_limit)) == MAX_DEPTH
    assert nesting_depth({"a": [1, {"b": ()}], "c": 2}) == 4 and nesting_depth(7) == 0
    with pytest.raises(NestedTooDeepError, match=f"nested {MAX_DEPTH + 1} deep"):
        loads(b"[" + at_limit.encode() + b"]")
