"""The paper's zero-shot prompt templates (FRoD, Appendix D.1), one pure renderer per task.

Each renderer maps one source row, in its task's Hugging Face schema, to an `Example` (``prompt``, answer
strings ``choices``, gold index ``label``); a row that does not fit raises `RowError`, whose ``reason`` the build
counts drops under. Rendered character for character, fields verbatim; a training example is
``prompt + "\nAnswer: " + answer`` (+ EOS). Answer strings and the ARC template (the paper gives none):
docs/data.md#the-templates-and-files-in-detail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from frod_ds.prep.rows import ANSWER_SEPARATOR  # noqa: F401  (re-exported: training text = prompt + it + answer)

BOOLQ = "Reference document:\n{passage}\nQuestion:\n{question}"
PIQA = (
    "Physical situation description:\n{goal}\nChoice A:\n{sol1}\nChoice B:\n{sol2}\nQuestion:\n"
    "Which solution is more physically plausible, Choice A or Choice B?"
)
SIQA = (
    "Please choose the correct Choice to the question: {context}, Question:\n{question}\n"
    "Choice A:\n{answerA}\nChoice B:\n{answerB}\nChoice C:\n{answerC}\n"
    "Which choice best answers the question, Choice A, B, or C?"
)
HELLASWAG = (
    "Context:\n{ctx}\n{endings}Question:\nWhich ending is the most plausible continuation, Ending A, B, C, or D?"
)
HELLASWAG_ENDING = "Ending {k}:\n{text}\n"
WINOGRANDE = (
    "Please choose the correct answer to fill in the blank to complete the given sentence: "
    "{sentence}\n\nOption1: {option1}\nOption2: {option2}."
)
OBQA = "Please choose the correct answer to the question:{question_stem}\n{opts}."
ARC = "Please choose the correct answer to the question:{question}\n{opts}."
OPTION = "Option {label}:\n{text}\n"

# LLM-Adapters' BoolQ rows carry no passage (see frod_ds.prep.llm_adapters): the paper's BoolQ template
# without its "Reference document:\n{passage}\n" part. No passage is invented, not even an empty one.
BOOLQ_NO_PASSAGE = "Question:\n{question}"


@dataclass(frozen=True)
class Example:
    """One rendered row: `choices[label]` is the gold answer string."""

    prompt: str
    choices: tuple[str, ...]
    label: int

    @property
    def answer(self) -> str:
        """The gold answer string, `choices[label]`."""
        return self.choices[self.label]


class RowError(Exception):
    """A source row that does not fit its task's schema.

    `reason` is a short, value-free key ("missing field 'goal'", "label out of range", ...) used to
    count drops; `detail` adds the offending value for `--strict` error messages.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason} ({detail})" if detail else reason)
        self.reason = reason
        self.detail = detail


_TYPE_NAMES = {str: "string", bool: "bool", int: "int", list: "list", dict: "object"}


def row_field(row: dict[str, Any], name: str, kind: type) -> Any:
    """`row[name]`, checked to be exactly of type `kind` (a bool is not an int here)."""
    value = row.get(name)
    if value is None:
        raise RowError(f"missing field '{name}'")
    if type(value) is not kind:
        raise RowError(f"wrong type for '{name}'", f"expected {_TYPE_NAMES[kind]}, got {type(value).__name__}")
    return value


def _label(value: Any, allowed: Sequence[Any], name: str) -> int:
    """Index of the gold label `value` in `allowed`; "" and -1 are HF's "no label" markers."""
    if value == "" or (type(value) is int and value == -1):
        raise RowError("label missing", f"'{name}' is {value!r}")
    if value not in allowed:
        raise RowError("label out of range", f"'{name}' is {value!r}, expected one of {list(allowed)}")
    return list(allowed).index(value)


def _choices(row: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(labels, texts) of an OBQA/ARC `choices` field: {"text": [str], "label": [str]}."""
    choices = row_field(row, "choices", dict)
    labels, texts = choices.get("label"), choices.get("text")
    for name, values in (("label", labels), ("text", texts)):
        if type(values) is not list or not all(type(v) is str for v in values):
            raise RowError("wrong type for 'choices'", f"'choices.{name}' must be a list of strings")
    if not labels or len(labels) != len(texts):
        raise RowError("malformed 'choices'", f"{len(labels)} labels for {len(texts)} texts")
    if len(set(labels)) != len(labels):
        raise RowError("malformed 'choices'", f"duplicate labels {labels}")
    return labels, texts


def _distinct_options(texts: list[str]) -> None:
    """``RowError`` for a multiple-choice row whose options cannot all be told apart: one given twice (a training
    row teaching either is noise, a test row a coin flip). An empty option is an option like any other."""
    if len(set(texts)) != len(texts):
        same = next(t for t in texts if texts.count(t) > 1)
        raise RowError("unanswerable options", f"option {same[:40]!r} is given {texts.count(same)} times")


def render_boolq(row: dict[str, Any]) -> Example:
    """BoolQ: `answer` (bool) → ``true``/``false``."""
    prompt = BOOLQ.format(passage=row_field(row, "passage", str), question=row_field(row, "question", str))
    return Example(prompt, ("true", "false"), 0 if row_field(row, "answer", bool) else 1)


def render_boolq_no_passage(row: dict[str, Any]) -> Example:
    """BoolQ without a passage (LLM-Adapters' rows): ``Question:\n{question}``; `answer` (bool) → ``true``/``false``."""
    prompt = BOOLQ_NO_PASSAGE.format(question=row_field(row, "question", str))
    return Example(prompt, ("true", "false"), 0 if row_field(row, "answer", bool) else 1)


def render_piqa(row: dict[str, Any]) -> Example:
    """PIQA: `label` 0/1 (int) → ``Choice A``/``Choice B``."""
    fields = {name: row_field(row, name, str) for name in ("goal", "sol1", "sol2")}
    _distinct_options([fields["sol1"], fields["sol2"]])
    label = _label(row_field(row, "label", int), (0, 1), "label")
    return Example(PIQA.format(**fields), ("Choice A", "Choice B"), label)


def render_siqa(row: dict[str, Any]) -> Example:
    """SIQA: `label` "1"/"2"/"3" (1-based string) → ``Choice A``..``Choice C``."""
    fields = {name: row_field(row, name, str) for name in ("context", "question", "answerA", "answerB", "answerC")}
    _distinct_options([fields["answerA"], fields["answerB"], fields["answerC"]])
    label = _label(row_field(row, "label", str), ("1", "2", "3"), "label")
    return Example(SIQA.format(**fields), ("Choice A", "Choice B", "Choice C"), label)


def render_hellaswag(row: dict[str, Any]) -> Example:
    """HellaSwag: four `endings`, `label` "0".."3" (string) → ``Ending A``..``Ending D``."""
    ctx = row_field(row, "ctx", str)
    endings = row_field(row, "endings", list)
    if not all(type(e) is str for e in endings):
        raise RowError("wrong type for 'endings'", "expected a list of strings")
    if len(endings) != 4:
        raise RowError("malformed 'endings'", f"expected 4 endings, got {len(endings)}")
    _distinct_options(endings)
    label = _label(row_field(row, "label", str), ("0", "1", "2", "3"), "label")
    text = "".join(HELLASWAG_ENDING.format(k=k, text=e) for k, e in zip("ABCD", endings))
    return Example(HELLASWAG.format(ctx=ctx, endings=text), tuple(f"Ending {k}" for k in "ABCD"), label)


def render_winogrande(row: dict[str, Any]) -> Example:
    """WinoGrande: `answer` "1"/"2" (string) → ``Option1``/``Option2``."""
    fields = {name: row_field(row, name, str) for name in ("sentence", "option1", "option2")}
    _distinct_options([fields["option1"], fields["option2"]])
    label = _label(row_field(row, "answer", str), ("1", "2"), "answer")
    return Example(WINOGRANDE.format(**fields), ("Option1", "Option2"), label)


def _render_options(row: dict[str, Any], template: str, question_field: str) -> Example:
    """OBQA/ARC: options listed in source order, `answerKey` one of the row's choice labels."""
    question = row_field(row, question_field, str)
    labels, texts = _choices(row)
    _distinct_options(texts)
    label = _label(row_field(row, "answerKey", str), labels, "answerKey")
    opts = "".join(OPTION.format(label=lab, text=text) for lab, text in zip(labels, texts))
    prompt = template.format(**{question_field: question, "opts": opts})
    return Example(prompt, tuple(f"Option {lab}" for lab in labels), label)


def render_obqa(row: dict[str, Any]) -> Example:
    """OBQA: `answerKey` "A".."D" → ``Option A``..``Option D``."""
    return _render_options(row, OBQA, "question_stem")


def render_arc(row: dict[str, Any]) -> Example:
    """ARC-Easy/Challenge: the OBQA-style template above; `answerKey` → ``Option {label}``."""
    return _render_options(row, ARC, "question")


RENDERERS: dict[str, Callable[[dict[str, Any]], Example]] = {
    "boolq": render_boolq,
    "piqa": render_piqa,
    "siqa": render_siqa,
    "hellaswag": render_hellaswag,
    "winogrande": render_winogrande,
    "obqa": render_obqa,
    "arc_easy": render_arc,
    "arc_challenge": render_arc,
}


# the fields each task's prompt asks its question with (options and answers may be empty: an option like any other)
PROMPT_FIELDS: dict[str, tuple[str, ...]] = {
    "boolq": ("passage", "question"),
    "piqa": ("goal",),
    "siqa": ("context", "question"),
    "hellaswag": ("ctx",),
    "winogrande": ("sentence",),
    "obqa": ("question_stem",),
    "arc_easy": ("question",),
    "arc_challenge": ("question",),
}


def blank_field(task: str, row: dict[str, Any]) -> str | None:
    """The first prompt field of a rendered source ``row`` holding only whitespace, or ``None``. Such a row is kept
    as published (rendered verbatim); ``--strict`` refuses it: its prompt asks nothing. An empty option is not
    blank here: an option like any other, under ``--strict`` too."""
    return next((f for f in PROMPT_FIELDS.get(task, ()) if isinstance(row.get(f), str) and not row[f].strip()), None)


def render(task: str, row: Any) -> Example:
    """Render one source row of `task`; raises RowError if it does not fit the task's schema."""
    if not isinstance(row, dict):
        raise RowError("row is not an object", f"got {type(row).__name__}")
    return RENDERERS[task](row)


def row_id(task: str, split: str, index: int, row: dict[str, Any]) -> str:
    """The source's `id` field when present, else ``<task>-<split>-<index>`` (0-based row index)."""
    value = row.get("id")
    if value is None or value == "":
        return f"{task}-{split}-{index}"
    if type(value) not in (str, int):
        raise RowError("wrong type for 'id'", f"expected string, got {type(value).__name__}")
    return str(value)
