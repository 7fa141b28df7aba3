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


def test_expanded_size_counts_shared_values_at_each_place_without_expanding_them():
    """A YAML alias is the same object at every place it appears: the count is what a walk would visit (checked
    against counting a JSON round trip, which copies each place), and a billion-laughs value is counted at once."""
    import time

    from frod_ds.runtime.strict_json import expanded_size

    def walked(v) -> int:  # an independent count: the copy JSON makes of every shared place
        v = json.loads(json.dumps(v))
        stack, n = [v], 0
        while stack:
            x = stack.pop()
            n += 1
            stack.extend(x.values() if isinstance(x, dict) else x if isinstance(x, list) else [])
        return n

    leaf = ["a", 1, None]
    shared = {"x": leaf, "y": [leaf, leaf, {"z": leaf}], "s": "t"}
    assert expanded_size(shared, 10**6) == walked(shared) == 20
    assert expanded_size(3, 10) == walked(3) == 1
    assert expanded_size(shared, 5) == 6  # counted only to the limit + 1
    level = ["lol"] * 9
    for _ in range(8):
        level = [level] * 9  # 9^9 strings as nine levels of aliases
    t0 = time.perf_counter()
    assert expanded_size({"bomb": level}, 10_000) == 10_001 and time.perf_counter() - t0 < 1.0
    loop: dict = {"a": 1}
    loop["self"] = loop
    assert expanded_size([loop], 10**6) == 10**6 + 1
