"""LLM-Adapters' commonsense format (Hu et al. 2023): instruction families, parsing, both templates.

Rows are ``{"instruction", "input", "output", "answer"}``, one instruction per *family* (``true_false``,
``solution``, ``answer``, ``ending``, ``fill_blank``); a row's task is never guessed (SIQA, OBQA and both ARCs
share ``answer``). The ``llm-adapters`` template keeps LLM-Adapters' text character for character; ``paper``
parses the instruction back into the task's fields and renders `frod_ds.prep.templates`. The families'
exact text and what ``paper`` cannot recover: docs/data.md#the-templates-and-files-in-detail.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from frod_ds.prep.tasks import DataPrepError
from frod_ds.prep.templates import Example, RowError, render, render_boolq_no_passage, row_field, row_id

TEMPLATES = ("paper", "llm-adapters")

# finetune.py, generate_prompt, empty input: the 16-space indents, the two spaces after "request." and
# the line of 16 spaces are in the original. The training text is TRAIN_PROMPT + output (+ EOS).
TRAIN_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.  \n"
    "\n"
    "                ### Instruction:\n"
    "                {instruction}\n"
    "                \n"
    "                ### Response:\n"
    "                "
)
# commonsense_evaluate.py, generate_prompt, empty input: one space after "request.", an empty line
# (no spaces) after the instruction.
SCORING_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request. \n"
    "\n"
    "                ### Instruction:\n"
    "                {instruction}\n"
    "\n"
    "                ### Response:\n"
    "                "
)
OUTPUT_PREFIX = "the correct answer is "
SEPARATOR = ""  # LLM-Adapters' prompts end where `output` begins

# What --template paper cannot recover from LLM-Adapters' rows, per task (recorded in the manifest).
PAPER_NOTES = {
    "boolq": "LLM-Adapters' BoolQ rows have no passage; the paper's BoolQ template is rendered without its "
    "'Reference document:\\n{passage}\\n' part, i.e. 'Question:\\n{question}'. No passage is invented.",
    "siqa": "LLM-Adapters writes '{context} {question}'; the question is taken as the last sentence (after the "
    "last space that follows '.', '!' or '?', optionally with a closing quote); rows without one are dropped.",
    "hellaswag": "LLM-Adapters writes '{activity_label}: {ctx}'; ctx is the text after the first ': '.",
    "obqa": "choice labels are A, B, C, D by position (LLM-Adapters keeps only the order).",
    "arc_easy": "choice labels are A, B, C, ... by position (LLM-Adapters keeps only the order), so rows "
    "labelled 1..4 at the source answer 'Option A'..'Option D' here.",
    "arc_challenge": "choice labels are A, B, C, ... by position (LLM-Adapters keeps only the order), so rows "
    "labelled 1..4 at the source answer 'Option A'..'Option D' here.",
}
BOOLQ_NOTE_LLM_ADAPTERS = "LLM-Adapters' BoolQ rows have no passage (question only); the instruction is kept as is."


@dataclass(frozen=True)
class Family:
    """One instruction format: how it starts, how its options and answer words are written."""

    key: str
    tasks: tuple[str, ...]  # the task keys that use it (several: the task cannot be told from the text)
    head: str  # the instruction's opening words
    option: str | None  # option marker stem ("Answer" for "Answer1: "); None: no options (BoolQ)
    option_sep: str  # text before the marker of option k >= 2
    format_sep: str  # text before "Answer format: "
    word: str | None  # answer words are f"{word}{k}", k = 1..K; None: BoolQ's true/false

    @property
    def row_task(self) -> str:
        """The ``task`` value of this family's rows when the task is not known: ``"a|b|..."`` if ambiguous."""
        return "|".join(self.tasks)


FAMILIES: dict[str, Family] = {
    f.key: f
    for f in (
        Family(
            "true_false",
            ("boolq",),
            "Please answer the following question with true or false, question: ",
            None,
            "",
            "\n\n",
            None,
        ),
        Family(
            "solution",
            ("piqa",),
            "Please choose the correct solution to the question: ",
            "Solution",
            "\n\n",
            "\n\n",
            "solution",
        ),
        Family(
            "answer",
            ("siqa", "obqa", "arc_easy", "arc_challenge"),
            "Please choose the correct answer to the question: ",
            "Answer",
            " ",
            "\n\n",
            "answer",
        ),
        Family(
            "ending",
            ("hellaswag",),
            "Please choose the correct ending to complete the given sentence: ",
            "Ending",
            " ",
            "\n\n",
            "ending",
        ),
        Family(
            "fill_blank",
            ("winogrande",),
            "Please choose the correct answer to fill in the blank to complete the given sentence: ",
            "Option",
            " ",
            " ",
            "option",
        ),
    )
}
FAMILY_OF_TASK: dict[str, Family] = {task: f for f in FAMILIES.values() for task in f.tasks}
UNRECOGNIZED = "unrecognized"  # family counter key of rows whose instruction matches no family


@dataclass(frozen=True)
class Parsed:
    """One LLM-Adapters row, parsed: ``words[label]`` is its ``answer``, ``options[i]`` goes with ``words[i]``."""

    family: Family
    instruction: str
    body: str  # the question / goal / sentence / context text before the options
    options: tuple[str, ...]  # option texts in order (empty for BoolQ)
    words: tuple[str, ...]  # answer words in order: ("true", "false") or ("answer1", ..., "answerK")
    label: int
    output: str


def identify(instruction: str) -> Family | None:
    """The family whose opening words start `instruction`, or None."""
    for family in FAMILIES.values():
        if instruction.startswith(family.head):
            return family
    return None


def _answer_words(family: Family, line: str) -> tuple[str, ...]:
    """The words of an ``Answer format:`` line, checked against the family's form."""
    words = tuple(line.split("/"))
    expected = (
        ("true", "false") if family.word is None else tuple(f"{family.word}{k}" for k in range(1, len(words) + 1))
    )
    if words != expected or len(words) < 2:
        raise RowError("malformed 'Answer format:' line", repr(line))
    return words


def _split_options(family: Family, text: str, k_max: int) -> tuple[str, tuple[str, ...]]:
    """(body, options) of the text before the answer-format line."""
    first = f"\n\n{family.option}1: "
    at = text.find(first)
    if at < 0:
        raise RowError("malformed options", f"no {first.strip()!r}")
    body, rest = text[:at], text[at + len(first) :]
    options = []
    for k in range(2, k_max + 1):
        marker = f"{family.option_sep}{family.option}{k}: "
        at = rest.find(marker)
        if at < 0:
            raise RowError("malformed options", f"no {marker.strip()!r} for {k_max} answer words")
        options.append(rest[:at])
        rest = rest[at + len(marker) :]
    if f"{family.option_sep}{family.option}{k_max + 1}: " in rest:
        raise RowError("malformed options", f"more options than the {k_max} answer words")
    return body, (*options, rest)


def parse(row: Any) -> Parsed:
    """Parse one LLM-Adapters row; raises RowError (``reason`` = drop-count key) if it does not fit."""
    if not isinstance(row, dict):
        raise RowError("row is not an object", f"got {type(row).__name__}")
    instruction = row_field(row, "instruction", str)
    if row_field(row, "input", str):
        raise RowError("non-empty 'input'", "LLM-Adapters' commonsense rows have an empty input")
    output, answer = row_field(row, "output", str), row_field(row, "answer", str)
    family = identify(instruction)
    if family is None:
        raise RowError("unrecognized instruction", repr(instruction[:60]))
    rest = instruction[len(family.head) :]
    marker = family.format_sep + "Answer format: "
    at = rest.rfind(marker)
    if at < 0:
        raise RowError("no 'Answer format:' line")
    words = _answer_words(family, rest[at + len(marker) :])
    rest = rest[:at]
    body, options = (rest, ()) if family.option is None else _split_options(family, rest, len(words))
    if answer not in words:
        raise RowError("'answer' is not one of the answer words", f"{answer!r} not in {list(words)}")
    if output != OUTPUT_PREFIX + answer:
        raise RowError("'output' is not 'the correct answer is <answer>'", repr(output))
    return Parsed(family, instruction, body, options, words, words.index(answer), output)


# --- templates ---------------------------------------------------------------------------------


def render_llm_adapters(parsed: Parsed, role: str) -> Example:
    """LLM-Adapters' prompt (`TRAIN_PROMPT` for ``role == "train"``, else `SCORING_PROMPT`), answers
    ``"the correct answer is <word>"`` for every answer word; ``answer`` equals the row's ``output``."""
    template = TRAIN_PROMPT if role == "train" else SCORING_PROMPT
    choices = tuple(OUTPUT_PREFIX + word for word in parsed.words)
    assert choices[parsed.label] == parsed.output, "parse() checked output == OUTPUT_PREFIX + answer"
    return Example(template.format(instruction=parsed.instruction), choices, parsed.label)


_SENTENCE_END = re.compile(r"[.!?][\"']? (?=\S)")


def split_siqa(text: str) -> tuple[str, str]:
    """(context, question) of LLM-Adapters' ``"{context} {question}"``: the question is the last sentence."""
    ends = [m.end() for m in _SENTENCE_END.finditer(text)]
    if not ends or not text.endswith("?"):
        raise RowError("cannot split SIQA context and question")
    return text[: ends[-1] - 1], text[ends[-1] :]


def _need_options(task: str, parsed: Parsed, n: int) -> None:
    if len(parsed.options) != n:
        raise RowError(f"not {n} options", f"{task} row with {len(parsed.options)} options")


def paper_fields(task: str, parsed: Parsed) -> dict[str, Any]:
    """The row in `task`'s Hugging Face schema, as far as LLM-Adapters' text gives it (see `PAPER_NOTES`)."""
    body, opts, label = parsed.body, parsed.options, parsed.label
    if task == "boolq":
        return {"question": body, "answer": label == 0}
    if task == "piqa":
        _need_options(task, parsed, 2)
        return {"goal": body, "sol1": opts[0], "sol2": opts[1], "label": label}
    if task == "siqa":
        _need_options(task, parsed, 3)
        context, question = split_siqa(body)
        return {
            "context": context,
            "question": question,
            "answerA": opts[0],
            "answerB": opts[1],
            "answerC": opts[2],
            "label": str(label + 1),
        }
    if task == "hellaswag":
        _need_options(task, parsed, 4)
        at = body.find(": ")
        if at < 0:
            raise RowError("no activity label before the HellaSwag context")
        return {"ctx": body[at + 2 :], "endings": list(opts), "label": str(label)}
    if task == "winogrande":
        _need_options(task, parsed, 2)
        return {"sentence": body, "option1": opts[0], "option2": opts[1], "answer": str(label + 1)}
    letters = [chr(ord("A") + j) for j in range(len(opts))]
    question_field = "question_stem" if task == "obqa" else "question"
    return {question_field: body, "choices": {"label": letters, "text": list(opts)}, "answerKey": letters[label]}


def render_paper(task: str, parsed: Parsed) -> Example:
    """The paper's template for `task` (BoolQ without a passage: `templates.BOOLQ_NO_PASSAGE`)."""
    fields = paper_fields(task, parsed)
    return render_boolq_no_passage(fields) if task == "boolq" else render(task, fields)


def render_row(parsed: Parsed, task: str | None, role: str, template: str) -> tuple[Example, str | None]:
    """(rendered example, row separator or None for the default) of a parsed row under `template`.

    `task` is None when the row's task is unknown (a `commonsense_170k.json` row); the paper template
    then needs the family to have a single task.
    """
    if template == "llm-adapters":
        return render_llm_adapters(parsed, role), SEPARATOR
    if task is None:
        assert len(parsed.family.tasks) == 1, f"family {parsed.family.key} has no single paper template"
        task = parsed.family.tasks[0]
    return render_paper(task, parsed), None


# --- converting a file's rows ----------------------------------------------------------------------


@dataclass
class Converted:
    """Output rows of one source file, with what was dropped and how many rows each family had."""

    rows: list[dict[str, Any]]
    dropped: Counter[str]  # reason -> rows
    families: Counter[str]  # family key (or UNRECOGNIZED) -> rows read
    kept_families: Counter[str]  # family key -> rows kept
    not_selected: int = 0  # rows of families whose tasks were not selected (combined file only)


def _family_key(row: Any) -> str:
    instruction = row.get("instruction") if isinstance(row, dict) else None
    family = identify(instruction) if isinstance(instruction, str) else None
    return UNRECOGNIZED if family is None else family.key


def convert(
    raw_rows: list[Any],
    *,
    task: str | None,
    role: str,
    template: str,
    origin: str,
    strict: bool,
    split: str = "train",
    selected: frozenset[str] = frozenset(),
    id_prefix: str = "",
) -> Converted:
    """Parse and render the rows of one file.

    `task` given: a per-task file (``<folder>/train.json``); rows of another task's family are dropped.
    `task` None: a combined file (`commonsense_170k.json`); a row's ``task`` is its family's single task
    or `Family.row_task`, rows of families whose tasks are not all in `selected` are skipped, ids are
    ``<id_prefix>-<index>``. Invalid rows are dropped and counted by reason, or with `strict` raise a
    DataPrepError naming `origin` and the row index.
    """
    out = Converted([], Counter(), Counter(), Counter())
    for index, raw in enumerate(raw_rows):
        family_key = _family_key(raw)
        out.families[family_key] += 1
        if task is None and family_key != UNRECOGNIZED and not set(FAMILIES[family_key].tasks) <= selected:
            out.not_selected += 1
            continue
        try:
            parsed = parse(raw)
            if task is not None and parsed.family is not FAMILY_OF_TASK[task]:
                raise RowError("instruction of another task's format", f"family {parsed.family.key}")
            if strict and not parsed.body.strip():  # kept as published without --strict, as the paper path does
                raise RowError("blank question", "the instruction asks nothing before its options")
            example, separator = render_row(parsed, task, role, template)
            rid = row_id(task, split, index, raw) if task is not None else f"{id_prefix}-{index}"
        except RowError as err:
            if strict:
                where = f"{task}: " if task is not None else ""
                raise DataPrepError(f"{where}{origin} row index {index}: {err} (--strict)") from None
            out.dropped[err.reason] += 1
            continue
        row = {"task": task or parsed.family.row_task, "id": rid, "prompt": example.prompt}
        if separator is not None:
            row["separator"] = separator
        row.update(answer=example.answer, choices=list(example.choices), label=example.label)
        out.rows.append(row)
        out.kept_families[family_key] += 1
    return out
