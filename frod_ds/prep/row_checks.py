"""The build's checks of rendered rows, after the templates: what training or scoring would refuse or count wrong.

``drop_rows_training_refuses`` drops (and counts per reason) a repeated ``id``, a row over ``MAX_ROW_CHARS``, a lone
surrogate (text no tokenizer encodes), a control character (a damaged file) and a multiple-choice row with fewer
than two or repeated choices (a free point when scored); ``count_repeats`` finds rows that repeat an earlier row of
their split verbatim: training rows are dropped unless kept on purpose, test rows kept as published, both counted.
``--strict`` makes each an error naming the row. A split is a ``frod_ds.prep.dataset.SplitResult`` (``task``,
``role``, ``origin``, ``rows``, ``dropped``, ``repeated``).
"""

from __future__ import annotations

import re
import sys
from typing import Any

from frod_ds.prep.rows import MAX_ROW_CHARS, choices_problem, row_strings, text_problem
from frod_ds.prep.tasks import DataPrepError

__all__ = [
    "DUPLICATE_ID",
    "OVERLONG",
    "LONE_SURROGATE",
    "CONTROL_CHAR",
    "FEW_CHOICES",
    "SAME_CHOICES",
    "REPEATED",
    "drop_rows_training_refuses",
    "count_repeats",
    "count_test_in_training",
]

# drop reasons as counted in the manifest (value-free keys)
DUPLICATE_ID = "duplicate id"
OVERLONG = f"prompt + answer over {MAX_ROW_CHARS} characters"
LONE_SURROGATE = "lone surrogate (not Unicode text)"
CONTROL_CHAR = "control character (a damaged file)"
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # C0 controls and DEL, not tab or line breaks


def control_problem(row: dict[str, Any]) -> str | None:
    """The first string of ``row`` holding a control character (a NUL, an escape, ...): no dataset's text holds
    one, a file cut or mis-decoded does; tab and line breaks are text."""
    for where, text in row_strings(row):
        if m := _CONTROL.search(text):
            return f"field {where} holds control character U+{ord(m.group()):04X} at character {m.start()}"
    return None


FEW_CHOICES = "fewer than two choices"
SAME_CHOICES = "duplicate choices"
REPEATED = "repeated row"


def _problem(row: dict[str, Any], seen: set[str]) -> tuple[str, str] | None:
    """``(reason, detail)`` of the first check ``row`` fails, or None."""
    if row["id"] in seen:
        return DUPLICATE_ID, DUPLICATE_ID
    if len(row["prompt"]) + len(row["answer"]) > MAX_ROW_CHARS:
        return OVERLONG, OVERLONG
    text = text_problem(row)
    if text:
        return LONE_SURROGATE, text
    control = control_problem(row)
    if control:
        return CONTROL_CHAR, control
    choices = choices_problem(row["choices"])
    if choices:
        return (FEW_CHOICES if len(row["choices"]) < 2 else SAME_CHOICES), choices
    return None


def drop_rows_training_refuses(result: Any, strict: bool) -> None:
    """Drop (and count) the rows of one split that training or scoring would refuse or score wrong (the first of a
    repeated id is kept); with ``strict`` the first is an error naming the task, file and row. A lone surrogate or a
    control character is named in a note even when dropped: it means the source file is damaged."""
    seen: set[str] = set()
    kept = []
    for row in result.rows:
        problem = _problem(row, seen)
        if problem is None:
            seen.add(row["id"])
            kept.append(row)
            continue
        reason, detail = problem
        if strict:
            raise DataPrepError(f"{result.task}: {result.origin} row id {row['id']!r}: {detail} (--strict)")
        if reason in (LONE_SURROGATE, CONTROL_CHAR) and not result.dropped[reason]:
            print(f"note: {result.task}: {result.origin} row id {row['id']!r}: {detail}; dropped", file=sys.stderr)
        result.dropped[reason] += 1
    result.rows = kept


def _content(row: dict[str, Any]) -> tuple:
    """What a row says, without its id: two rows with equal content train or score the same example twice."""
    return row["prompt"], row.get("separator"), row["answer"], tuple(row["choices"]), row["label"]


def count_repeats(result: Any, strict: bool, keep: bool) -> None:
    """Count the rows of one split that repeat an earlier row verbatim (``result.repeated``). Training rows are
    dropped (``REPEATED``) unless ``keep``; test rows stay as published (each repeat is scored again). ``strict``:
    the first repeat of either is an error naming both rows."""
    first: dict[tuple, str] = {}
    kept = []
    for row in result.rows:
        key = _content(row)
        if key not in first:
            first[key] = row["id"]
            kept.append(row)
            continue
        if strict:
            what = "a training row is dropped" if result.role == "train" else "a test row is kept as published"
            raise DataPrepError(
                f"{result.task}: {result.origin} row id {row['id']!r} repeats row id {first[key]!r} verbatim "
                f"(--strict; without it {what} and counted)"
            )
        result.repeated += 1
        if result.role == "train" and not keep:
            result.dropped[REPEATED] += 1
            continue
        kept.append(row)
    result.rows = kept


def _wording(row: dict[str, Any]) -> tuple:
    """A row's content with its prompt's whitespace collapsed: LLM-Adapters' training and test templates lay out one
    instruction with different indentation, which must not hide a test row trained on."""
    return " ".join(row["prompt"].split()), row["answer"], tuple(row["choices"]), row["label"]


def count_test_in_training(results: list[Any], strict: bool) -> dict[str, int]:
    """Per task, the test rows that appear verbatim in that task's training rows (the published LLM-Adapters
    ARC-Easy holds two): both are kept as published and counted, since training on a test row inflates its score;
    ``strict``: the first is an error naming both rows."""
    trained = {(r.task, _wording(row)): row["id"] for r in results if r.role == "train" for row in r.rows}
    out: dict[str, int] = {}
    for r in results:
        if r.role != "eval":
            continue
        for row in r.rows:
            hit = trained.get((r.task, _wording(row)))
            if hit is None:
                continue
            if strict:
                raise DataPrepError(
                    f"{r.task}: {r.origin} test row id {row['id']!r} appears verbatim in training as row id {hit!r} "
                    "(--strict; without it both are kept as published and counted)"
                )
            out[r.task] = out.get(r.task, 0) + 1
    return out
