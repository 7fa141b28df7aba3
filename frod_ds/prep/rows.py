"""Output format of ``frod data build``: JSONL rows ``{task, id, prompt, [separator,] answer, choices, label}``.

The training text of a row is ``prompt + row_separator(row) + answer`` (+ EOS); log-likelihood scoring
conditions on ``prompt + row_separator(row)`` (``ANSWER_SEPARATOR`` unless the row carries ``"separator"``).
Training and evaluation read the files through `read_rows`, which checks every row; the fixed serialization
that makes builds byte-identical: docs/data.md#the-templates-and-files-in-detail.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from frod_ds.prep.tasks import DataPrepError
from frod_ds.runtime.strict_json import DuplicateKeyError, parse_json

FIELDS: dict[str, type] = {"task": str, "id": str, "prompt": str, "answer": str, "choices": list, "label": int}
OPTIONAL_FIELDS: dict[str, type] = {"separator": str}
# Key order on disk: a row without the optional fields serializes exactly as before they existed.
ORDER = ("task", "id", "prompt", "separator", "answer", "choices", "label")

# The paper-template separator between prompt and answer (the FRoD paper's "\nAnswer: ").
ANSWER_SEPARATOR = "\nAnswer: "

# A row whose prompt + answer is longer than this is no sensible prompt: build drops it, training refuses it.
MAX_ROW_CHARS = 100_000


def row_separator(row: dict[str, Any]) -> str:
    """The text between a row's ``prompt`` and its answer: its ``separator`` field, else `ANSWER_SEPARATOR`."""
    return row["separator"] if "separator" in row else ANSWER_SEPARATOR


def training_text(row: dict[str, Any]) -> str:
    """``prompt + row_separator(row) + answer``: a row's training text, EOS excluded."""
    return row["prompt"] + row_separator(row) + row["answer"]


def dumps_row(row: dict[str, Any]) -> str:
    """Canonical one-line JSON of an output row (fields in `ORDER`; optional ones only when present)."""
    return json.dumps({key: row[key] for key in ORDER if key in FIELDS or key in row}, ensure_ascii=True)


def write_rows(path: Path, rows: Iterable[dict[str, Any]]) -> str:
    """Write `rows` as JSONL to `path`; return the file's sha256 hex digest."""
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for row in rows:
            line = (dumps_row(row) + "\n").encode("ascii")
            digest.update(line)
            f.write(line)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    """sha256 hex digest of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def row_strings(row: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """``(where, text)`` for every string of ``row``: a field (``'prompt'``) or a list's entry (``'choices'[1]``)."""
    for key, value in row.items():
        for i, text in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(text, str):
                yield f"'{key}'" + (f"[{i}]" if isinstance(value, list) else ""), text


def text_problem(row: dict[str, Any]) -> str | None:
    """The first string of ``row`` (a field, or an entry of ``choices``) holding a lone surrogate: JSON's ``\\ud800``
    escapes decode to one, which no tokenizer can encode (training would stop mid-run)."""
    for where, text in row_strings(row):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (
                f"field {where} holds a lone surrogate {text[exc.start]!r} at character {exc.start} (not Unicode text)"
            )
    return None


def choices_problem(choices: list[str]) -> str | None:
    """A multiple-choice row needs two distinct answers: with one, or two the same, scoring gives a free point."""
    if len(choices) < 2:
        return f"fewer than two choices ({choices!r}): nothing to choose between"
    repeated = sorted({c for c in choices if choices.count(c) > 1})
    if repeated:
        return f"duplicate choices ({repeated[0]!r} is given {choices.count(repeated[0])} times)"
    return None


def check_row(row: Any) -> str | None:
    """Why `row` is not a valid output row, or None if it is."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    for key, kind in FIELDS.items():
        if key not in row:
            return f"missing field '{key}'"
        if type(row[key]) is not kind:
            return f"field '{key}' must be {kind.__name__}, got {type(row[key]).__name__}"
    for key, kind in OPTIONAL_FIELDS.items():
        if key in row and type(row[key]) is not kind:
            return f"field '{key}' must be {kind.__name__} when present, got {type(row[key]).__name__}"
    return label_problem(row) or text_problem(row)


def label_problem(row: dict[str, Any]) -> str | None:
    """A multiple-choice row's ``choices``, ``label`` and ``answer`` agree: two distinct string choices and an
    integer label pointing at the answer (training applies it to any row that has either field)."""
    choices, label = row.get("choices"), row.get("label")
    if not isinstance(choices, list) or not choices or not all(type(c) is str for c in choices):
        return "field 'choices' must be a non-empty list of strings"
    if type(label) is not int:
        return f"field 'label' must be int, got {type(label).__name__}"
    if not 0 <= label < len(choices):
        return f"label {label} out of range for {len(choices)} choices"
    if choices[label] != row["answer"]:
        return f"answer {row['answer']!r} is not choices[{label}] ({choices[label]!r})"
    return choices_problem(choices)


def repeated_id(rows: list[dict[str, Any]]) -> tuple[int, int, str] | None:
    """``(first row, repeat, id)`` (1-based) of the first string ``id`` two rows share: scored or trained twice."""
    first: dict[str, int] = {}
    for i, row in enumerate(rows, start=1):
        rid = row.get("id")
        if isinstance(rid, str) and first.setdefault(rid, i) != i:
            return first[rid], i, rid
    return None


def read_rows(
    path: str | Path, check: Callable[[Any], str | None] = check_row, limit: int | None = None
) -> list[dict[str, Any]]:
    """Read and validate a JSONL file (by default, ``frod data build``'s output schema).

    ``check`` returns why a row is invalid or None; ``limit`` stops after that many rows.
    Raises DataPrepError naming the file and 1-based line of the first bad row.
    """
    rows = []
    line_no = 0
    try:
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a leading byte-order mark is no row
                if not line.strip():
                    continue
                try:
                    row = parse_json(line)
                except json.JSONDecodeError as exc:
                    raise DataPrepError(f"{path} line {line_no}: not valid JSON ({exc.msg})") from None
                except DuplicateKeyError as exc:  # JSON keeps the last value: which one the author meant is unknown
                    raise DataPrepError(f"{path} line {line_no}: {exc}") from None
                problem = check(row)
                if problem:
                    raise DataPrepError(f"{path} line {line_no}: {problem}")
                rows.append(row)
                if limit is not None and len(rows) >= limit:
                    break
    except UnicodeDecodeError as exc:
        raise DataPrepError(
            f"{path} line {line_no}: not valid UTF-8 ({exc.reason} at byte {exc.start} of the line)"
        ) from None
    return rows
