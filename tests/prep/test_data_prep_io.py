"""`frod_ds.prep.rows.read_rows`: the reader training and eval use checks every row of the output format."""

from __future__ import annotations

import json

import pytest

from data_prep import DataPrepError, read_rows
from frod_ds.prep.rows import write_rows

GOOD = {
    "task": "piqa",
    "id": "piqa-train-0",
    "prompt": "p {x}\n\u00e9",
    "answer": "Choice B",
    "choices": ["Choice A", "Choice B"],
    "label": 1,
}


def test_write_then_read_round_trips(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_rows(path, [GOOD, {**GOOD, "id": "piqa-train-1", "prompt": "line\u2028sep"}])
    assert read_rows(path) == [GOOD, {**GOOD, "id": "piqa-train-1", "prompt": "line\u2028sep"}]
    assert path.read_bytes().count(b"\n") == 2


def test_a_byte_order_mark_before_the_first_row_is_read_past(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_rows(path, [GOOD, {**GOOD, "id": "piqa-train-1"}])
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert read_rows(path) == [GOOD, {**GOOD, "id": "piqa-train-1"}]
    path.write_bytes(path.read_bytes().replace(b"}\n{", b"}\n\xef\xbb\xbf{"))  # not at the start: not text
    with pytest.raises(DataPrepError, match="line 2: not valid JSON"):
        read_rows(path)


@pytest.mark.parametrize(
    "row,message",
    [
        ({k: v for k, v in GOOD.items() if k != "answer"}, "missing field 'answer'"),
        ({**GOOD, "label": "1"}, "field 'label' must be int, got str"),
        ({**GOOD, "label": True}, "field 'label' must be int, got bool"),
        ({**GOOD, "choices": "Choice A"}, "field 'choices' must be list, got str"),
        ({**GOOD, "choices": []}, "field 'choices' must be a non-empty list of strings"),
        ({**GOOD, "label": 2}, "label 2 out of range for 2 choices"),
        ({**GOOD, "answer": "Choice A"}, "answer 'Choice A' is not choices[1] ('Choice B')"),
        (["a", "list"], "expected a JSON object, got list"),
    ],
)
def test_bad_row_raises_value_error_naming_file_and_line(tmp_path, row, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError) as info:
        read_rows(path)
    assert str(info.value) == f"{path} line 3: {message}"


def test_invalid_json_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{oops\n")
    with pytest.raises(ValueError, match=rf"^{path} line 2: not valid JSON"):
        read_rows(path)


def test_a_key_given_twice_in_a_row_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD)[:-1] + ', "answer": "other"}\n')
    with pytest.raises(ValueError) as info:
        read_rows(path)
    assert str(info.value).startswith(f'{path} line 2: key "answer" is given twice in the top level')


def test_data_prep_error_is_a_one_line_value_error():
    err = DataPrepError("first\nsecond")
    assert isinstance(err, ValueError) and str(err) == "first second"
